"""Prometheus adapter: stats payloads become the catalog's series with the right values."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from turbowire.connector.prom import build_kv_connector_stats, build_prom_metrics, role_label
from turbowire.connector.stats import TurboWireConnectorStats
from turbowire.metrics_catalog import ENGINE_METRICS


def _config(kv_role: str, extra: dict | None = None) -> SimpleNamespace:
    from vllm.config import KVTransferConfig

    return SimpleNamespace(
        kv_transfer_config=KVTransferConfig(
            kv_connector="TurboWireConnector",
            kv_role=kv_role,
            kv_connector_extra_config=extra or {},
        )
    )


def _build(kv_role: str = "kv_consumer", engines: int = 1, extra: dict | None = None):
    reg = CollectorRegistry()
    types = {
        Gauge: functools.partial(Gauge, registry=reg),
        Counter: functools.partial(Counter, registry=reg),
        Histogram: functools.partial(Histogram, registry=reg),
    }
    labelvalues = {i: ["smollm2", str(i)] for i in range(engines)}
    prom = build_prom_metrics(_config(kv_role, extra), types, ["model_name", "engine"], labelvalues)
    return reg, prom


def _samples(reg: CollectorRegistry) -> dict[tuple[str, frozenset], float]:
    text = generate_latest(reg).decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def _get(samples, name, **labels):
    want = set(labels.items())
    hits = [v for (n, lbls), v in samples.items() if n == name and want <= set(lbls)]
    assert len(hits) == 1, (name, labels, hits)
    return hits[0]


@pytest.mark.parametrize(
    "kv_role,expected",
    [("kv_producer", "producer"), ("kv_consumer", "consumer"), ("kv_both", "both")],
)
def test_role_label(kv_role: str, expected: str) -> None:
    assert role_label(_config(kv_role)) == expected


def test_observe_exports_catalog_series_with_values() -> None:
    reg, prom = _build("kv_producer", engines=2)
    s = TurboWireConnectorStats()
    s.record_send("nixl", "tq4", dense_bytes=4000, wire_bytes=1000)
    s.record_send("nixl", "tq4", dense_bytes=4000, wire_bytes=1000)
    s.observe("transfer_seconds", 0.02, transport="nixl", preset="tq4")
    s.observe("encode_seconds", 0.003, preset="tq4")
    s.record_failure("lease_expired")
    s.set_gauge("staging_bytes_in_use", 100, worker=0)
    s.set_gauge("staging_bytes_in_use", 50, worker=1)
    s.record_store(True, 10)
    s.record_spec(drafted=5, accepted=4, discarded=1)
    prom.observe(s.to_dict(), engine_idx=1)
    smp = _samples(reg)
    base = {"model_name": "smollm2", "engine": "1", "role": "producer"}
    xfer = dict(base, direction="send", transport="nixl", preset="tq4")
    assert _get(smp, "turbowire_kv_dense_bytes_total", **xfer) == 8000
    assert _get(smp, "turbowire_kv_wire_bytes_total", **xfer) == 2000
    assert _get(smp, "turbowire_kv_transfers_total", **xfer) == 2
    assert _get(smp, "turbowire_kv_transfer_failures_total", **base, reason="lease_expired") == 1
    assert _get(smp, "turbowire_staging_in_use_bytes", **base) == 150
    assert _get(smp, "turbowire_store_lookups_total", **base, result="hit") == 1
    assert _get(smp, "turbowire_spec_positions_total", **base, outcome="discarded") == 1
    assert _get(smp, "turbowire_spec_positions_total", **base, outcome="drafted") == 5
    hist = dict(base, transport="nixl", preset="tq4")
    assert _get(smp, "turbowire_kv_transfer_duration_seconds_count", **hist) == 1
    assert _get(smp, "turbowire_kv_transfer_duration_seconds_sum", **hist) == pytest.approx(0.02)
    # encode had no transport label: exported as "" (absent)
    enc = dict(base, transport="", preset="tq4")
    assert _get(smp, "turbowire_kv_encode_duration_seconds_count", **enc) == 1
    # every exported family is in the catalog, with the catalog's labels
    families = {
        f.name: f
        for f in text_string_to_metric_families(generate_latest(reg).decode())
        if not f.name.endswith("_created")  # the text format lists *_created as separate gauges
    }
    by_base = {m.base_name: m for m in ENGINE_METRICS}
    assert set(families) <= set(by_base)
    for name, fam in families.items():
        for sample in fam.samples:
            if sample.name.endswith("_bucket"):
                continue
            assert set(sample.labels) == set(by_base[name].all_labels), sample


def test_gauges_keep_last_reading_per_worker_across_steps() -> None:
    reg, prom = _build()
    a = TurboWireConnectorStats()
    a.set_gauge("leases_outstanding", 3, worker=0)
    a.set_gauge("leases_outstanding", 4, worker=1)
    prom.observe(a.to_dict())
    b = TurboWireConnectorStats()
    b.set_gauge("leases_outstanding", 1, worker=0)  # worker 1 silent this step
    prom.observe(b.to_dict())
    assert _get(_samples(reg), "turbowire_leases_outstanding", engine="0") == 5


def test_counters_accumulate_over_steps_and_ratio_holds() -> None:
    reg, prom = _build("kv_consumer")
    for _ in range(5):
        s = TurboWireConnectorStats()
        s.record_recv("nixl", "k8v4", dense_bytes=3000, wire_bytes=1100)
        prom.observe(s.clone_and_reset().to_dict())
    smp = _samples(reg)
    lbl = dict(engine="0", role="consumer", direction="recv", preset="k8v4")
    dense = _get(smp, "turbowire_kv_dense_bytes_total", **lbl)
    wire = _get(smp, "turbowire_kv_wire_bytes_total", **lbl)
    assert (dense, wire) == (15000, 5500)


def test_malformed_payload_does_not_raise() -> None:
    reg, prom = _build()
    prom.observe({"v": 1, "counters": {"bogus|x=1": 5, "transfers|direction=send": 1}})
    prom.observe({"something": "else"})
    prom.observe({}, engine_idx=7)
    transfers = [v for (n, _l), v in _samples(reg).items() if n == "turbowire_kv_transfers_total"]
    assert transfers == [0.0]  # only the series created at start, untouched


def test_build_kv_connector_stats_roundtrip() -> None:
    s = TurboWireConnectorStats()
    s.record_send("lmcache", "tq3", 100, 30)
    rebuilt = build_kv_connector_stats(s.to_dict())
    assert isinstance(rebuilt, TurboWireConnectorStats)
    assert rebuilt.reduce() == s.reduce()
    assert build_kv_connector_stats(None).is_empty()


def test_default_registry_rebuild_does_not_collide() -> None:
    """vLLM's own classes register in the default registry; building twice must work."""
    from prometheus_client import REGISTRY

    types = {Gauge: Gauge, Counter: Counter, Histogram: Histogram}
    for _ in range(2):
        prom = build_prom_metrics(
            _config("kv_both"), types, ["model_name", "engine"], {0: ["m", "0"]}
        )
    s = TurboWireConnectorStats()
    s.record_stored(77)
    prom.observe(s.to_dict())
    assert (
        REGISTRY.get_sample_value(
            "turbowire_store_stored_bytes_total", {"model_name": "m", "engine": "0", "role": "both"}
        )
        == 77
    )


@pytest.mark.parametrize(
    "kv_role,directions",
    [("kv_producer", {"send"}), ("kv_consumer", {"recv"}), ("kv_both", {"send", "recv"})],
)
def test_traffic_series_exist_at_zero_from_start(kv_role: str, directions: set[str]) -> None:
    """rate() drops the value a series first appears with: the byte counters must start at 0."""
    reg, _prom = _build(kv_role, extra={"preset": "k3v2"})
    smp = _samples(reg)
    for name in ("turbowire_kv_dense_bytes_total", "turbowire_kv_wire_bytes_total"):
        found = {
            dict(lbls)["direction"]: v
            for (n, lbls), v in smp.items()
            if n == name and dict(lbls)["preset"] == "k3v2" and dict(lbls)["transport"] == "nixl"
        }
        assert found == {d: 0.0 for d in directions}
