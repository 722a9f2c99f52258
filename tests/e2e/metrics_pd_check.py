"""Real Prometheus against a live P/D pair: shared by the e2e suite that owns the pair.

The check (called from a test of the module whose fixture runs the engines, so no extra engines
start): Debian's Prometheus scrapes the prefill and decode engines' own /metrics and the proxy's,
with deploy/prometheus/rules.yaml loaded; streamed requests go through the proxy; then

* the recording rule ``turbowire:kv_compression_ratio:rate1m`` of each engine equals the ratio
  that engine's connector logged (vLLM's "KV Transfer metrics:" lines, summed) within 5 %;
* the dashboard's key panel queries (ratio, throughput, transfer p90, TTFT breakdown, staging)
  return data for this live pair.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import httpx
from support.prometheus_local import LocalPrometheus

from turbowire.metrics_summary import logged_ratio, logged_transfer_totals

# vLLM logs connector stats every VLLM_LOG_STATS_INTERVAL seconds (10 by default)
LOG_INTERVAL_S = 10.0


def _hostport(url: str) -> str:
    return url.split("://", 1)[1].rstrip("/")


def stream_completion(proxy_url: str, model: str, prompt: Any, max_tokens: int) -> str:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    text = []
    with httpx.stream("POST", proxy_url + "/v1/completions", json=body, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                text.append(line)
    return "\n".join(text)


def check_prometheus_against_pd(
    stack: Any,
    model: str,
    prompts: Sequence[Any],
    max_tokens: int = 4,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run the check; returns the numbers (asserts inside)."""
    p, d, x = stack.prefill, stack.decode, stack.proxy
    p_off, d_off = len(p.log_text()), len(d.log_text())
    targets = {"vllm": [_hostport(p.url), _hostport(d.url)], "proxy": [_hostport(x.url)]}
    with LocalPrometheus(targets, scrape_interval_s=1.0, evaluation_interval_s=1.0) as prom:
        prom.wait_for_targets_up(60)
        for prompt in prompts:
            assert stream_completion(x.url, model, prompt, max_tokens), "no streamed tokens"
        # the connector's last stats interval must be logged and the counters scraped
        time.sleep(LOG_INTERVAL_S + 3)
        rule = {
            s.labels["instance"]: s.value
            for s in prom.query("turbowire:kv_compression_ratio:rate1m")
        }
        panels = {
            "dense/wire throughput": "sum(turbowire:kv_wire_bytes:rate1m) > 0",
            "transfer p90": "histogram_quantile(0.9, sum by (le) "
            "(rate(turbowire_kv_transfer_duration_seconds_bucket[1m])))",
            "encode p90": "histogram_quantile(0.9, sum by (le) "
            "(rate(turbowire_kv_encode_duration_seconds_bucket[1m])))",
            "TTFT prefill mean": "sum(rate(turbowire_proxy_prefill_duration_seconds_sum[1m])) / "
            "sum(rate(turbowire_proxy_prefill_duration_seconds_count[1m]))",
            "decode TTFT mean": "sum(rate(turbowire_proxy_decode_ttft_seconds_sum[1m])) / "
            "sum(rate(turbowire_proxy_decode_ttft_seconds_count[1m]))",
            "staging capacity": "sum(turbowire_staging_capacity_bytes) > 0",
            "proxy ok requests": 'sum(turbowire_proxy_requests_total{outcome="ok"}) > 0',
        }
        panel_values = {name: prom.query_scalar(expr) for name, expr in panels.items()}
    p_log, d_log = p.log_text()[p_off:], d.log_text()[d_off:]
    logged = {
        _hostport(p.url): logged_ratio(p_log, "sent"),
        _hostport(d.url): logged_ratio(d_log, "received"),
    }
    result = {
        "rule": rule,
        "logged": logged,
        "panels": panel_values,
        "logged_totals": {
            "prefill": logged_transfer_totals(p_log),
            "decode": logged_transfer_totals(d_log),
        },
    }
    log(f"metrics check: {result}")
    for instance, want in logged.items():
        assert want is not None, f"{instance} logged no KV transfer during the check"
        assert instance in rule, f"no recording-rule sample for {instance}: {rule}"
        assert abs(rule[instance] - want) <= 0.05 * want, (instance, rule[instance], want)
    missing = [name for name, v in panel_values.items() if v is None]
    assert not missing, f"dashboard queries without data on a live pair: {missing}"
    return result
