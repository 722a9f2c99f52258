"""Every Prometheus series turbowire exports, in one place.

Why a catalog: the connector's Prometheus adapter (``turbowire.connector.prom``), the proxy
(``turbowire.serving.proxy``), the recording rules, the Grafana dashboard generator, the
docs/metrics.md tables and the naming tests all read this list, so a metric cannot be renamed
in one place and silently missing in another. It imports nothing heavy (no vLLM, no
prometheus_client).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

MetricType = Literal["counter", "gauge", "histogram"]

#: Labels vLLM adds to every connector series (``PrometheusStatLogger`` labelnames).
ENGINE_LABELS: tuple[str, ...] = ("model_name", "engine")
#: Label added by turbowire to every connector series: the engine's kv_role without ``kv_``.
ROLE_LABEL = "role"
ROLES: tuple[str, ...] = ("producer", "consumer", "both")

#: Seconds; 100 us .. 60 s, covering a per-layer encode and a multi-GiB transfer over a slow link.
DURATION_BUCKETS: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
    0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip
#: Seconds for proxy request phases (a CPU prefill of a long prompt takes seconds).
REQUEST_BUCKETS: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0,
)  # fmt: skip


@dataclass(frozen=True)
class MetricSpec:
    """One exported metric family: the name as scraped (counters with ``_total``)."""

    name: str
    type: MetricType
    labels: tuple[str, ...]
    help: str
    source: Literal["engine", "proxy"] = "engine"
    #: For engine metrics: the key in TurboWireConnectorStats.data it comes from.
    stats_name: str = ""

    @property
    def base_name(self) -> str:
        """The name given to prometheus_client (which appends ``_total`` to counters itself)."""
        return self.name[: -len("_total")] if self.type == "counter" else self.name

    @property
    def all_labels(self) -> tuple[str, ...]:
        if self.source == "engine":
            return ENGINE_LABELS + (ROLE_LABEL,) + self.labels
        return self.labels

    def series_names(self) -> tuple[str, ...]:
        """Names of the sample series Prometheus stores for this family."""
        if self.type == "histogram":
            return (f"{self.name}_bucket", f"{self.name}_sum", f"{self.name}_count")
        if self.type == "counter":
            return (self.name, f"{self.base_name}_created")
        return (self.name,)


_XFER = ("direction", "transport", "preset")
_HIST = ("transport", "preset")

ENGINE_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("turbowire_kv_dense_bytes_total", "counter", _XFER,
               "Dense (bf16/fp16) size of the KV moved: staged for decode engines (send) or loaded "
               "and decoded into the paged cache (recv).",
               stats_name="dense_bytes"),
    MetricSpec("turbowire_kv_wire_bytes_total", "counter", _XFER,
               "Encoded bytes of that KV (chunk headers included): what crosses the wire.",
               stats_name="wire_bytes"),
    MetricSpec("turbowire_kv_transfers_total", "counter", _XFER,
               "send: engine steps that staged KV for decode engines; recv: requests whose KV was "
               "loaded.",
               stats_name="transfers"),
    MetricSpec("turbowire_kv_transfer_failures_total", "counter", ("reason",),
               "Failed KV transfers by reason (handshake, timeout, checksum, lease_expired, "
               "lease_refused, ...).",
               stats_name="failures"),
    MetricSpec("turbowire_kv_fallbacks_total", "counter", ("reason",),
               "Requests served without the compressed path (e.g. recomputed locally), by reason.",
               stats_name="fallbacks"),
    MetricSpec("turbowire_kv_encode_duration_seconds", "histogram", _HIST,
               "Time to gather and encode KV into the staging pool, per encode call.",
               stats_name="encode_seconds"),
    MetricSpec("turbowire_kv_decode_duration_seconds", "histogram", _HIST,
               "Time spent verifying, decoding and scattering one request's received KV "
               "into the paged cache (summed over its layer groups).",
               stats_name="decode_seconds"),
    MetricSpec("turbowire_kv_transfer_duration_seconds", "histogram", _HIST,
               "Wall time of one request's KV load, from its READs posted to the last layer "
               "group landed and decoded (decode overlaps the READs).",
               stats_name="transfer_seconds"),
    MetricSpec("turbowire_kv_handshake_duration_seconds", "histogram", _HIST,
               "Time of one peer handshake (side channel + transport registration).",
               stats_name="handshake_seconds"),
    MetricSpec("turbowire_staging_in_use_bytes", "gauge", (),
               "Bytes of the compressed staging pool currently leased (summed over workers).",
               stats_name="staging_bytes_in_use"),
    MetricSpec("turbowire_staging_capacity_bytes", "gauge", (),
               "Size of the compressed staging pool (summed over workers; 0 on an engine "
               "that stages nothing, e.g. a kv_consumer).",
               stats_name="staging_capacity_bytes"),
    MetricSpec("turbowire_leases_outstanding", "gauge", (),
               "Staging leases held for peers that have not released them yet.",
               stats_name="leases_outstanding"),
    MetricSpec("turbowire_store_lookups_total", "counter", ("result",),
               "Store chunk lookups by result: hit (read, verified and decoded), miss (not "
               "stored, or unusable when read).",
               stats_name="store_lookups"),
    MetricSpec("turbowire_store_lookup_bytes_total", "counter", ("result",),
               "Encoded bytes read from the store on hits, or wanted on misses.",
               stats_name="store_lookup_bytes"),
    MetricSpec("turbowire_store_stored_bytes_total", "counter", (),
               "Encoded bytes written to the store.",
               stats_name="stored_bytes"),
    MetricSpec("turbowire_store_failures_total", "counter", ("operation", "reason"),
               "Store operations that failed, by operation (save, load, lookup) and reason "
               "(store_unavailable, store_full, store_miss, checksum, format, ...). A failed load "
               "or lookup is recomputed, a failed save is dropped: never an error to a client.",
               stats_name="store_failures"),
    MetricSpec("turbowire_store_save_duration_seconds", "histogram", _HIST,
               "From the start of a chunk's encode to its bytes written in every store tier.",
               stats_name="store_save_seconds"),
    MetricSpec("turbowire_store_load_duration_seconds", "histogram", _HIST,
               "Wall time of one request's load from the store: chunks read, verified and "
               "decoded into the paged cache (reads overlap decodes).",
               stats_name="store_load_seconds"),
    MetricSpec("turbowire_spec_positions_total", "counter", ("outcome",),
               "Speculative positions seen by the connector: drafted (scheduled for "
               "verification), then accepted (became output tokens) or discarded (rejected; "
               "never saved or shipped).",
               stats_name="spec_positions"),
    MetricSpec("turbowire_stats_dropped_observations_total", "counter", (),
               "Histogram observations dropped because one stats interval held too many.",
               stats_name="dropped_observations"),
)  # fmt: skip

PROXY_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("turbowire_proxy_requests_total", "counter", ("outcome",),
               "Requests handled by the P/D proxy by outcome (ok, prefill_error, decode_error, "
               "client_error).", source="proxy"),
    MetricSpec("turbowire_proxy_in_flight_requests", "gauge", (),
               "Requests currently being proxied.", source="proxy"),
    MetricSpec("turbowire_proxy_ttft_seconds", "histogram", (),
               "Time to first token as the client sees it through the proxy.", source="proxy"),
    MetricSpec("turbowire_proxy_prefill_duration_seconds", "histogram", (),
               "TTFT part 1: the prefill request (max_tokens=1) on the prefill engine.",
               source="proxy"),
    MetricSpec("turbowire_proxy_decode_ttft_seconds", "histogram", (),
               "TTFT parts 2+3: from sending to the decode engine to its first token "
               "(KV transfer + first decode step).", source="proxy"),
    MetricSpec("turbowire_proxy_kv_transfer_duration_seconds", "histogram", (),
               "TTFT part 2, when the decode engine reports it: the KV transfer of the request.",
               source="proxy"),
    MetricSpec("turbowire_proxy_first_decode_duration_seconds", "histogram", (),
               "TTFT part 3, when the transfer time is known: decode TTFT minus the transfer.",
               source="proxy"),
    MetricSpec("turbowire_proxy_request_duration_seconds", "histogram", (),
               "End-to-end request time through the proxy.", source="proxy"),
    MetricSpec("turbowire_proxy_routes_total", "counter", ("route",),
               "Routing decisions of the proxy: pd (no store directory configured), store_hit "
               "(every full prompt chunk is in the store: decode engine only, no prefill), or "
               "P/D because of pd_partial, pd_miss, pd_short, pd_no_scope, pd_unsupported_prompt, "
               "pd_unsupported_input (images, audio, video or prompt embeds: no store lookup), "
               "pd_unknown_model, pd_tokenize_error, pd_directory_error.", source="proxy"),
    MetricSpec("turbowire_proxy_directory_lookup_duration_seconds", "histogram", (),
               "Time to decide a request's route with the store directory: the decode engine's "
               "/tokenize call, chunk hashing and the Redis prefix lookup (failed lookups "
               "included).", source="proxy"),
)  # fmt: skip

ALL_METRICS: tuple[MetricSpec, ...] = ENGINE_METRICS + PROXY_METRICS
BY_STATS_NAME: dict[str, MetricSpec] = {m.stats_name: m for m in ENGINE_METRICS}

#: Labels any turbowire metric may carry (bounded value sets; never ids or free text).
ALLOWED_LABELS = frozenset(
    ENGINE_LABELS
    + (ROLE_LABEL, "direction", "transport", "preset", "reason", "result", "outcome", "route",
       "operation")
)

_NAME_RE = re.compile(r"^turbowire_[a-z][a-z0-9_]*[a-z0-9]$")
_UNIT_SUFFIXES = ("_seconds", "_bytes")
_FORBIDDEN_UNITS = ("_ms", "_milliseconds", "_us", "_microseconds", "_kb", "_mb", "_gb",
                    "_kib", "_mib", "_gib", "_minutes", "_hours", "_percent")  # fmt: skip
_UNITLESS_OK = ("_outstanding", "_requests", "_lookups", "_transfers", "_positions", "_routes",
                "_observations", "_failures", "_fallbacks")  # fmt: skip


def naming_problems(spec: MetricSpec) -> list[str]:
    """Prometheus naming rules (prometheus.io/docs/practices/naming) applied to one metric."""
    problems: list[str] = []
    n = spec.name
    if not _NAME_RE.match(n):
        problems.append(f"{n}: must be turbowire_<snake_case> (no colons: those are for rules)")
    if spec.type == "counter" and not n.endswith("_total"):
        problems.append(f"{n}: counters end in _total")
    if spec.type != "counter" and n.endswith("_total"):
        problems.append(f"{n}: only counters end in _total")
    stem = spec.base_name
    if spec.type == "histogram" and not stem.endswith(_UNIT_SUFFIXES):
        problems.append(f"{n}: histograms carry their base unit (_seconds or _bytes)")
    if not stem.endswith(_UNIT_SUFFIXES + _UNITLESS_OK):
        problems.append(f"{n}: end with a base unit ({_UNIT_SUFFIXES}) or a counted noun")
    for bad in _FORBIDDEN_UNITS:
        if bad + "_" in stem + "_":
            problems.append(f"{n}: use base units, not {bad[1:]}")
    if stem.count("_seconds") + stem.count("_bytes") > 1:
        problems.append(f"{n}: one unit per metric")
    for label in spec.labels:
        if label not in ALLOWED_LABELS:
            problems.append(f"{n}: label {label!r} is not in the low-cardinality allowlist")
    if len(set(spec.all_labels)) != len(spec.all_labels):
        problems.append(f"{n}: duplicate labels {spec.all_labels}")
    if not spec.help.strip():
        problems.append(f"{n}: needs a help text")
    return problems


def exported_series_names() -> frozenset[str]:
    """Every sample series name the code exports (for checking PromQL in rules and dashboards)."""
    return frozenset(s for m in ALL_METRICS for s in m.series_names())


def markdown_table(specs: tuple[MetricSpec, ...]) -> str:
    """The docs/metrics.md table of ``specs`` (tests/unit/test_metric_names.py keeps it in sync)."""
    lines = ["| metric | type | labels | meaning |", "|---|---|---|---|"]
    for m in specs:
        labels = ", ".join(f"`{lbl}`" for lbl in m.all_labels) or "-"
        lines.append(f"| `{m.name}` | {m.type} | {labels} | {m.help} |")
    return "\n".join(lines)
