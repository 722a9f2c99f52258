"""``turbowire metrics``: parsing and arithmetic of the summary, and the CLI against a live page."""

from __future__ import annotations

import functools
import json
from types import SimpleNamespace

import pytest
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    start_http_server,
)
from typer.testing import CliRunner

from turbowire.metrics_summary import Histo, MetricsFormatError, Snapshot, summarize


def _engine_registry(kv_role: str = "kv_producer"):
    from vllm.config import KVTransferConfig

    from turbowire.connector.prom import build_prom_metrics
    from turbowire.connector.stats import TurboWireConnectorStats

    reg = CollectorRegistry()
    types = {c: functools.partial(c, registry=reg) for c in (Gauge, Counter, Histogram)}
    cfg = SimpleNamespace(
        kv_transfer_config=KVTransferConfig(kv_connector="TurboWireConnector", kv_role=kv_role)
    )
    prom = build_prom_metrics(cfg, types, ["model_name", "engine"], {0: ["m", "0"]})

    def feed(n: int, dense: int, wire: int) -> None:
        s = TurboWireConnectorStats()
        for i in range(n):
            s.record_send("nixl", "tq4", dense, wire)
            s.observe("transfer_seconds", 0.004 + 0.001 * i, transport="nixl", preset="tq4")
        s.record_failure("timeout")
        s.set_gauge("staging_bytes_in_use", 1 << 20)
        s.set_gauge("staging_capacity_bytes", 1 << 22)
        s.set_gauge("leases_outstanding", 2)
        prom.observe(s.to_dict())

    return reg, feed


def test_histogram_quantile_matches_prometheus_semantics() -> None:
    h = Histo(((0.1, 2.0), (0.2, 6.0), (0.5, 10.0), (float("inf"), 10.0)), 10.0, 2.0)
    assert h.mean == pytest.approx(0.2)
    assert h.quantile(0.5) == pytest.approx(0.175)  # rank 5 in (0.1, 0.2]: 0.1 + 0.1*3/4
    assert h.quantile(0.9) == pytest.approx(0.425)
    assert Histo((), 0, 0).quantile(0.5) is None
    older = Histo(((0.1, 1.0), (0.2, 1.0), (0.5, 1.0), (float("inf"), 1.0)), 1.0, 0.05)
    assert h.minus(older).count == 9


def test_summary_of_a_real_exposition() -> None:
    reg, feed = _engine_registry()
    feed(10, 4000, 1000)
    first = Snapshot.parse(generate_latest(reg).decode())
    rows = dict(summarize(first))
    assert rows["role"] == "producer"
    assert rows["transfers sent"] == "10"
    assert rows["compression ratio sent"] == "4.00x"
    assert rows["failures"] == "timeout=1"
    assert rows["staging in use / capacity"].endswith("(25.0%)")
    assert rows["leases outstanding"] == "2"
    assert "transfer time mean / p50 / p90" in rows
    feed(5, 3000, 1000)
    second = Snapshot.parse(generate_latest(reg).decode())
    rows = dict(summarize(second, first, 2.0))
    assert rows["compression ratio sent (interval)"] == "3.00x"
    assert rows["dense / wire throughput sent"] == "7.32 KiB/s / 2.44 KiB/s"


def test_not_prometheus_text_is_an_error() -> None:
    with pytest.raises(MetricsFormatError):
        Snapshot.parse("<html>{not metrics}</html>\n")


def test_cli_once_json_against_live_page() -> None:
    from turbowire.cli import app

    reg, feed = _engine_registry("kv_consumer")
    feed(3, 1500, 500)
    server, _thread = start_http_server(0, addr="127.0.0.1", registry=reg)
    try:
        port = server.server_address[1]
        res = CliRunner().invoke(
            app, ["metrics", "--url", f"http://127.0.0.1:{port}", "--once", "--json"]
        )
        assert res.exit_code == 0, res.output
        out = json.loads(res.output)
        rows = out[f"http://127.0.0.1:{port}/metrics"]
        assert rows["role"] == "consumer"
        assert rows["compression ratio sent"] == "3.00x"
        res = CliRunner().invoke(
            app, ["metrics", "--url", f"http://127.0.0.1:{port}/metrics", "--once"]
        )
        assert res.exit_code == 0 and "3.00x" in res.output and "consumer" in res.output
    finally:
        server.shutdown()


def test_cli_once_fails_on_unreachable_url() -> None:
    from support.prometheus_local import free_port

    from turbowire.cli import app

    res = CliRunner().invoke(app, ["metrics", "-u", f"http://127.0.0.1:{free_port()}", "--once"])
    assert res.exit_code == 1


def test_logged_totals_from_vllm_log_lines() -> None:
    from turbowire.connector.stats import TurboWireConnectorStats
    from turbowire.metrics_summary import logged_ratio, logged_transfer_totals

    lines = []
    for dense, wire in ((4000, 1000), (9000, 2000)):
        s = TurboWireConnectorStats()
        s.record_send("nixl", "tq4", dense, wire)
        s.observe("transfer_seconds", 0.01)
        body = ", ".join(f"{k}={v}" for k, v in s.reduce().items())  # as vLLM's KVConnectorLogging
        lines.append(
            f"(APIServer pid=1) INFO 05-01 10:00:00 [metrics.py:98] KV Transfer metrics: {body}"
        )
    text = "noise\n" + "\n".join(lines) + "\nmore noise\n"
    totals = logged_transfer_totals(text)
    assert totals["Dense bytes sent"] == 13000 and totals["Wire bytes sent"] == 3000
    assert totals["Transfers sent"] == 2
    assert logged_ratio(text, "sent") == pytest.approx(13000 / 3000)
    assert logged_ratio(text, "received") is None
