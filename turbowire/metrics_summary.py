"""Summaries of turbowire series scraped from a ``/metrics`` page (for ``turbowire metrics``).

Why its own module: the CLI shows the numbers an operator asks first (how much does compression
save, how slow are transfers, what fails) straight from an engine or the proxy, without a
Prometheus server; keeping parsing and arithmetic here makes them testable without a network.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from turbowire.errors import TurboWireError


class MetricsFormatError(TurboWireError, ValueError):
    """The page is not Prometheus text exposition format."""


@dataclass(frozen=True)
class Histo:
    """A cumulative histogram (summed over label sets): bucket upper bounds -> counts."""

    buckets: tuple[tuple[float, float], ...]
    count: float
    total: float

    @property
    def mean(self) -> float | None:
        return self.total / self.count if self.count else None

    def quantile(self, q: float) -> float | None:
        """Prometheus ``histogram_quantile`` semantics (linear within the bucket)."""
        if not self.count or not self.buckets:
            return None
        rank = q * self.count
        prev_bound, prev_count = 0.0, 0.0
        for bound, count in self.buckets:
            if count >= rank:
                if math.isinf(bound):
                    return prev_bound
                if count == prev_count:
                    return bound
                return prev_bound + (bound - prev_bound) * (rank - prev_count) / (
                    count - prev_count
                )
            prev_bound, prev_count = bound, count
        return prev_bound

    def minus(self, older: Histo | None) -> Histo:
        """Observations since ``older`` (same buckets); for interval quantiles."""
        if older is None:
            return self
        old = dict(older.buckets)
        return Histo(
            tuple((b, c - old.get(b, 0.0)) for b, c in self.buckets),
            self.count - older.count,
            self.total - older.total,
        )


@dataclass
class Snapshot:
    """turbowire series of one page: sample name -> list of (labels, value)."""

    samples: dict[str, list[tuple[dict[str, str], float]]] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> Snapshot:
        snap = cls()
        try:
            families = list(text_string_to_metric_families(text))
        except ValueError as exc:
            raise MetricsFormatError(f"not Prometheus text format: {exc}") from exc
        for fam in families:
            for s in fam.samples:
                if s.name.startswith("turbowire_"):
                    snap.samples.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
        return snap

    def total(self, name: str, **match: str) -> float:
        return sum(
            v
            for labels, v in self.samples.get(name, [])
            if all(labels.get(k) == want for k, want in match.items())
        )

    def by(self, name: str, label: str, **match: str) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for labels, v in self.samples.get(name, []):
            if all(labels.get(k) == want for k, want in match.items()):
                out[labels.get(label, "")] += v
        return dict(out)

    def histogram(self, name: str, **match: str) -> Histo:
        acc: dict[float, float] = defaultdict(float)
        for labels, v in self.samples.get(f"{name}_bucket", []):
            if all(labels.get(k) == want for k, want in match.items()):
                acc[float(labels["le"])] += v
        return Histo(
            tuple(sorted(acc.items())),
            self.total(f"{name}_count", **match),
            self.total(f"{name}_sum", **match),
        )

    def roles(self) -> list[str]:
        roles = {lbl.get("role", "") for series in self.samples.values() for lbl, _ in series}
        return sorted(r for r in roles if r)

    @property
    def is_proxy(self) -> bool:
        return any(n.startswith("turbowire_proxy_") for n in self.samples)

    @property
    def is_engine(self) -> bool:
        return any(n.startswith(("turbowire_kv_", "turbowire_staging_")) for n in self.samples)


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def summarize(
    now: Snapshot, before: Snapshot | None = None, interval_s: float | None = None
) -> list[tuple[str, str]]:
    """Rows of (what, value) for display; rates when a previous snapshot is given."""
    rows: list[tuple[str, str]] = []
    if now.is_engine:
        rows.append(("role", ", ".join(now.roles()) or "-"))
        for direction, word in (("send", "sent"), ("recv", "received")):
            n = now.total("turbowire_kv_transfers_total", direction=direction)
            dense = now.total("turbowire_kv_dense_bytes_total", direction=direction)
            wire = now.total("turbowire_kv_wire_bytes_total", direction=direction)
            if not (n or dense or wire):
                continue
            rows.append((f"transfers {word}", f"{n:.0f}"))
            rows.append((f"dense / wire bytes {word}", f"{fmt_bytes(dense)} / {fmt_bytes(wire)}"))
            rows.append((f"compression ratio {word}", fmt_ratio(_ratio(dense, wire))))
            if before is not None and interval_s:
                d_dense = dense - before.total(
                    "turbowire_kv_dense_bytes_total", direction=direction
                )
                d_wire = wire - before.total("turbowire_kv_wire_bytes_total", direction=direction)
                rows.append(
                    (
                        f"dense / wire throughput {word}",
                        f"{fmt_bytes(d_dense / interval_s)}/s / {fmt_bytes(d_wire / interval_s)}/s",
                    )
                )
                rows.append(
                    (f"compression ratio {word} (interval)", fmt_ratio(_ratio(d_dense, d_wire)))
                )
        for label, metric in (
            ("transfer", "turbowire_kv_transfer_duration_seconds"),
            ("encode", "turbowire_kv_encode_duration_seconds"),
            ("decode", "turbowire_kv_decode_duration_seconds"),
            ("handshake", "turbowire_kv_handshake_duration_seconds"),
        ):
            h = now.histogram(metric)
            if h.count:
                rows.append(
                    (
                        f"{label} time mean / p50 / p90",
                        " / ".join(
                            fmt_seconds(x) for x in (h.mean, h.quantile(0.5), h.quantile(0.9))
                        ),
                    )
                )
        failures = {
            k: v for k, v in now.by("turbowire_kv_transfer_failures_total", "reason").items() if v
        }
        rows.append(("failures", fmt_counts(failures)))
        fallbacks = {k: v for k, v in now.by("turbowire_kv_fallbacks_total", "reason").items() if v}
        rows.append(("fallbacks", fmt_counts(fallbacks)))
        if "turbowire_staging_capacity_bytes" in now.samples:
            used = now.total("turbowire_staging_in_use_bytes")
            cap = now.total("turbowire_staging_capacity_bytes")
            util = _ratio(used, cap)
            rows.append(
                (
                    "staging in use / capacity",
                    f"{fmt_bytes(used)} / {fmt_bytes(cap)}"
                    + (f" ({util:.1%})" if util is not None else ""),
                )
            )
        if "turbowire_leases_outstanding" in now.samples:
            rows.append(("leases outstanding", f"{now.total('turbowire_leases_outstanding'):.0f}"))
        lookups = now.by("turbowire_store_lookups_total", "result")
        if sum(lookups.values()):
            hits = lookups.get("hit", 0.0)
            rows.append(
                (
                    "store hits / lookups",
                    f"{hits:.0f} / {sum(lookups.values()):.0f} "
                    f"({hits / sum(lookups.values()):.1%})",
                )
            )
        stored = now.total("turbowire_store_stored_bytes_total")
        if stored:
            rows.append(("store bytes written", fmt_bytes(stored)))
        spec = now.by("turbowire_spec_positions_total", "outcome")
        if sum(spec.values()):
            rows.append(
                (
                    "spec positions drafted / accepted / discarded",
                    f"{spec.get('drafted', 0):.0f} / {spec.get('accepted', 0):.0f} / "
                    f"{spec.get('discarded', 0):.0f}",
                )
            )
    if now.is_proxy:
        rows.append(
            (
                "proxy requests",
                fmt_counts(
                    {
                        k: v
                        for k, v in now.by("turbowire_proxy_requests_total", "outcome").items()
                        if v
                    }
                ),
            )
        )
        rows.append(("proxy in flight", f"{now.total('turbowire_proxy_in_flight_requests'):.0f}"))
        for label, metric in (
            ("TTFT", "turbowire_proxy_ttft_seconds"),
            ("  prefill", "turbowire_proxy_prefill_duration_seconds"),
            ("  decode TTFT (transfer + first decode)", "turbowire_proxy_decode_ttft_seconds"),
            ("  kv transfer (decode-reported)", "turbowire_proxy_kv_transfer_duration_seconds"),
            ("  first decode", "turbowire_proxy_first_decode_duration_seconds"),
            ("request duration", "turbowire_proxy_request_duration_seconds"),
        ):
            h = now.histogram(metric)
            if h.count:
                rows.append(
                    (
                        f"{label} mean / p90",
                        f"{fmt_seconds(h.mean)} / {fmt_seconds(h.quantile(0.9))}",
                    )
                )
    return rows


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def fmt_seconds(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s * 1e3:.2f} ms" if s < 1 else f"{s:.3f} s"


def fmt_ratio(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}x"


def fmt_counts(counts: dict[str, float]) -> str:
    if not counts:
        return "0"
    return ", ".join(f"{k or '-'}={v:.0f}" for k, v in sorted(counts.items()))


def merge_rows(
    per_source: Iterable[tuple[str, list[tuple[str, str]]]],
) -> list[tuple[str, str, str]]:
    """(source, what, value) rows for one table."""
    return [(src, what, value) for src, rows in per_source for what, value in rows]


_LOG_LINE = re.compile(r"KV Transfer metrics: (.*)$", re.M)


def logged_transfer_totals(log_text: str) -> dict[str, float]:
    """Sum the numeric fields of vLLM's periodic "KV Transfer metrics:" log lines.

    Those lines are ``TurboWireConnectorStats.reduce()`` of each logging interval, so summing the
    byte fields gives what the connector itself logged over a run (e.g. to compare with the
    Prometheus recording rule). Ratios and averages are skipped (they do not add up).
    """
    totals: dict[str, float] = defaultdict(float)
    for m in _LOG_LINE.finditer(log_text):
        for part in m.group(1).split(", "):
            key, eq, value = part.partition("=")
            if not eq or not key.startswith(("Transfers ", "Dense bytes ", "Wire bytes ")):
                continue
            try:
                totals[key] += float(value)
            except ValueError:
                continue
    return dict(totals)


def logged_ratio(log_text: str, direction_word: str) -> float | None:
    """Dense/wire bytes logged for ``direction_word`` ("sent" or "received"), or None."""
    t = logged_transfer_totals(log_text)
    wire = t.get(f"Wire bytes {direction_word}", 0.0)
    return t.get(f"Dense bytes {direction_word}", 0.0) / wire if wire else None
