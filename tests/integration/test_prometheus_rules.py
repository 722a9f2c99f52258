"""Real Prometheus (Debian's binary): rules load and pass promtool, and the recording rule computes
the compression ratio from series exported through the connector's Prometheus adapter."""

from __future__ import annotations

import functools
import subprocess
import threading
import time
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from support.prometheus_local import RULES_PATH, LocalPrometheus, PrometheusError, free_port

pytestmark = pytest.mark.integration


def test_promtool_check_rules() -> None:
    out = subprocess.run(
        ["promtool", "check", "rules", str(RULES_PATH)], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_promtool_rule_unit_tests() -> None:
    """deploy/prometheus/rules_test.yaml: ratio values and alert firing/not firing."""
    out = subprocess.run(
        ["promtool", "test", "rules", "rules_test.yaml"],
        cwd=RULES_PATH.parent,
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def _exporter(kv_role: str, preset: str):
    """A real prometheus_client HTTP exporter carrying the connector's metrics."""
    from vllm.config import KVTransferConfig

    from turbowire.connector.prom import build_prom_metrics

    reg = CollectorRegistry()
    types = {
        Gauge: functools.partial(Gauge, registry=reg),
        Counter: functools.partial(Counter, registry=reg),
        Histogram: functools.partial(Histogram, registry=reg),
    }
    cfg = SimpleNamespace(
        kv_transfer_config=KVTransferConfig(
            kv_connector="TurboWireConnector",
            kv_role=kv_role,
            kv_connector_extra_config={"preset": preset},
        )
    )
    prom = build_prom_metrics(cfg, types, ["model_name", "engine"], {0: ["smollm2", "0"]})
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=reg)
    return prom, port, server, thread


def test_recording_rule_matches_exported_ratio() -> None:
    from turbowire.connector.stats import TurboWireConnectorStats

    p_prom, p_port, p_server, _ = _exporter("kv_producer", "tq4")
    d_prom, d_port, d_server, _ = _exporter("kv_consumer", "tq4")
    total = TurboWireConnectorStats()
    stop = threading.Event()

    def traffic() -> None:
        # uneven request sizes, like real prompts: ratio differs slightly per transfer
        i = 0
        while not stop.is_set():
            tokens = 100 + 37 * (i % 7)
            dense = tokens * 30 * 2 * 3 * 64 * 2
            wire = dense * 2 // 7 + 512
            for prom, rec in ((p_prom, "record_send"), (d_prom, "record_recv")):
                s = TurboWireConnectorStats()
                getattr(s, rec)("nixl", "tq4", dense, wire)
                s.observe("transfer_seconds", 0.001 * tokens, transport="nixl", preset="tq4")
                s.set_gauge("staging_bytes_in_use", wire)
                s.set_gauge("staging_capacity_bytes", 1 << 26)
                prom.observe(s.to_dict())
            total.record_send("nixl", "tq4", dense, wire)
            i += 1
            time.sleep(0.1)

    try:
        with LocalPrometheus(
            {"engines": [f"127.0.0.1:{p_port}", f"127.0.0.1:{d_port}"]},
            scrape_interval_s=1.0,
            evaluation_interval_s=1.0,
        ) as prom:
            prom.wait_for_targets_up(timeout_s=30)
            assert set(prom.rule_health().values()) <= {"ok", "unknown"}
            worker = threading.Thread(target=traffic)
            worker.start()
            time.sleep(8)
            stop.set()
            worker.join()
            expected = total.compression_ratio("send")
            assert expected is not None
            # let the last counters be scraped and the rule evaluated
            time.sleep(3)

            def ratios():
                got = {
                    s.labels["role"]: s.value
                    for s in prom.query("turbowire:kv_compression_ratio:rate1m")
                }
                return got if set(got) == {"producer", "consumer"} else None

            got = prom.wait_for(ratios, 20, "ratio rule for both roles")
            for role, value in got.items():
                assert value == pytest.approx(expected, rel=0.02), (role, value, expected)
            util = prom.query_scalar("max(turbowire:staging_utilization:ratio)")
            max_wire = (100 + 37 * 6) * 30 * 2 * 3 * 64 * 2 * 2 // 7 + 512
            assert util is not None and 0 < util <= max_wire / (1 << 26)
            p90 = prom.query_scalar(
                "histogram_quantile(0.9, sum by (le) "
                "(rate(turbowire_kv_transfer_duration_seconds_bucket{role='consumer'}[1m])))"
            )
            assert p90 is not None and 0.1 <= p90 <= 0.5
            with pytest.raises(PrometheusError):
                prom.query("sum(rate(turbowire_kv_dense_bytes_total[1m])")  # unbalanced
    finally:
        stop.set()
        p_server.shutdown()
        d_server.shutdown()


def test_dashboard_expressions_accepted_by_real_prometheus() -> None:
    """Every PromQL expression of the Grafana dashboard parses and evaluates in Prometheus."""
    from support.promql_check import dashboard_exprs, substitute_grafana_vars

    port = free_port()
    with LocalPrometheus({"self": [f"127.0.0.1:{port}"]}, port=port) as prom:
        exprs = dashboard_exprs()
        for expr in exprs:
            prom.query(
                substitute_grafana_vars(expr)
            )  # raises PrometheusError on a parse/type error
        assert len(exprs) >= 20
