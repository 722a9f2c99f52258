"""Static checks of the PromQL we ship (dashboard panels, recording rules and alerts).

Why: a dashboard query that names a metric nobody exports shows "No data" forever and nobody
notices; these helpers let tests parse every expression (``promql-parser``, the Prometheus
grammar) and compare the names it selects with
:func:`turbowire.metrics_catalog.exported_series_names`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]  # tests/support/ -> the repository
DASHBOARD_PATH = REPO_ROOT / "deploy" / "grafana" / "turbowire.json"
RULES_PATH = REPO_ROOT / "deploy" / "prometheus" / "rules.yaml"

#: Grafana template variables -> values that turn a panel query into plain PromQL.
GRAFANA_VARS: dict[str, str] = {
    "$__rate_interval": "1m",
    "$__interval": "1m",
    "$__range": "1h",
    "$instance": ".*",
    "$preset": ".*",
}


class PromQLCheckError(ValueError):
    """An expression does not parse, or uses a variable the checker does not know."""


def substitute_grafana_vars(expr: str) -> str:
    for var, value in GRAFANA_VARS.items():
        expr = expr.replace(var, value)
    if "$" in expr:
        raise PromQLCheckError(f"unknown Grafana variable in {expr!r}: add it to GRAFANA_VARS")
    return expr


def selector_names(expr: str) -> set[str]:
    """Metric names of every selector in ``expr``; raises ``ValueError`` when it is invalid."""
    import promql_parser

    names: set[str] = set()

    def visit(node: object) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            if not node.name:
                raise PromQLCheckError(f"selector without a metric name in {expr!r}")
            names.add(node.name)

    promql_parser.walk(promql_parser.parse(expr), pre_visit=visit)
    return names


def recording_rule_names(path: Path = RULES_PATH) -> set[str]:
    rules = yaml.safe_load(path.read_text())
    return {r["record"] for g in rules["groups"] for r in g["rules"] if "record" in r}


def rule_exprs(path: Path = RULES_PATH) -> dict[str, str]:
    """rule name (record or alert) -> expression."""
    rules = yaml.safe_load(path.read_text())
    return {r.get("record") or r["alert"]: r["expr"] for g in rules["groups"] for r in g["rules"]}


def dashboard_exprs(path: Path = DASHBOARD_PATH) -> list[str]:
    """Every panel target expression, plus the metric of each ``label_values`` variable."""
    dash = json.loads(path.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    for var in dash["templating"]["list"]:
        m = re.fullmatch(r"label_values\((\w+),\s*\w+\)", str(var.get("query", "")))
        if m:
            exprs.append(m.group(1))
    return exprs
