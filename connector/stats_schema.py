"""The stats payload's vocabulary and wire form: metric and label names, failure reasons, the
series keys, and the checks a payload from another process passes before it is read
(``sanitize_data``). ``TurboWireConnectorStats`` (stats.py) records into this form; prom.py
reads it in the frontend process."""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterator
from typing import Any

from turbowire.errors import TurboWireError

__all__ = [
    "COUNTERS", "DIRECTIONS", "GAUGES", "HISTOGRAMS", "HISTOGRAM_LABELS", "KNOWN_REASONS",
    "MAX_OBSERVATIONS_PER_SERIES", "OTHER_REASON", "P2P_LABEL", "SCHEMA_VERSION",
    "STORE_LABEL", "STORE_OPERATIONS", "StatsLabelError", "check_label_value", "check_reason",
    "empty_data", "iter_counters", "iter_gauges", "iter_histograms",
    "parse_series_key", "sanitize_data", "series_key",
]

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 1

#: Histogram names accepted by :meth:`TurboWireConnectorStats.observe` (values in seconds).
HISTOGRAMS: tuple[str, ...] = (
    "encode_seconds",
    "decode_seconds",
    "transfer_seconds",
    "handshake_seconds",
    "store_save_seconds",
    "store_load_seconds",
)
#: The ``transport`` label value of each path (the label users see; the config key that picks
#: the paths is also named ``transport``): the peer-to-peer NIXL path and the store path.
P2P_LABEL = "nixl"
STORE_LABEL = "store"
#: Labels a histogram observation may carry; missing ones are exported as "".
HISTOGRAM_LABELS: tuple[str, ...] = ("transport", "preset")

#: Gauge names accepted by :meth:`TurboWireConnectorStats.set_gauge`.
GAUGES: tuple[str, ...] = ("staging_bytes_in_use", "staging_capacity_bytes", "leases_outstanding")

#: Counter names and the labels each one carries (all labels always present).
COUNTERS: dict[str, tuple[str, ...]] = {
    "dense_bytes": ("direction", "transport", "preset"),
    "wire_bytes": ("direction", "transport", "preset"),
    "transfers": ("direction", "transport", "preset"),
    "failures": ("reason",),
    "fallbacks": ("reason",),
    "store_lookups": ("result",),
    "store_lookup_bytes": ("result",),
    "stored_bytes": (),
    "store_failures": ("operation", "reason"),
    "spec_positions": ("outcome",),
    "dropped_observations": (),
}

#: Failure/fallback reasons the connector is expected to use (any snake_case word is accepted;
#: these are the ones the alert rules and dashboard know by name).
KNOWN_REASONS: tuple[str, ...] = (
    "handshake",
    "transport",
    "timeout",
    "checksum",
    "format",
    "bounds",
    "lease_expired",
    "lease_refused",
    "peer_unreachable",
    "incompatible",
    "staging_full",
    "store_miss",
    "bad_params",
    "unauthenticated_params",  # params without a valid MAC (auth_token set): nothing dialed
    "peer_not_allowed",  # params naming a host outside prefill_peers: nothing dialed
    "prompt_mismatch",  # params (or a claim) of another prompt than the staged one
    "internal",  # an unexpected error in turbowire's own code: the request fell back
    "staging_share",  # one request would exceed staging_request_share of the pool
    "store_unsupported_input",  # prompt embeds: no store key vLLM would agree with
    "other",
)

DIRECTIONS = ("send", "recv")
STORE_OPERATIONS = ("save", "load", "lookup")

#: Observations kept per histogram series inside one stats object; beyond this they are dropped
#: and counted in ``dropped_observations`` (bounds memory when vLLM accumulates a long interval).
MAX_OBSERVATIONS_PER_SERIES = 50_000

_LABEL_VALUE_RE = re.compile(r"^[A-Za-z0-9_.:+\-]{0,64}$")
_REASON_RE = re.compile(r"^[a-z][a-z0-9_]{0,39}$")
_SEP = "|"


class StatsLabelError(TurboWireError, ValueError):
    """A label value or metric name that would break the key encoding or explode cardinality."""


def check_label_value(label: str, value: object) -> str:
    if not isinstance(value, str) or not _LABEL_VALUE_RE.match(value):
        raise StatsLabelError(
            f"label {label}={value!r} must be a short string of letters, digits and _.:+- "
            "(at most 64 characters); pass a transport/preset name, not free text"
        )
    return value


#: Reason label used when a caller passes something that is not a short snake_case word.
OTHER_REASON = "other"


def check_reason(reason: object) -> str:
    """A reason label, or ``"other"`` for anything else.

    Why not raise: a reason can originate from a peer's ``kv_transfer_params``; a malformed one
    must neither crash the engine loop nor mint a new label value.
    """
    if not isinstance(reason, str) or not _REASON_RE.match(reason):
        logger.warning(
            "turbowire stats: reason %r is not a snake_case word (e.g. %s); counted as %r",
            str(reason)[:80],
            ", ".join(KNOWN_REASONS[:4]),
            OTHER_REASON,
        )
        return OTHER_REASON
    return reason


def series_key(name: str, labels: dict[str, str]) -> str:
    """Encode one series as ``name|k=v|k=v`` with labels sorted by name."""
    parts = [name] + [f"{k}={labels[k]}" for k in sorted(labels)]
    return _SEP.join(parts)


def parse_series_key(key: str) -> tuple[str, dict[str, str]]:
    """Inverse of :func:`series_key`; raises ``StatsLabelError`` on a malformed key."""
    if not isinstance(key, str) or len(key) > 512:
        raise StatsLabelError(f"series key {key!r} is not a string of at most 512 characters")
    name, *pairs = key.split(_SEP)
    labels: dict[str, str] = {}
    for pair in pairs:
        label, eq, value = pair.partition("=")
        if not eq or not label.isidentifier():
            raise StatsLabelError(f"series key {key!r} has a malformed label pair {pair!r}")
        labels[label] = check_label_value(label, value)
    return name, labels


def empty_data() -> dict[str, Any]:
    return {"v": SCHEMA_VERSION, "counters": {}, "histograms": {}, "gauges": {}}


def _is_number(value: object) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value >= 0
    )


def sanitize_data(data: dict[str, Any] | None) -> dict[str, Any]:
    """Return a well-formed copy of ``data``, dropping entries that do not parse.

    Why: the dict crossed a process boundary; the logger and Prometheus side must never crash the
    engine's output loop on a malformed entry, and must not trust lengths or names blindly.
    """
    clean = empty_data()
    if not data:
        return clean
    if not isinstance(data, dict) or data.get("v") != SCHEMA_VERSION:
        logger.warning("ignoring turbowire stats payload with unknown schema: %r", type(data))
        return clean
    dropped = 0
    for key, value in dict(data.get("counters") or {}).items():
        try:
            name, labels = parse_series_key(key)
        except StatsLabelError:
            dropped += 1
            continue
        if name in COUNTERS and set(labels) == set(COUNTERS[name]) and _is_number(value):
            clean["counters"][key] = value
        else:
            dropped += 1
    for key, values in dict(data.get("histograms") or {}).items():
        try:
            name, labels = parse_series_key(key)
        except StatsLabelError:
            dropped += 1
            continue
        if (
            name in HISTOGRAMS
            and set(labels) <= set(HISTOGRAM_LABELS)
            and isinstance(values, list)
            and all(_is_number(v) for v in values)
        ):
            clean["histograms"][key] = list(values[:MAX_OBSERVATIONS_PER_SERIES])
        else:
            dropped += 1
    for key, value in dict(data.get("gauges") or {}).items():
        try:
            name, labels = parse_series_key(key)
        except StatsLabelError:
            dropped += 1
            continue
        if name in GAUGES and set(labels) == {"worker"} and _is_number(value):
            clean["gauges"][key] = value
        else:
            dropped += 1
    if dropped:
        logger.warning("dropped %d malformed turbowire stats entries", dropped)
    return clean


def iter_counters(data: dict[str, Any]) -> Iterator[tuple[str, dict[str, str], float]]:
    """Yield ``(name, labels, value)`` for each counter series of a sanitized payload."""
    for key, value in data["counters"].items():
        name, labels = parse_series_key(key)
        yield name, labels, value


def iter_histograms(data: dict[str, Any]) -> Iterator[tuple[str, dict[str, str], list[float]]]:
    """Yield ``(name, labels, observations)``; labels are completed with "" for missing ones."""
    for key, values in data["histograms"].items():
        name, labels = parse_series_key(key)
        full = {label: labels.get(label, "") for label in HISTOGRAM_LABELS}
        yield name, full, values


def iter_gauges(data: dict[str, Any]) -> Iterator[tuple[str, str, float]]:
    """Yield ``(name, worker, value)`` for each gauge reading."""
    for key, value in data["gauges"].items():
        name, labels = parse_series_key(key)
        yield name, labels["worker"], value
