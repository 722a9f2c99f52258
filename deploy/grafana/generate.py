"""Generate deploy/grafana/turbowire.json with grafana-foundation-sdk (never hand-edit the JSON).

Run ``python deploy/grafana/generate.py`` after changing a panel; ``--check`` exits 1 when the
committed JSON differs from what this script builds (tests/unit/test_dashboard.py runs it).

Why code: panels reference metric names from :mod:`turbowire.metrics_catalog` and rule names from
deploy/prometheus/rules.yaml; the tests parse every PromQL expression here and check that it only
names series the code exports, which is only practical when the dashboard is generated.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from grafana_foundation_sdk.builders import common as common_b
from grafana_foundation_sdk.builders.dashboard import (
    Dashboard,
    DatasourceVariable,
    QueryVariable,
    Row,
)
from grafana_foundation_sdk.builders.prometheus import Dataquery as PromQuery
from grafana_foundation_sdk.builders.stat import Panel as Stat
from grafana_foundation_sdk.builders.timeseries import Panel as Timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models.dashboard import DataSourceRef, VariableRefresh, VariableSort

OUT = Path(__file__).resolve().parent / "turbowire.json"
DS = DataSourceRef(type_val="prometheus", uid="${datasource}")
RI = "$__rate_interval"
# label filter applied to every engine query; $instance and $preset are dashboard variables
SEL = 'instance=~"$instance"'
SELP = f'{SEL}, preset=~"$preset"'


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str


@dataclass(frozen=True)
class PanelSpec:
    title: str
    description: str
    unit: str
    queries: tuple[Query, ...]
    kind: str = "timeseries"  # or "stat"
    width: int = 12
    height: int = 8
    stacked: bool = False
    min_zero: bool = True


@dataclass
class Section:
    title: str
    panels: list[PanelSpec] = field(default_factory=list)


def _quantiles(metric: str, by: str, extra: str = "") -> tuple[Query, ...]:
    sel = f"{SELP}{extra}"
    return tuple(
        Query(
            f"histogram_quantile({q}, sum by (le, {by}) (rate({metric}_bucket{{{sel}}}[{RI}])))",
            f"p{int(q * 100)} {{{{{by}}}}}",
        )
        for q in (0.5, 0.9, 0.99)
    )


def _avg(metric: str, sel: str) -> str:
    return f"sum(rate({metric}_sum{{{sel}}}[{RI}])) / sum(rate({metric}_count{{{sel}}}[{RI}]))"


def sections() -> list[Section]:
    """The dashboard's content: one place to read what is shown."""
    compression = Section(
        "Compression",
        [
            PanelSpec(
                "Compression ratio (now)",
                "Dense KV bytes / wire bytes over the last minute, all selected engines "
                "(sum the rates, then divide).",
                "x",
                (
                    Query(
                        f"sum(turbowire:kv_dense_bytes:rate1m{{{SELP}}}) / "
                        f"sum(turbowire:kv_wire_bytes:rate1m{{{SELP}}})",
                        "ratio",
                    ),
                ),
                kind="stat",
                width=6,
            ),
            PanelSpec(
                "Wire bytes saved (now)",
                "Fraction of dense KV bytes that did not cross the wire.",
                "percentunit",
                (
                    Query(
                        f"1 - sum(turbowire:kv_wire_bytes:rate1m{{{SELP}}}) / "
                        f"sum(turbowire:kv_dense_bytes:rate1m{{{SELP}}})",
                        "saved",
                    ),
                ),
                kind="stat",
                width=6,
            ),
            PanelSpec(
                "Transfers / s",
                "Completed KV transfers per second.",
                "reqps",
                (Query(f"sum(rate(turbowire_kv_transfers_total{{{SELP}}}[{RI}]))", "transfers"),),
                kind="stat",
                width=6,
            ),
            PanelSpec(
                "Failed transfers (5m ratio)",
                "Failed / (failed + completed) transfers over 5 minutes.",
                "percentunit",
                (
                    Query(
                        f"max(turbowire:kv_transfer_failure_ratio:rate5m{{{SEL}}})", "failure ratio"
                    ),
                ),
                kind="stat",
                width=6,
            ),
            PanelSpec(
                "Compression ratio by engine, role and preset",
                "Recording rule turbowire:kv_compression_ratio:rate1m "
                "(deploy/prometheus/rules.yaml).",
                "x",
                (
                    Query(
                        f"turbowire:kv_compression_ratio:rate1m{{{SELP}}}",
                        "{{instance}} {{role}} {{preset}}",
                    ),
                ),
            ),
            PanelSpec(
                "Wire vs dense throughput",
                "Bytes per second moved by KV transfers: dense (what an uncompressed transfer "
                "would "
                "move) against wire (what crossed the network).",
                "Bps",
                (
                    Query(
                        f"sum by (role, direction) (turbowire:kv_dense_bytes:rate1m{{{SELP}}})",
                        "dense {{role}} {{direction}}",
                    ),
                    Query(
                        f"sum by (role, direction) (turbowire:kv_wire_bytes:rate1m{{{SELP}}})",
                        "wire {{role}} {{direction}}",
                    ),
                ),
            ),
        ],
    )
    latency = Section(
        "Latency",
        [
            PanelSpec(
                "KV transfer duration",
                "Quantiles of one transfer's wall time (post to completion).",
                "s",
                _quantiles("turbowire_kv_transfer_duration_seconds", "role"),
            ),
            PanelSpec(
                "Encode / decode duration (p90)",
                "Encode on the prefill side (per engine step), "
                "decode + scatter on the decode side (per request).",
                "s",
                (
                    Query(
                        "histogram_quantile(0.9, sum by (le, preset) (rate("
                        f"turbowire_kv_encode_duration_seconds_bucket{{{SELP}}}[{RI}])))",
                        "encode p90 {{preset}}",
                    ),
                    Query(
                        "histogram_quantile(0.9, sum by (le, preset) (rate("
                        f"turbowire_kv_decode_duration_seconds_bucket{{{SELP}}}[{RI}])))",
                        "decode p90 {{preset}}",
                    ),
                    Query(
                        "histogram_quantile(0.9, sum by (le, transport) (rate("
                        f"turbowire_kv_handshake_duration_seconds_bucket{{{SEL}}}[{RI}])))",
                        "handshake p90 {{transport}}",
                    ),
                ),
            ),
        ],
    )
    reliability = Section(
        "Failures and fallbacks",
        [
            PanelSpec(
                "Transfer failures by reason",
                "Failed transfers per second by reason (lease_expired, timeout, checksum, ...).",
                "reqps",
                (
                    Query(
                        f"sum by (reason, role) (rate(turbowire_kv_transfer_failures_total{{{SEL}}}"
                        f"[{RI}]))",
                        "{{reason}} ({{role}})",
                    ),
                ),
                stacked=True,
            ),
            PanelSpec(
                "Fallbacks by reason",
                "Requests served without the compressed path per second.",
                "reqps",
                (
                    Query(
                        "sum by (reason, role) "
                        f"(rate(turbowire_kv_fallbacks_total{{{SEL}}}[{RI}]))",
                        "{{reason}} ({{role}})",
                    ),
                ),
                stacked=True,
            ),
        ],
    )
    reliability.panels.append(
        PanelSpec(
            "Dropped stats observations",
            "Histogram observations the connector dropped because one stats interval held too many "
            "(should stay 0).",
            "short",
            (
                Query(
                    f"sum(increase(turbowire_stats_dropped_observations_total{{{SEL}}}[1h]))",
                    "dropped (1h)",
                ),
            ),
            kind="stat",
            width=24,
            height=4,
        )
    )
    staging = Section(
        "Staging pool",
        [
            PanelSpec(
                "Staging pool usage",
                "Compressed staging bytes leased vs pool size (prefill side).",
                "bytes",
                (
                    Query(
                        f"sum by (instance) (turbowire_staging_in_use_bytes{{{SEL}}})",
                        "in use {{instance}}",
                    ),
                    Query(
                        f"sum by (instance) (turbowire_staging_capacity_bytes{{{SEL}}})",
                        "capacity {{instance}}",
                    ),
                ),
            ),
            PanelSpec(
                "Staging utilization and leases",
                "Utilization (left) and leases not yet released by decode engines.",
                "percentunit",
                (
                    Query(
                        f"turbowire:staging_utilization:ratio{{{SEL}}}", "utilization {{instance}}"
                    ),
                    Query(
                        f"sum by (instance) (turbowire_leases_outstanding{{{SEL}}})",
                        "leases {{instance}}",
                    ),
                ),
            ),
        ],
    )
    store = Section(
        "Store and speculative decoding",
        [
            PanelSpec(
                "Store hit rate",
                "Share of store (LMCache) chunk lookups that hit, over 5 minutes.",
                "percentunit",
                (Query(f"turbowire:store_hit_ratio:rate5m{{{SEL}}}", "{{instance}}"),),
            ),
            PanelSpec(
                "Store traffic",
                "Encoded bytes written to and read from the store.",
                "Bps",
                (
                    Query(
                        f"sum(rate(turbowire_store_stored_bytes_total{{{SEL}}}[{RI}]))", "stored"
                    ),
                    Query(
                        "sum by (result) "
                        f"(rate(turbowire_store_lookup_bytes_total{{{SEL}}}[{RI}]))",
                        "lookup {{result}}",
                    ),
                ),
            ),
            PanelSpec(
                "Store failures",
                "Store operations that failed per second, by operation and reason (a failed "
                "lookup or load is recomputed, a failed save dropped; clients never see them).",
                "ops",
                (
                    Query(
                        "sum by (operation, reason) "
                        f"(rate(turbowire_store_failures_total{{{SEL}}}[{RI}]))",
                        "{{operation}} {{reason}}",
                    ),
                ),
                stacked=True,
            ),
            PanelSpec(
                "Store save and load latency (p50)",
                "Median time to encode and write one chunk to every tier (save), and to read, "
                "verify and decode one request's stored chunks (load).",
                "s",
                (
                    Query(
                        "histogram_quantile(0.5, sum by (le) (rate("
                        f"turbowire_store_save_duration_seconds_bucket{{{SEL}}}[{RI}])))",
                        "save",
                    ),
                    Query(
                        "histogram_quantile(0.5, sum by (le) (rate("
                        f"turbowire_store_load_duration_seconds_bucket{{{SEL}}}[{RI}])))",
                        "load",
                    ),
                ),
            ),
            PanelSpec(
                "Speculative positions",
                "Decode-side speculative positions per second: drafted (scheduled for "
                "verification), accepted (became output tokens), discarded (rejected: never "
                "saved or shipped).",
                "ops",
                (
                    Query(
                        f"sum by (outcome) (rate(turbowire_spec_positions_total{{{SEL}}}[{RI}]))",
                        "{{outcome}}",
                    ),
                ),
            ),
            PanelSpec(
                "Draft acceptance rate",
                "Accepted / (accepted + discarded) speculative positions on the decode side.",
                "percentunit",
                (
                    Query(
                        "sum(rate(turbowire_spec_positions_total{"
                        f'{SEL}, outcome="accepted"}}[{RI}])) / sum(rate('
                        "turbowire_spec_positions_total{"
                        f'{SEL}, outcome=~"accepted|discarded"}}[{RI}]))',
                        "acceptance",
                    ),
                ),
            ),
        ],
    )
    d_transfer = _avg("turbowire_kv_transfer_duration_seconds", f'{SEL}, role=~"consumer|both"')
    d_ttft = _avg("turbowire_proxy_decode_ttft_seconds", "")
    requests = Section(
        "Requests (proxy)",
        [
            PanelSpec(
                "TTFT breakdown (mean)",
                "Mean time to first token through the P/D proxy, split into prefill (proxy), KV "
                "transfer (decode engine's transfer histogram) and the first decode step "
                "(decode-side TTFT minus the transfer).",
                "s",
                (
                    Query(_avg("turbowire_proxy_prefill_duration_seconds", ""), "prefill"),
                    Query(d_transfer, "kv transfer"),
                    Query(f"clamp_min({d_ttft} - ({d_transfer}), 0)", "first decode"),
                ),
                stacked=True,
            ),
            PanelSpec(
                "TTFT split per request (when the decode engine reports its transfer time)",
                "Mean prefill, KV transfer and first decode step measured per request by the "
                "proxy; "
                "empty when the decode engine does not return its transfer time in "
                "kv_transfer_params.",
                "s",
                (
                    Query(_avg("turbowire_proxy_prefill_duration_seconds", ""), "prefill"),
                    Query(_avg("turbowire_proxy_kv_transfer_duration_seconds", ""), "kv transfer"),
                    Query(
                        _avg("turbowire_proxy_first_decode_duration_seconds", ""), "first decode"
                    ),
                ),
                stacked=True,
            ),
            PanelSpec(
                "TTFT quantiles (proxy)",
                "Client-visible time to first token.",
                "s",
                tuple(
                    Query(
                        f"histogram_quantile({q}, sum by (le) (rate("
                        f"turbowire_proxy_ttft_seconds_bucket[{RI}])))",
                        f"p{int(q * 100)}",
                    )
                    for q in (0.5, 0.9, 0.99)
                ),
            ),
            PanelSpec(
                "Request duration quantiles (proxy)",
                "End-to-end request time through the proxy.",
                "s",
                tuple(
                    Query(
                        f"histogram_quantile({q}, sum by (le) (rate("
                        f"turbowire_proxy_request_duration_seconds_bucket[{RI}])))",
                        f"p{int(q * 100)}",
                    )
                    for q in (0.5, 0.9, 0.99)
                ),
            ),
            PanelSpec(
                "Proxy requests by outcome",
                "Requests per second through the proxy.",
                "reqps",
                (
                    Query(
                        f"sum by (outcome) (rate(turbowire_proxy_requests_total[{RI}]))",
                        "{{outcome}}",
                    ),
                ),
                stacked=True,
            ),
            PanelSpec(
                "Proxy routes",
                "Requests per second by route: pd (prefill then decode), store_hit (every full "
                "chunk of the prompt stored: straight to a decode engine, no prefill), and the "
                "P/D fallbacks when the directory could not answer.",
                "reqps",
                (
                    Query("sum by (route) (rate(turbowire_proxy_routes_total[" + RI + "]))",
                          "{{route}}"),
                ),
                stacked=True,
            ),
            PanelSpec(
                "Directory lookup latency (proxy)",
                "p90 of the proxy's store directory lookup per request.",
                "s",
                (
                    Query(
                        "histogram_quantile(0.9, sum by (le) (rate("
                        f"turbowire_proxy_directory_lookup_duration_seconds_bucket[{RI}])))",
                        "p90",
                    ),
                ),
            ),
            PanelSpec(
                "Requests in flight (proxy)",
                "Requests currently inside the proxy.",
                "short",
                (Query("sum(turbowire_proxy_in_flight_requests)", "in flight"),),
            ),
        ],
    )
    return [compression, latency, reliability, staging, store, requests]


def all_queries() -> list[Query]:
    return [q for s in sections() for p in s.panels for q in p.queries]


def _panel(spec: PanelSpec) -> Stat | Timeseries:
    panel: Stat | Timeseries
    if spec.kind == "stat":
        panel = Stat().reduce_options(common_b.ReduceDataOptions().calcs(["lastNotNull"]))
    else:
        legend = (
            common_b.VizLegendOptions()
            .display_mode(common.LegendDisplayMode.LIST)
            .placement(common.LegendPlacement.BOTTOM)
            .show_legend(True)
        )
        panel = Timeseries().legend(legend).fill_opacity(10 if not spec.stacked else 40)
        if spec.stacked:
            panel = panel.stacking(common_b.StackingConfig().mode(common.StackingMode.NORMAL))
    panel = (
        panel.title(spec.title)
        .description(spec.description)
        .unit(spec.unit)
        .datasource(DS)
        .span(spec.width)
        .height(spec.height)
    )
    if spec.min_zero:
        panel = panel.min(0)
    for i, q in enumerate(spec.queries):
        panel = panel.with_target(
            PromQuery()
            .expr(q.expr)
            .legend_format(q.legend)
            .ref_id(chr(ord("A") + i))
            .datasource(DS)
        )
    return panel


def build() -> dict[str, object]:
    """The dashboard as a JSON-ready dict."""
    dash = (
        Dashboard("turbowire: compressed KV transfer")
        .uid("turbowire-kv")
        .description(
            "Compression ratio, transfer throughput and latency, failures, staging pool, store "
            "and P/D TTFT for the turbowire vLLM KV connector. Generated by "
            "deploy/grafana/generate.py."
        )
        .tags(["turbowire", "vllm", "kv-cache", "disaggregated-serving"])
        .refresh("30s")
        .time("now-1h", "now")
        .timezone("browser")
        .with_variable(DatasourceVariable("datasource").label("Data source").type("prometheus"))
        .with_variable(
            QueryVariable("instance")
            .label("Engine")
            .datasource(DS)
            .query("label_values(turbowire_kv_transfers_total, instance)")
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
            .sort(VariableSort.ALPHABETICAL_ASC)
            .multi(True)
            .include_all(True)
            .all_value(".*")
        )
        .with_variable(
            QueryVariable("preset")
            .label("Preset")
            .datasource(DS)
            .query("label_values(turbowire_kv_transfers_total, preset)")
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
            .sort(VariableSort.ALPHABETICAL_ASC)
            .multi(True)
            .include_all(True)
            .all_value(".*")
        )
    )
    for section in sections():
        dash = dash.with_row(Row(section.title))
        for spec in section.panels:
            dash = dash.with_panel(_panel(spec))
    text = JSONEncoder(sort_keys=True, indent=2).encode(dash.build())
    return json.loads(text)


def render() -> str:
    return json.dumps(build(), indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if turbowire.json is stale")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = args.out.read_text() if args.out.exists() else ""
        if current != text:
            diff = difflib.unified_diff(
                current.splitlines(), text.splitlines(), "committed", "generated", lineterm=""
            )
            sys.stderr.write("\n".join(list(diff)[:60]) + "\n")
            sys.stderr.write(f"{args.out} is stale: run python deploy/grafana/generate.py\n")
            return 1
        return 0
    args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
