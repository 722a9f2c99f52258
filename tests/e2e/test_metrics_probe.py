"""turbowire stats through a real vLLM engine into a real Prometheus, connector-independent.

A probe connector (metrics_probe_connector.py) reports TurboWireConnectorStats tied to the tokens
the engine schedules; Debian's Prometheus scrapes the engine's own /metrics with our recording
rules.
Checks: the series appear with vLLM's labels plus ours, the recording rule's compression ratio
equals the ratio the engine logged ("KV Transfer metrics:" lines) within 5%, byte counters equal
the logged totals and the engine's own token counters, gauges and histograms arrive.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from support.prometheus_local import LocalPrometheus

from turbowire.metrics_summary import logged_ratio, logged_transfer_totals
from turbowire.serving.launch import EngineSpec, free_port, start_engine

pytestmark = pytest.mark.e2e

HERE = Path(__file__).resolve().parent


def test_probe_stats_reach_prometheus_and_match_the_log(
    tiny_model: Path, engine_slot: None, tmp_path: Path
) -> None:
    from metrics_probe_connector import BYTES_PER_TOKEN, WIRE_DIVISOR

    kv = {
        "kv_connector": "StatsProbeConnector",
        "kv_connector_module_path": "metrics_probe_connector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"preset": "tq4"},
    }
    spec = EngineSpec(
        "probe",
        tiny_model,
        free_port(),
        cpu=0,
        served_model_name="tiny",
        kv_transfer_config=kv,
        extra_args=["--no-enable-prefix-caching"],
        env={"PYTHONPATH": str(HERE), "VLLM_LOG_STATS_INTERVAL": "1"},
    )
    engine = start_engine(spec, tmp_path)
    try:
        engine.wait_healthy(600)
        with LocalPrometheus({"vllm": [f"127.0.0.1:{spec.port}"]}) as prom:
            prom.wait_for_targets_up(60)
            n_requests, max_tokens = 6, 4
            for i in range(n_requests):
                r = httpx.post(
                    spec.url + "/v1/completions",
                    timeout=120,
                    json={
                        "model": "tiny",
                        "prompt": "metrics " * (40 + 30 * i),
                        "max_tokens": max_tokens,
                        "temperature": 0,
                        "ignore_eos": True,
                    },
                )
                assert r.status_code == 200, r.text
            time.sleep(4)  # last stats step logged (1 s interval) and scraped (1 s)

            def settled():
                dense = prom.query_scalar("sum(turbowire_kv_dense_bytes_total)")
                gen = prom.query_scalar("sum(vllm:generation_tokens_total)")
                return (dense, gen) if dense and gen == n_requests * max_tokens else None

            dense_total, _ = prom.wait_for(settled, 30, "final counters scraped")
            rule = prom.wait_for(
                lambda: prom.query("turbowire:kv_compression_ratio:rate1m") or None,
                30,
                "recording rule evaluated",
            )
            assert len(rule) == 1
            labels = rule[0].labels
            assert (labels["role"], labels["preset"], labels["model_name"], labels["engine"]) == (
                "producer",
                "tq4",
                "tiny",
                "0",
            )
            wire_total = prom.query_scalar("sum(turbowire_kv_wire_bytes_total)")
            prompt_tokens = prom.query_scalar("sum(vllm:prompt_tokens_total)")
            util = prom.query_scalar("max(turbowire:staging_utilization:ratio)")
            encodes = prom.query_scalar("sum(turbowire_kv_encode_duration_seconds_count)")
            transfers = prom.query_scalar("sum(turbowire_kv_transfers_total)")
        log = engine.log_text()
    finally:
        engine.stop()

    logged = logged_transfer_totals(log)
    ratio_logged = logged_ratio(log, "sent")
    assert ratio_logged is not None, "the engine logged no 'KV Transfer metrics' line"
    assert rule[0].value == pytest.approx(ratio_logged, rel=0.05)
    assert rule[0].value == pytest.approx(WIRE_DIVISOR, rel=0.01)
    # Prometheus holds exactly what the connector logged and what the engine scheduled
    assert dense_total == logged["Dense bytes sent"]
    assert wire_total == logged["Wire bytes sent"]
    scheduled = prompt_tokens + n_requests * (max_tokens - 1)  # no prefix cache: all prefilled
    assert dense_total == scheduled * BYTES_PER_TOKEN
    assert transfers == logged["Transfers sent"] >= n_requests
    assert util is not None and 0 < util < 1
    assert encodes and encodes >= n_requests
