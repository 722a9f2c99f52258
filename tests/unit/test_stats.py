"""TurboWireConnectorStats: recording, aggregation across workers and steps, reduce, and the
msgpack hop vLLM puts the payload through."""

from __future__ import annotations

import pickle
import threading

import pytest

from turbowire.connector.stats import (
    MAX_OBSERVATIONS_PER_SERIES,
    StatsLabelError,
    TurboWireConnectorStats,
    iter_counters,
    parse_series_key,
    sanitize_data,
    series_key,
)


def _worker(rank: int) -> TurboWireConnectorStats:
    s = TurboWireConnectorStats()
    s.record_send("nixl", "tq4", dense_bytes=1000 * (rank + 1), wire_bytes=250 * (rank + 1))
    s.observe("transfer_seconds", 0.010 * (rank + 1), transport="nixl", preset="tq4")
    s.observe("encode_seconds", 0.002, preset="tq4")
    s.set_gauge("staging_bytes_in_use", 4096 * (rank + 1), worker=rank)
    s.set_gauge("staging_capacity_bytes", 1 << 20, worker=rank)
    return s


def test_empty_and_reset() -> None:
    s = TurboWireConnectorStats()
    assert s.is_empty()
    s.record_failure("timeout")
    assert not s.is_empty()
    s.reset()
    assert s.is_empty()
    assert s.reduce()["Transfers sent"] == 0


def test_aggregate_across_workers_sums_counters_and_gauges() -> None:
    agg = _worker(0).aggregate(_worker(1))
    r = agg.reduce()
    assert r["Transfers sent"] == 2
    assert r["Dense bytes sent"] == 3000
    assert r["Wire bytes sent"] == 750
    assert r["Compression ratio sent"] == 4.0
    assert r["Avg transfer time (ms)"] == pytest.approx(15.0)
    # gauges: one reading per worker, summed
    assert r["Staging bytes in use"] == 4096 + 8192
    assert r["Staging capacity bytes"] == 2 << 20
    assert "Transfers received" in r and r["Transfers received"] == 0


def test_aggregate_across_steps_keeps_latest_gauge_per_worker() -> None:
    first = _worker(0)
    later = TurboWireConnectorStats()
    later.set_gauge("staging_bytes_in_use", 100, worker=0)
    later.record_recv("lmcache", "k8v4", dense_bytes=600, wire_bytes=200)
    acc = first.aggregate(later)
    r = acc.reduce()
    assert r["Staging bytes in use"] == 100  # replaced, not summed with 4096
    assert r["Transfers received"] == 1
    assert r["Compression ratio received"] == 3.0
    assert acc.compression_ratio("recv") == pytest.approx(3.0)
    assert acc.compression_ratio("send") == pytest.approx(4.0)


def test_aggregate_is_order_independent_for_counters() -> None:
    a = _worker(0).aggregate(_worker(1)).aggregate(_worker(2))
    b = _worker(2).aggregate(_worker(0)).aggregate(_worker(1))
    assert a.data["counters"] == b.data["counters"]
    assert sorted(
        a.data["histograms"][series_key("transfer_seconds", {"transport": "nixl", "preset": "tq4"})]
    ) == sorted(
        b.data["histograms"][series_key("transfer_seconds", {"transport": "nixl", "preset": "tq4"})]
    )


def test_aggregate_rejects_foreign_stats() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

    with pytest.raises(TypeError):
        TurboWireConnectorStats().aggregate(KVConnectorStats(data={"x": 1}))


def test_reduce_reports_failures_store_spec() -> None:
    s = TurboWireConnectorStats()
    s.record_failure("lease_expired")
    s.record_failure("checksum")
    s.record_fallback("peer_unreachable")
    s.record_store(True, 1000)
    s.record_store(True, 500)
    s.record_store(False, 0)
    s.record_stored(4096)
    s.record_spec(drafted=10)
    s.record_spec(accepted=7, discarded=3)
    s.set_gauge("leases_outstanding", 5)
    s.observe("handshake_seconds", 0.25, transport="nixl")
    r = s.reduce()
    assert r["Failures"] == 2
    assert r["Fallbacks"] == 1
    assert r["Store hits"] == 2 and r["Store misses"] == 1
    assert r["Store hit rate"] == pytest.approx(0.667)
    assert r["Stored bytes"] == 4096
    assert r["Spec positions accepted"] == 7 and r["Spec positions discarded"] == 3
    assert r["Spec positions drafted"] == 10 and r["Spec acceptance rate"] == pytest.approx(0.7)
    assert r["Leases outstanding"] == 5
    assert r["Avg handshake time (ms)"] == 250.0
    failures = {lbl["reason"]: v for n, lbl, v in iter_counters(s.data) if n == "failures"}
    assert failures == {"lease_expired": 1, "checksum": 1}


def test_clone_and_reset_hands_over_everything() -> None:
    s = _worker(0)
    snap = s.clone_and_reset()
    assert s.is_empty()
    assert snap.reduce()["Transfers sent"] == 1
    assert snap.gauge_totals()["staging_bytes_in_use"] == 4096


@pytest.mark.parametrize(
    "call",
    [
        lambda s: s.record_send("nixl", "tq4", -1, 10),
        lambda s: s.record_send("nixl", "tq4", 1.5, 10),
        lambda s: s.record_send("ni|xl", "tq4", 1, 1),
        lambda s: s.record_send("nixl", "a" * 65, 1, 1),
        lambda s: s.observe("encode_ms", 1.0),
        lambda s: s.observe("encode_seconds", -1.0),
        lambda s: s.observe("encode_seconds", float("nan")),
        lambda s: s.observe("encode_seconds", 1.0, request_id="abc"),
        lambda s: s.set_gauge("staging_used", 1.0),
        lambda s: s.record_spec(accepted=-1),
    ],
)
def test_bad_inputs_rejected(call) -> None:
    s = TurboWireConnectorStats()
    with pytest.raises(ValueError):
        call(s)
    assert s.is_empty()


def test_malformed_reason_counts_as_other_without_raising() -> None:
    s = TurboWireConnectorStats()
    s.record_failure("Connection refused by 10.0.0.1")
    s.record_fallback(None)  # type: ignore[arg-type]
    reasons = {(n, lbl["reason"]): v for n, lbl, v in iter_counters(s.data)}
    assert reasons == {("failures", "other"): 1, ("fallbacks", "other"): 1}


def test_label_errors_are_value_errors() -> None:
    assert issubclass(StatsLabelError, ValueError)


def test_series_key_roundtrip() -> None:
    key = series_key("dense_bytes", {"transport": "nixl", "direction": "send", "preset": "tq4"})
    assert key == "dense_bytes|direction=send|preset=tq4|transport=nixl"
    assert parse_series_key(key) == (
        "dense_bytes",
        {"direction": "send", "preset": "tq4", "transport": "nixl"},
    )
    with pytest.raises(StatsLabelError):
        parse_series_key("dense_bytes|direction")


def test_histogram_cap_counts_drops() -> None:
    s = TurboWireConnectorStats()
    key = series_key("decode_seconds", {"preset": "tq4"})
    s.data["histograms"][key] = [0.001] * (MAX_OBSERVATIONS_PER_SERIES - 1)
    s.observe("decode_seconds", 0.002, preset="tq4")
    s.observe("decode_seconds", 0.003, preset="tq4")
    assert len(s.data["histograms"][key]) == MAX_OBSERVATIONS_PER_SERIES
    assert s.reduce()["Dropped observations"] == 1


def test_sanitize_drops_malformed_entries() -> None:
    good = _worker(0).data
    bad = {
        "v": 1,
        "counters": {
            **good["counters"],
            "dense_bytes|direction=send": 5,  # missing labels
            "nope|x=y": 1,  # unknown metric
            "failures|reason=timeout": -3,  # negative
            "wire_bytes|direction=send|preset=tq4|transport=ni xl": 1,  # bad label value
        },
        "histograms": {**good["histograms"], "transfer_seconds": ["x"]},
        "gauges": {**good["gauges"], "leases_outstanding": 3},  # no worker label
    }
    clean = sanitize_data(bad)
    assert clean["counters"] == good["counters"]
    assert clean["histograms"] == good["histograms"]
    assert clean["gauges"] == good["gauges"]
    assert sanitize_data({"v": 99, "counters": {"x": 1}})["counters"] == {}
    rebuilt = TurboWireConnectorStats(data=bad)
    assert rebuilt.data["counters"] == good["counters"]


def test_payload_survives_vllm_msgpack_hop() -> None:
    """The engine core sends SchedulerStats(kv_connector_stats=to_dict()) to the frontend."""
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.metrics.stats import SchedulerStats
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    stats = _worker(0).aggregate(_worker(1))
    stats.record_failure("timeout")
    out = EngineCoreOutputs(scheduler_stats=SchedulerStats(kv_connector_stats=stats.to_dict()))
    frames = MsgpackEncoder().encode(out)
    back = MsgpackDecoder(EngineCoreOutputs).decode(frames)
    payload = back.scheduler_stats.kv_connector_stats
    assert payload == stats.to_dict()
    rebuilt = TurboWireConnectorStats(data=payload)
    assert rebuilt.reduce() == stats.reduce()
    # the worker -> engine-core hop may pickle the object (multiproc executor): plain data only
    assert pickle.loads(pickle.dumps(stats)).data == stats.data


def test_concurrent_recording_and_snapshots_lose_nothing() -> None:
    s = TurboWireConnectorStats()
    snaps: list[TurboWireConnectorStats] = []
    n_threads, n_each = 4, 2000

    def work() -> None:
        for _ in range(n_each):
            s.record_send("nixl", "tq4", 10, 3)

    threads = [threading.Thread(target=work) for _ in range(n_threads)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        snaps.append(s.clone_and_reset())
    for t in threads:
        t.join()
    snaps.append(s.clone_and_reset())
    total = TurboWireConnectorStats()
    for snap in snaps:
        total.aggregate(snap)
    r = total.reduce()
    assert r["Transfers sent"] == n_threads * n_each
    assert r["Dense bytes sent"] == 10 * n_threads * n_each
