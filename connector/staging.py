"""Staging-slot bookkeeping on the prefill side: allocation, leases, heartbeats, expiry.

The prefill scheduler owns this object. Slots are taken while a request is being prefilled
(``reserve``), turned into a *lease* when the request finishes (``lease``), and returned when the
decode engine reports it has read them (``release``) or the lease runs out (``reap``). The gRPC
side channel calls ``release``/``heartbeat`` from its threads, the scheduler calls the rest from
the engine loop, so every method takes the lock.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from turbowire.errors import TurboWireError

logger = logging.getLogger(__name__)


class StagingFullError(TurboWireError, RuntimeError):
    """Not enough free staging slots: back-pressure, the caller falls back."""

    reason = "staging_full"


@dataclass
class Lease:
    """Slots held for one finished request until the decode engine releases them."""

    request_id: str
    slots: list[int]
    expires_at: float
    wire_bytes: int = 0
    heartbeats: int = 0
    consumers: int = 1  # decode workers (TP ranks) that must each release before slots free
    released_by: set[int] = field(default_factory=set)


@dataclass
class PoolSnapshot:
    capacity_slots: int
    used_slots: int
    leases: int
    reserved_requests: int


@dataclass
class StagingPool:
    """Slot allocator (lowest index first, so a request's slots tend to be contiguous)."""

    num_slots: int
    lease_seconds: float
    clock: Callable[[], float] = time.monotonic
    _free: list[int] = field(init=False, repr=False)
    _reserved: dict[str, list[int]] = field(init=False, default_factory=dict, repr=False)
    _leases: dict[str, Lease] = field(init=False, default_factory=dict, repr=False)
    _lock: threading.Lock = field(init=False, default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        if self.num_slots < 1:
            raise ValueError("a staging pool needs at least one slot")
        self._free = list(range(self.num_slots))
        heapq.heapify(self._free)

    # ---- prefill-time -------------------------------------------------------------------
    def reserve(self, request_id: str, count: int) -> list[int]:
        """Take ``count`` more slots for a request in prefill; all or nothing."""
        if count < 0:
            raise ValueError("count must be >= 0")
        with self._lock:
            if request_id in self._leases:
                raise ValueError(f"request {request_id} already holds a lease")
            if count > len(self._free):
                raise StagingFullError(
                    f"staging pool full: need {count} slots, {len(self._free)} free of "
                    f"{self.num_slots}"
                )
            got = [heapq.heappop(self._free) for _ in range(count)]
            self._reserved.setdefault(request_id, []).extend(got)
            return got

    def reserved(self, request_id: str) -> list[int]:
        with self._lock:
            return list(self._reserved.get(request_id, ()))

    def drop(self, request_id: str) -> int:
        """Return a request's reserved slots (abort, fallback). Returns how many."""
        with self._lock:
            slots = self._reserved.pop(request_id, [])
            self._give_back(slots)
            return len(slots)

    def lease(self, request_id: str, wire_bytes: int = 0, consumers: int = 1) -> Lease:
        """Turn the reserved slots of a finished request into a lease that expires."""
        with self._lock:
            slots = self._reserved.pop(request_id, [])
            lease = Lease(
                request_id, slots, self.clock() + self.lease_seconds, wire_bytes,
                consumers=max(1, consumers),
            )
            self._leases[request_id] = lease
            return lease

    # ---- side channel ------------------------------------------------------------------
    def release(
        self, request_ids: Iterable[str], consumer: int = 0
    ) -> tuple[list[str], list[str]]:
        """Decode worker ``consumer`` (its TP rank) read these requests; slots are freed once
        every consumer released. Returns (acknowledged, unknown)."""
        released: list[str] = []
        unknown: list[str] = []
        with self._lock:
            for rid in request_ids:
                lease = self._leases.get(rid)
                if lease is None or not 0 <= consumer < lease.consumers:
                    unknown.append(rid)  # a rank outside the lease's readers frees nothing
                    continue
                lease.released_by.add(consumer)
                released.append(rid)
                if len(lease.released_by) >= lease.consumers:
                    del self._leases[rid]
                    self._give_back(lease.slots)
        return released, unknown

    def heartbeat(self, request_ids: Iterable[str]) -> tuple[list[str], list[str]]:
        """Extend leases of requests the decode engine still waits to read."""
        extended: list[str] = []
        unknown: list[str] = []
        with self._lock:
            now = self.clock()
            for rid in request_ids:
                lease = self._leases.get(rid)
                if lease is None:
                    unknown.append(rid)
                    continue
                lease.expires_at = max(lease.expires_at, now + self.lease_seconds)
                lease.heartbeats += 1
                extended.append(rid)
        return extended, unknown

    def reap(self) -> list[Lease]:
        """Free every expired lease; returns them (the caller counts and logs)."""
        with self._lock:
            now = self.clock()
            expired = [lease for lease in self._leases.values() if lease.expires_at <= now]
            for lease in expired:
                del self._leases[lease.request_id]
                self._give_back(lease.slots)
        for lease in expired:
            logger.warning(
                "lease of request %s expired after %d heartbeats: %d staging slots freed unread",
                lease.request_id,
                lease.heartbeats,
                len(lease.slots),
            )
        return expired

    def snapshot(self) -> PoolSnapshot:
        with self._lock:
            return PoolSnapshot(
                capacity_slots=self.num_slots,
                used_slots=self.num_slots - len(self._free),
                leases=len(self._leases),
                reserved_requests=len(self._reserved),
            )

    def has_lease(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._leases

    def _give_back(self, slots: Iterable[int]) -> None:
        for s in slots:
            heapq.heappush(self._free, s)


class ByteRanges:
    """First-fit allocator of byte ranges in a receive buffer (decode side, worker thread only)."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        self.capacity = capacity
        self._free: list[tuple[int, int]] = [(0, capacity)]  # sorted (start, end)

    def allocate(self, nbytes: int, align: int = 64) -> int | None:
        """Start offset of a free range of ``nbytes`` (aligned), or None if nothing fits now."""
        if nbytes <= 0:
            raise ValueError("nbytes must be positive")
        for i, (start, end) in enumerate(self._free):
            aligned = (start + align - 1) // align * align
            if aligned + nbytes <= end:
                pieces = []
                if aligned > start:
                    pieces.append((start, aligned))
                if aligned + nbytes < end:
                    pieces.append((aligned + nbytes, end))
                self._free[i : i + 1] = pieces
                return aligned
        return None

    def free(self, start: int, nbytes: int) -> None:
        end = start + nbytes
        if start < 0 or end > self.capacity:
            raise ValueError(f"range [{start}, {end}) outside the buffer")
        self._free.append((start, end))
        self._free.sort()
        merged: list[tuple[int, int]] = []
        for s, e in self._free:
            if merged and s < merged[-1][1]:
                raise ValueError(f"double free of range [{s}, {e})")
            if merged and s == merged[-1][1]:
                merged[-1] = (merged[-1][0], e)
            else:
                merged.append((s, e))
        self._free = merged

    @property
    def free_bytes(self) -> int:
        return sum(e - s for s, e in self._free)
