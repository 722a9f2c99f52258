"""Result records of the end-to-end benchmark: per request, per cell, ratios and tables.

Pure logic (no engines), unit-tested. Definitions used in every table:

- **handoff**: the prefill engine's connector finished the request (``prefill_done``) to the decode
  engine's connector reporting the KV in its paged cache (``load_done``), from the timestamps of
  :mod:`turbowire.bench_e2e.timed`. It includes the proxy's hop, the decode engine's scheduling,
  the transfer and (turbowire) verify + decode into the cache.
- **decode TTFT**: the proxy sent the request to the decode engine until its first streamed token
  (KV pull + decode into the cache + the first token): proxy record ``decode_ttft_seconds``.
- **decode request**: the proxy sent the request to the decode engine until the decode engine's
  stream ended (KV pull + decode into the cache + the first ``max_tokens`` tokens): proxy record
  ``total_seconds - prefill_seconds``.
- **TTFT**: client-side, request sent to the proxy until the first streamed token.
- **wire bytes**: bytes that crossed the veth link in both directions during the cell (TCP/IP
  headers, NIXL/UCX, side channel and HTTP to the decode engine included), per request.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

BASELINE = "nixl"


def rate_label(rate_gbit: float | None) -> str:
    """Table label of a link rate: ``0.2G``, ``1G``, ``10G`` or ``unshaped``."""
    if rate_gbit is None:
        return "unshaped"
    return f"{rate_gbit:g}G"


@dataclass
class RequestResult:
    """One measured request."""

    config: str
    rate_gbit: float | None
    length: int
    concurrency: int
    request_id: str
    ok: bool
    ttft_s: float | None = None
    prefill_s: float | None = None  # proxy: prefill engine round trip
    decode_request_s: float | None = None  # proxy: decode engine request until stream end
    decode_ttft_s: float | None = None  # proxy: decode engine request until its first token
    total_s: float | None = None
    handoff_s: float | None = None  # prefill_done (P connector) -> load_done (D connector)
    pull_s: float | None = None  # load_queued (D scheduler) -> load_done (D worker)
    error: str | None = None


@dataclass
class CellResult:
    """Aggregates of one (config, link rate, prompt length, concurrency) cell."""

    config: str
    rate_gbit: float | None
    length: int
    concurrency: int
    n_ok: int
    n_failed: int
    measured_gbit: float | None = None
    handoff_s: float | None = None
    pull_s: float | None = None
    decode_request_s: float | None = None
    decode_ttft_s: float | None = None
    ttft_s: float | None = None
    prefill_s: float | None = None
    wire_bytes: float | None = None  # per request, veth counters
    connector_bytes: float | None = None  # per request, as the connector reports it
    dense_bytes: float | None = None  # per request, dense KV of the prompt
    breakdown: dict[str, float] = field(default_factory=dict)  # seconds per request by phase
    ratios: dict[str, float] = field(default_factory=dict)  # vs the baseline cell

    @property
    def key(self) -> tuple[float | None, int, int]:
        return (self.rate_gbit, self.length, self.concurrency)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def median(values: Iterable[float | None]) -> float | None:
    """Median of the non-missing values, None when there are none."""
    vals = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(vals) if vals else None


def match_events(events: Sequence[dict[str, Any]], request_id: str) -> dict[str, float]:
    """First timestamp of each event whose engine request id contains ``request_id``.

    vLLM turns the proxy's ``X-Request-Id`` into ``cmpl-<id>-0-<suffix>`` on each engine, so the
    match is by substring; the first occurrence wins (hooks may fire more than once).
    """
    out: dict[str, float] = {}
    for ev in events:
        if request_id in str(ev.get("req", "")):
            name = str(ev["ev"])
            t = float(ev["t"])
            if name not in out or t < out[name]:
                out[name] = t
    return out


def handoff_times(marks: dict[str, float]) -> tuple[float | None, float | None]:
    """(handoff, pull) seconds from a request's matched events; None when a mark is missing."""
    done = marks.get("load_done")
    handoff = done - marks["prefill_done"] if done is not None and "prefill_done" in marks else None
    pull = done - marks["load_queued"] if done is not None and "load_queued" in marks else None
    return handoff, pull


def summarize(
    config: str,
    rate_gbit: float | None,
    length: int,
    concurrency: int,
    requests: Sequence[RequestResult],
    *,
    link_bytes: int | None = None,
    connector_bytes: float | None = None,
    dense_bytes_per_token: int | None = None,
    measured_gbit: float | None = None,
    breakdown_totals: dict[str, float] | None = None,
) -> CellResult:
    """Aggregate a cell: medians of the per-request times, bytes per successful request."""
    ok = [r for r in requests if r.ok]
    n = len(ok)
    per = (lambda total: total / n) if n else (lambda total: None)  # noqa: E731
    return CellResult(
        config=config, rate_gbit=rate_gbit, length=length, concurrency=concurrency,
        n_ok=n, n_failed=len(requests) - n, measured_gbit=measured_gbit,
        handoff_s=median(r.handoff_s for r in ok), pull_s=median(r.pull_s for r in ok),
        decode_request_s=median(r.decode_request_s for r in ok),
        decode_ttft_s=median(r.decode_ttft_s for r in ok),
        ttft_s=median(r.ttft_s for r in ok), prefill_s=median(r.prefill_s for r in ok),
        wire_bytes=per(link_bytes) if link_bytes is not None else None,
        connector_bytes=per(connector_bytes) if connector_bytes is not None else None,
        dense_bytes=float(length * dense_bytes_per_token) if dense_bytes_per_token else None,
        breakdown={k: v / n for k, v in (breakdown_totals or {}).items()} if n else {},
    )


RATIO_FIELDS = ("handoff_s", "decode_ttft_s", "decode_request_s", "ttft_s", "wire_bytes")


def add_ratios(cells: Sequence[CellResult], baseline: str = BASELINE) -> None:
    """Fill ``ratios`` of every cell with value / value of the baseline config's same cell."""
    base = {c.key: c for c in cells if c.config == baseline}
    for c in cells:
        b = base.get(c.key)
        c.ratios = {}
        if b is None:
            continue
        for f in RATIO_FIELDS:
            v, bv = getattr(c, f), getattr(b, f)
            if v is not None and bv:
                c.ratios[f] = v / bv


def _fmt_s(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def _fmt_mb(v: float | None) -> str:
    return "-" if v is None else f"{v / 1e6:.1f}"


def _fmt_ratio(c: CellResult, f: str) -> str:
    r = c.ratios.get(f)
    return "-" if r is None else f"{r:.2f}"


def markdown_table(cells: Sequence[CellResult]) -> str:
    """One row per cell, grouped by link rate, length, concurrency, then config."""
    head = ("| link | meas. Gbit/s | prompt | conc | config | ok | handoff s | x nixl | "
            "decode TTFT s | x nixl | decode req s | x nixl | TTFT s | x nixl | wire MB/req | "
            "x nixl | conn. MB/req |")
    sep = "|" + "|".join(["---"] * 17) + "|"
    rows = [head, sep]
    order = sorted(cells, key=lambda c: (math.inf if c.rate_gbit is None else c.rate_gbit,
                                         c.length, c.concurrency, c.config != BASELINE, c.config))
    for c in order:
        meas = "-" if c.measured_gbit is None else f"{c.measured_gbit:.2f}"
        rows.append(
            f"| {rate_label(c.rate_gbit)} | {meas} | {c.length} | {c.concurrency} | {c.config} | "
            f"{c.n_ok}/{c.n_ok + c.n_failed} | {_fmt_s(c.handoff_s)} | "
            f"{_fmt_ratio(c, 'handoff_s')} | "
            f"{_fmt_s(c.decode_ttft_s)} | {_fmt_ratio(c, 'decode_ttft_s')} | "
            f"{_fmt_s(c.decode_request_s)} | {_fmt_ratio(c, 'decode_request_s')} | "
            f"{_fmt_s(c.ttft_s)} | {_fmt_ratio(c, 'ttft_s')} | {_fmt_mb(c.wire_bytes)} | "
            f"{_fmt_ratio(c, 'wire_bytes')} | {_fmt_mb(c.connector_bytes)} |")
    return "\n".join(rows)


def breakdown_table(cells: Sequence[CellResult]) -> str:
    """Per-request seconds by phase (from the connectors' own metrics) for cells that have them."""
    keys = sorted({k for c in cells for k in c.breakdown})
    if not keys:
        return ""
    head = "| link | prompt | conc | config | " + " | ".join(keys) + " | handoff s |"
    rows = [head, "|" + "|".join(["---"] * (5 + len(keys))) + "|"]
    for c in sorted(cells, key=lambda c: (math.inf if c.rate_gbit is None else c.rate_gbit,
                                          c.length, c.concurrency, c.config)):
        if not c.breakdown:
            continue
        vals = " | ".join(_fmt_s(c.breakdown.get(k)) for k in keys)
        rows.append(f"| {rate_label(c.rate_gbit)} | {c.length} | {c.concurrency} | {c.config} | "
                    f"{vals} | {_fmt_s(c.handoff_s)} |")
    return "\n".join(rows)


def prom_sum(text: str, name: str) -> float:
    """Sum of every sample of metric ``name`` (all label sets) in a Prometheus text page."""
    total = 0.0
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        metric, _, rest = line.partition(" ")
        base = metric.split("{", 1)[0]
        if base == name:
            try:
                total += float(rest.split()[0])
            except (ValueError, IndexError):
                continue
    return total
