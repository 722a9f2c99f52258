"""The Grafana dashboard: generated from code, every PromQL expression parses and names only series
the code (metrics catalog) or the recording rules (deploy/prometheus/rules.yaml) export."""

from __future__ import annotations

import subprocess
import sys

import pytest
from support.promql_check import (
    DASHBOARD_PATH as DASHBOARD,
)
from support.promql_check import (
    REPO_ROOT,
    dashboard_exprs,
    recording_rule_names,
    rule_exprs,
    selector_names,
)
from support.promql_check import (
    substitute_grafana_vars as _substitute,
)

from turbowire.metrics_catalog import ENGINE_METRICS, PROXY_METRICS, exported_series_names

GENERATOR = REPO_ROOT / "deploy" / "grafana" / "generate.py"


def test_committed_json_is_what_the_generator_builds() -> None:
    out = subprocess.run(
        [sys.executable, str(GENERATOR), "--check"], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stderr


def test_generator_check_detects_a_stale_file(tmp_path) -> None:
    stale = tmp_path / "d.json"
    stale.write_text(DASHBOARD.read_text().replace("Compression ratio", "Ratio", 1))
    out = subprocess.run(
        [sys.executable, str(GENERATOR), "--check", "--out", str(stale)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 1 and "stale" in out.stderr


def test_dashboard_promql_parses_and_uses_only_exported_names() -> None:
    allowed = exported_series_names() | recording_rule_names()
    exprs = dashboard_exprs()
    assert len(exprs) >= 20
    used: set[str] = set()
    for expr in exprs:
        names = selector_names(_substitute(expr))
        assert names, expr
        unknown = names - allowed
        assert not unknown, f"{expr} names {unknown}, which nothing exports"
        used |= names
    # the dashboard covers the key families of the issue
    for needed in (
        "turbowire:kv_compression_ratio:rate1m",
        "turbowire:kv_wire_bytes:rate1m",
        "turbowire_kv_transfer_duration_seconds_bucket",
        "turbowire_kv_transfer_failures_total",
        "turbowire_staging_in_use_bytes",
        "turbowire:store_hit_ratio:rate5m",
        "turbowire_proxy_prefill_duration_seconds_sum",
        "turbowire_proxy_ttft_seconds_bucket",
    ):
        assert needed in used, needed


def test_rules_use_only_exported_names() -> None:
    allowed = exported_series_names() | recording_rule_names()
    for name, expr in rule_exprs().items():
        unknown = selector_names(expr) - allowed
        assert not unknown, (name, unknown)


@pytest.mark.parametrize(
    "bad",
    [
        "sum(rate(turbowire_kv_dense_bytes_total[1m])",  # unbalanced
        "histogram_quantile(0.9, turbowire_kv_transfer_duration_seconds_bucket[1m])",  # type error
    ],
)
def test_checker_rejects_invalid_promql(bad: str) -> None:
    with pytest.raises(ValueError):
        selector_names(bad)


def test_checker_flags_unknown_metric() -> None:
    names = selector_names(
        "rate(vllm:nixl_bytes_transferred_sum[1m]) / turbowire_kv_wire_bytes_total"
    )
    assert names - exported_series_names() == {"vllm:nixl_bytes_transferred_sum"}


def test_catalog_families_all_reach_the_dashboard_or_rules() -> None:
    """Every exported family is shown somewhere (directly or through a recording rule)."""
    used = set()
    for expr in dashboard_exprs() + list(rule_exprs().values()):
        used |= selector_names(_substitute(expr))
    not_shown = {m.name for m in ENGINE_METRICS + PROXY_METRICS if not set(m.series_names()) & used}
    assert not not_shown, not_shown
