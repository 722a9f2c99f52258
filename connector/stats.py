"""turbowire connector statistics, shaped for vLLM's stats hops.

Why this shape: vLLM moves ``KVConnectorStats`` from each worker to the engine core (aggregated
across workers with :meth:`aggregate`), then ``to_dict()`` goes through msgpack to the frontend
process, where ``build_kv_connector_stats(data)`` rebuilds it for the log line (:meth:`reduce`) and
``KVConnectorPromMetrics.observe(data)`` turns it into Prometheus series. Only plain containers
survive that trip, so ``data`` holds nothing but ``str`` keys, lists and numbers:

.. code-block:: python

    {
      "v": 1,
      "counters":   {"dense_bytes|direction=send|preset=tq4|transport=nixl": 123456, ...},
      "histograms": {"transfer_seconds|preset=tq4|transport=nixl": [0.012, 0.015], ...},
      "gauges":     {"staging_bytes_in_use|worker=0": 1048576.0, ...},
    }

A series key is the internal metric name followed by its sorted ``label=value`` pairs, joined by
``|``. Label values are restricted to a small safe alphabet so keys parse back unambiguously and
label cardinality stays low (no request ids, no exception texts).

Usage on the worker (recording is thread-safe; hand vLLM a snapshot with :meth:`clone_and_reset`)::

    stats = TurboWireConnectorStats()
    stats.record_send("nixl", "tq4", dense_bytes=..., wire_bytes=...)   # once per transfer
    stats.observe("encode_seconds", 0.004, preset="tq4")
    stats.set_gauge("staging_bytes_in_use", pool.used_bytes)   # when it changes
    ...
    def get_kv_connector_stats(self):
        return None if stats.is_empty() else stats.clone_and_reset()
"""

from __future__ import annotations

import logging
import math
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from turbowire.errors import TurboWireError

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

# One lock for all instances: recording may happen on transfer threads while the main thread
# snapshots; a module lock keeps instances picklable/serializable (no lock attribute on them).
_LOCK = threading.RLock()


class StatsLabelError(TurboWireError, ValueError):
    """A label value or metric name that would break the key encoding or explode cardinality."""


def _check_label_value(label: str, value: object) -> str:
    if not isinstance(value, str) or not _LABEL_VALUE_RE.match(value):
        raise StatsLabelError(
            f"label {label}={value!r} must be a short string of letters, digits and _.:+- "
            "(at most 64 characters); pass a transport/preset name, not free text"
        )
    return value


#: Reason label used when a caller passes something that is not a short snake_case word.
OTHER_REASON = "other"


def _check_reason(reason: object) -> str:
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
        labels[label] = _check_label_value(label, value)
    return name, labels


def _empty_data() -> dict[str, Any]:
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
    clean = _empty_data()
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


@dataclass
class TurboWireConnectorStats(KVConnectorStats):
    """Transfer, compression, staging, store and speculative-decoding statistics of one interval.

    Counters add up, histogram observations concatenate, gauges keep the latest reading per worker
    (and are summed across workers when reported): so :meth:`aggregate` is correct both across
    workers (one step) and across steps (one logging interval).
    """

    def __post_init__(self) -> None:
        # A dict handed in came through vLLM's process hops (build_kv_connector_stats): validate.
        self.data = sanitize_data(self.data) if self.data else _empty_data()

    # ---- vLLM contract -------------------------------------------------------------------------
    def reset(self) -> None:
        self.data = _empty_data()

    def is_empty(self) -> bool:
        return not (self.data["counters"] or self.data["histograms"] or self.data["gauges"])

    def aggregate(self, other: KVConnectorStats) -> TurboWireConnectorStats:
        if not isinstance(other, TurboWireConnectorStats):
            raise TypeError(
                f"cannot aggregate TurboWireConnectorStats with {type(other).__name__}; "
                "both sides must come from the turbowire connector"
            )
        if other is self or other.is_empty():
            return self
        with _LOCK:
            counters = self.data["counters"]
            for key, value in other.data["counters"].items():
                counters[key] = counters.get(key, 0) + value
            for key, values in other.data["histograms"].items():
                self._extend(key, values)
            # ``other`` is either another worker (different worker label) or a later step.
            self.data["gauges"].update(other.data["gauges"])
        return self

    def reduce(self) -> dict[str, int | float]:
        """Summarize the interval for vLLM's "KV Transfer metrics:" log line.

        Byte totals are exact integers so a reader can recompute the compression ratio.
        """
        counters = self._counter_totals()
        out: dict[str, int | float] = {}
        for direction, word in (("send", "sent"), ("recv", "received")):
            n = int(counters.get(("transfers", direction), 0))
            dense = int(counters.get(("dense_bytes", direction), 0))
            wire = int(counters.get(("wire_bytes", direction), 0))
            out[f"Transfers {word}"] = n
            if n or dense or wire:
                out[f"Dense bytes {word}"] = dense
                out[f"Wire bytes {word}"] = wire
                out[f"Compression ratio {word}"] = round(dense / wire, 3) if wire else 0.0
        for hist, label in (
            ("transfer_seconds", "transfer"),
            ("encode_seconds", "encode"),
            ("decode_seconds", "decode"),
            ("handshake_seconds", "handshake"),
        ):
            values = self._observations(hist)
            if values.size:
                out[f"Avg {label} time (ms)"] = round(float(values.mean()) * 1e3, 3)
                out[f"P90 {label} time (ms)"] = round(float(np.percentile(values, 90)) * 1e3, 3)
        out["Failures"] = int(counters.get(("failures", None), 0))
        out["Fallbacks"] = int(counters.get(("fallbacks", None), 0))
        gauges = self.gauge_totals()
        for name, label in (
            ("staging_bytes_in_use", "Staging bytes in use"),
            ("staging_capacity_bytes", "Staging capacity bytes"),
            ("leases_outstanding", "Leases outstanding"),
        ):
            if name in gauges:
                out[label] = int(gauges[name])
        hits = int(counters.get(("store_lookups", "hit"), 0))
        misses = int(counters.get(("store_lookups", "miss"), 0))
        if hits or misses:
            out["Store hits"] = hits
            out["Store misses"] = misses
            out["Store hit rate"] = round(hits / (hits + misses), 3)
        if ("stored_bytes", None) in counters:
            out["Stored bytes"] = int(counters[("stored_bytes", None)])
        drafted = int(counters.get(("spec_positions", "drafted"), 0))
        accepted = int(counters.get(("spec_positions", "accepted"), 0))
        discarded = int(counters.get(("spec_positions", "discarded"), 0))
        if drafted or accepted or discarded:
            out["Spec positions drafted"] = drafted
            out["Spec positions accepted"] = accepted
            out["Spec positions discarded"] = discarded
            if accepted + discarded:
                out["Spec acceptance rate"] = round(accepted / (accepted + discarded), 3)
        if ("dropped_observations", None) in counters:
            out["Dropped observations"] = int(counters[("dropped_observations", None)])
        return out

    # ---- recording API (used by the connector) -------------------------------------------------
    def record_send(self, transport: str, preset: str, dense_bytes: int, wire_bytes: int) -> None:
        """One completed outgoing transfer: its dense (bf16 KV) size and the bytes on the wire."""
        self._record_transfer("send", transport, preset, dense_bytes, wire_bytes)

    def record_recv(self, transport: str, preset: str, dense_bytes: int, wire_bytes: int) -> None:
        """One completed incoming transfer: the bytes received and the dense bytes decoded."""
        self._record_transfer("recv", transport, preset, dense_bytes, wire_bytes)

    def observe(self, name: str, seconds: float, **labels: str) -> None:
        """One duration observation; ``name`` in :data:`HISTOGRAMS`, labels transport/preset."""
        if name not in HISTOGRAMS:
            raise StatsLabelError(f"histogram {name!r} unknown; use one of {HISTOGRAMS}")
        extra = set(labels) - set(HISTOGRAM_LABELS)
        if extra:
            raise StatsLabelError(
                f"labels {sorted(extra)} not allowed on {name}; use only {HISTOGRAM_LABELS}"
            )
        seconds = float(seconds)
        if not math.isfinite(seconds) or seconds < 0:
            raise ValueError(f"{name} must be a finite non-negative duration, got {seconds!r}")
        key = series_key(name, {k: _check_label_value(k, v) for k, v in labels.items()})
        with _LOCK:
            self._extend(key, [seconds])

    def record_failure(self, reason: str) -> None:
        """A transfer that failed (the request falls back or errors); ``reason`` is snake_case."""
        self._inc("failures", {"reason": _check_reason(reason)}, 1)

    def record_fallback(self, reason: str) -> None:
        """A request served without the compressed path (e.g. recomputed locally)."""
        self._inc("fallbacks", {"reason": _check_reason(reason)}, 1)

    def set_gauge(self, name: str, value: float, worker: int | str = 0) -> None:
        """Latest reading of a gauge in :data:`GAUGES`; ``worker`` distinguishes TP ranks."""
        if name not in GAUGES:
            raise StatsLabelError(f"gauge {name!r} unknown; use one of {GAUGES}")
        value = float(value)
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"gauge {name} must be finite and non-negative, got {value!r}")
        key = series_key(name, {"worker": _check_label_value("worker", str(worker))})
        with _LOCK:
            self.data["gauges"][key] = value

    def record_store(self, hit: bool, nbytes: int) -> None:
        """One store lookup (LMCache path): hit or miss, and the bytes read (hit) or wanted."""
        result = "hit" if hit else "miss"
        nbytes = self._check_bytes("nbytes", nbytes)
        with _LOCK:
            self._inc("store_lookups", {"result": result}, 1)
            self._inc("store_lookup_bytes", {"result": result}, nbytes)

    def record_stored(self, nbytes: int) -> None:
        """Encoded bytes written to the store."""
        self._inc("stored_bytes", {}, self._check_bytes("nbytes", nbytes))

    def record_store_failure(self, operation: str, reason: str) -> None:
        """A store operation (``save``, ``load``, ``lookup``) that failed, by reason."""
        if operation not in STORE_OPERATIONS:
            raise StatsLabelError(f"store operation {operation!r}: use one of {STORE_OPERATIONS}")
        self._inc("store_failures", {"operation": operation, "reason": _check_reason(reason)}, 1)

    def record_spec(self, drafted: int = 0, accepted: int = 0, discarded: int = 0) -> None:
        """Speculative positions on the decode side: drafted (scheduled for verification), then
        accepted (became output tokens) or discarded (rejected: never saved or shipped)."""
        values = {
            "drafted": self._check_bytes("drafted", drafted),
            "accepted": self._check_bytes("accepted", accepted),
            "discarded": self._check_bytes("discarded", discarded),
        }
        with _LOCK:
            for outcome, value in values.items():
                if value:
                    self._inc("spec_positions", {"outcome": outcome}, value)

    # ---- helpers -------------------------------------------------------------------------------
    def clone_and_reset(self) -> TurboWireConnectorStats:
        """Hand the recorded data to vLLM and start a new interval.

        Gauges go too: they are sent only when set again, and the Prometheus side keeps the last
        reading per worker, so an idle engine sends nothing at all.
        """
        old = TurboWireConnectorStats()
        with _LOCK:
            old.data, self.data = self.data, old.data
        return old

    def gauge_totals(self) -> dict[str, float]:
        """Each gauge summed over the workers that reported it."""
        totals: dict[str, float] = {}
        for name, _worker, value in iter_gauges(self.data):
            totals[name] = totals.get(name, 0.0) + value
        return totals

    def compression_ratio(self, direction: str) -> float | None:
        """Dense/wire bytes of ``direction`` ("send" or "recv"); ``None`` without traffic."""
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
        totals = self._counter_totals()
        wire = totals.get(("wire_bytes", direction), 0)
        return totals.get(("dense_bytes", direction), 0) / wire if wire else None

    def _record_transfer(
        self, direction: str, transport: str, preset: str, dense_bytes: int, wire_bytes: int
    ) -> None:
        labels = {
            "direction": direction,
            "transport": _check_label_value("transport", transport),
            "preset": _check_label_value("preset", preset),
        }
        dense = self._check_bytes("dense_bytes", dense_bytes)
        wire = self._check_bytes("wire_bytes", wire_bytes)
        with _LOCK:
            self._inc("transfers", labels, 1)
            self._inc("dense_bytes", labels, dense)
            self._inc("wire_bytes", labels, wire)

    @staticmethod
    def _check_bytes(what: str, value: int) -> int:
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"{what} must be a non-negative integer, got {value!r}")
        return int(value)

    def _inc(self, name: str, labels: dict[str, str], amount: int | float) -> None:
        key = series_key(name, labels)
        with _LOCK:
            counters = self.data["counters"]
            counters[key] = counters.get(key, 0) + amount

    def _extend(self, key: str, values: list[float]) -> None:
        series = self.data["histograms"].setdefault(key, [])
        room = MAX_OBSERVATIONS_PER_SERIES - len(series)
        series.extend(values[: max(room, 0)])
        if len(values) > room:
            self._inc("dropped_observations", {}, len(values) - max(room, 0))

    def _counter_totals(self) -> dict[tuple[str, str | None], float]:
        """Counters summed to (name, first-label-of-interest) for :meth:`reduce`."""
        pick = {
            "transfers": "direction",
            "dense_bytes": "direction",
            "wire_bytes": "direction",
            "store_lookups": "result",
            "store_lookup_bytes": "result",
            "spec_positions": "outcome",
        }
        totals: dict[tuple[str, str | None], float] = {}
        for name, labels, value in iter_counters(self.data):
            sub = labels.get(pick[name]) if name in pick else None
            totals[(name, sub)] = totals.get((name, sub), 0) + value
        return totals

    def _observations(self, name: str) -> np.ndarray:
        chunks = [v for n, _labels, v in iter_histograms(self.data) if n == name]
        return np.asarray([x for chunk in chunks for x in chunk], dtype=np.float64)
