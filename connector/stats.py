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
import threading
from dataclasses import dataclass

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from turbowire.connector.stats_schema import *  # noqa: F403 (the vocabulary, re-exported)
from turbowire.connector.stats_schema import (
    DIRECTIONS,
    GAUGES,
    HISTOGRAM_LABELS,
    HISTOGRAMS,
    MAX_OBSERVATIONS_PER_SERIES,
    STORE_OPERATIONS,
    StatsLabelError,
    check_label_value,
    check_reason,
    empty_data,
    iter_counters,
    iter_gauges,
    iter_histograms,
    sanitize_data,
    series_key,
)

logger = logging.getLogger(__name__)

# One lock for all instances: recording may happen on transfer threads while the main thread
# snapshots; a module lock keeps instances picklable/serializable (no lock attribute on them).
_LOCK = threading.RLock()


@dataclass
class TurboWireConnectorStats(KVConnectorStats):
    """Transfer, compression, staging, store and speculative-decoding statistics of one interval.

    Counters add up, histogram observations concatenate, gauges keep the latest reading per worker
    (and are summed across workers when reported): so :meth:`aggregate` is correct both across
    workers (one step) and across steps (one logging interval).
    """

    def __post_init__(self) -> None:
        # A dict handed in came through vLLM's process hops (build_kv_connector_stats): validate.
        self.data = sanitize_data(self.data) if self.data else empty_data()

    # ---- vLLM contract -------------------------------------------------------------------------
    def reset(self) -> None:
        self.data = empty_data()

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
        key = series_key(name, {k: check_label_value(k, v) for k, v in labels.items()})
        with _LOCK:
            self._extend(key, [seconds])

    def record_failure(self, reason: str) -> None:
        """A transfer that failed (the request falls back or errors); ``reason`` is snake_case."""
        self._inc("failures", {"reason": check_reason(reason)}, 1)

    def record_fallback(self, reason: str) -> None:
        """A request served without the compressed path (e.g. recomputed locally)."""
        self._inc("fallbacks", {"reason": check_reason(reason)}, 1)

    def set_gauge(self, name: str, value: float, worker: int | str = 0) -> None:
        """Latest reading of a gauge in :data:`GAUGES`; ``worker`` distinguishes TP ranks."""
        if name not in GAUGES:
            raise StatsLabelError(f"gauge {name!r} unknown; use one of {GAUGES}")
        value = float(value)
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"gauge {name} must be finite and non-negative, got {value!r}")
        key = series_key(name, {"worker": check_label_value("worker", str(worker))})
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
        self._inc("store_failures", {"operation": operation, "reason": check_reason(reason)}, 1)

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
            "transport": check_label_value("transport", transport),
            "preset": check_label_value("preset", preset),
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
