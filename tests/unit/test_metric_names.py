"""Naming check: every exported metric follows Prometheus naming rules, and the checker itself
catches the mistakes it is there for."""

from __future__ import annotations

import pytest

from turbowire.metrics_catalog import (
    ALL_METRICS,
    BY_STATS_NAME,
    ENGINE_METRICS,
    MetricSpec,
    exported_series_names,
    naming_problems,
)


@pytest.mark.parametrize("spec", ALL_METRICS, ids=lambda m: m.name)
def test_catalog_names_follow_prometheus_rules(spec: MetricSpec) -> None:
    assert naming_problems(spec) == []


def test_names_unique_and_every_stats_series_has_a_metric() -> None:
    from turbowire.connector.stats import COUNTERS, GAUGES, HISTOGRAMS

    names = [m.name for m in ALL_METRICS]
    assert len(names) == len(set(names))
    assert set(BY_STATS_NAME) == set(COUNTERS) | set(GAUGES) | set(HISTOGRAMS)
    for name, labels in COUNTERS.items():
        assert BY_STATS_NAME[name].labels == labels
        assert BY_STATS_NAME[name].type == "counter"
    for name in GAUGES:
        assert BY_STATS_NAME[name].type == "gauge"
    for name in HISTOGRAMS:
        assert BY_STATS_NAME[name].type == "histogram"
    assert len(ENGINE_METRICS) == len(BY_STATS_NAME)


@pytest.mark.parametrize(
    "bad,fragment",
    [
        (MetricSpec("turbowire_kv_bytes", "counter", (), "x"), "_total"),
        (MetricSpec("vllm:turbowire_kv_bytes_total", "counter", (), "x"), "colons"),
        (MetricSpec("turbowire_transfer_ms", "histogram", (), "x"), "base unit"),
        (MetricSpec("turbowire_transfer_duration_milliseconds", "histogram", (), "x"), "base unit"),
        (MetricSpec("turbowire_staging_used_mb", "gauge", (), "x"), "base unit"),
        (MetricSpec("turbowire_ratio_total", "gauge", (), "x"), "only counters"),
        (MetricSpec("turbowire_kv_bytes_total", "counter", ("request_id",), "x"), "allowlist"),
        (MetricSpec("turbowire_kv_bytes_total", "counter", ("engine",), "x"), "duplicate"),
        (MetricSpec("turbowire_kv_bytes_total", "counter", (), " "), "help"),
    ],
)
def test_checker_catches_bad_names(bad: MetricSpec, fragment: str) -> None:
    problems = naming_problems(bad)
    assert any(fragment in p for p in problems), problems


def test_series_names_include_histogram_parts() -> None:
    names = exported_series_names()
    assert "turbowire_kv_transfer_duration_seconds_bucket" in names
    assert "turbowire_kv_dense_bytes_total" in names
    assert "turbowire_proxy_ttft_seconds_count" in names
    assert "turbowire_kv_transfer_duration_seconds" not in names


def test_metrics_page_documents_every_metric_and_rule() -> None:
    """docs/metrics.md tables are generated from the catalog; every rule and alert is described."""
    import re
    from pathlib import Path

    from support.promql_check import REPO_ROOT, rule_exprs

    from turbowire.metrics_catalog import PROXY_METRICS, markdown_table

    readme = (REPO_ROOT / "docs" / "metrics.md").read_text()
    for tag, specs in (("engine", ENGINE_METRICS), ("proxy", PROXY_METRICS)):
        m = re.search(
            rf"<!-- metrics-table:{tag} -->\n(.*?)\n<!-- /metrics-table:{tag} -->", readme, re.S
        )
        assert m, f"docs/metrics.md lacks the {tag} metrics table markers"
        assert m.group(1) == markdown_table(specs), (
            f"docs/metrics.md {tag} table is stale: regenerate it with "
            "turbowire.metrics_catalog.markdown_table"
        )
    for name in rule_exprs():
        assert f"`{name}`" in readme, f"docs/metrics.md does not describe rule {name}"
    assert Path(REPO_ROOT / "deploy" / "grafana" / "turbowire.json").name in readme
