"""Staging-slot bookkeeping on the prefill side: allocation, leases, heartbeats, expiry.

The prefill scheduler owns this object. Slots are taken while a request is being prefilled
(``reserve``), turned into a *lease* when the request finishes (``lease``), and returned when the
decode engine reports it has read them (``release``) or the lease runs out (``reap``). The gRPC
side channel calls ``release``/``heartbeat`` from its threads, the scheduler calls the rest from
the engine loop, so every method takes the lock.

A lease is bound to the prompt it was staged for (``prompt_digest`` and ``num_tokens``, recorded
by the prefill engine): a heartbeat or claim that presents another digest or token count (the
decode engine's own prompt) extends nothing and is answered ``mismatched``, so params of one
prompt presented with another are never loaded, whatever their ``turbowire_prompt_hash`` says.
A new lease waits ``claim_seconds`` for its first claim or heartbeat (an unclaimed lease stops
holding the pool early), and heartbeats extend it by ``lease_seconds`` up to ``max_age_seconds``
in all.

Every lease carries an unguessable ``token`` (its capability, handed to the decode engine in the
request's ``kv_transfer_params``). The side channel passes the tokens its caller presented, and
a release or heartbeat without the lease's token frees or extends nothing: to the caller it is
unknown *and refused* (the lease is held, its token was not presented: the caller's params were
altered or belong to another request, which is not an expiry), and ``on_refused`` hears of it
(the scheduler counts it). ``tokens=None`` is for the engine's own (trusted, in-process) calls
only.
"""

from __future__ import annotations

import heapq
import hmac
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from turbowire.connector.params import new_lease_token
from turbowire.errors import TurboWireError

logger = logging.getLogger(__name__)


class StagingFullError(TurboWireError, RuntimeError):
    """Not enough free staging slots: back-pressure, the caller falls back."""

    reason = "staging_full"


class StagingShareError(StagingFullError):
    """The request would hold more than its share of the pool (``staging_request_share``)."""

    reason = "staging_share"


class DuplicateLeaseError(TurboWireError, ValueError):
    """A request id that already holds a lease asked for slots again (a repeated request id):
    the new request falls back, the lease of the first one is left alone."""

    reason = "internal"


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
    token: str = field(default_factory=new_lease_token, repr=False)  # the lease's capability
    refusals: int = 0  # calls that named this lease without its token
    prompt_digest: str | None = None  # of the staged prompt tokens (None: not bound)
    num_tokens: int = 0  # prompt tokens staged
    created: float = 0.0
    claimed: bool = False  # a claim or heartbeat with its token arrived
    mismatches: int = 0  # claims that presented another prompt
    bound: bool = False  # ``consumers`` set from the decode engine's TP size


class LeaseAnswer(tuple):
    """What a release or heartbeat did to each id it named (the side channel's LeaseReply):
    ``(done, unknown, refused)``, a 3-tuple as before, plus ``mismatched``.

    ``done``: released (by this consumer) or extended. ``unknown``: freed/extended nothing (not
    held, expired, not a reader, refused or mismatched). ``refused``: the ids of ``unknown``
    whose lease is held but was named without its token (missing or wrong): not an expiry.
    ``mismatched``: the ids of ``unknown`` whose claim presented another prompt than the one
    staged (heartbeats only).
    """

    mismatched: list[str]

    def __new__(cls, done: list[str], unknown: list[str], refused: list[str],
                mismatched: list[str] | None = None) -> LeaseAnswer:
        answer = super().__new__(cls, (done, unknown, refused))
        answer.mismatched = list(mismatched or ())
        return answer

    @property
    def done(self) -> list[str]:
        return self[0]

    @property
    def unknown(self) -> list[str]:
        return self[1]

    @property
    def refused(self) -> list[str]:
        return self[2]


#: (prompt digest, token count) a claim presents for each id ("" digest: none presented)
PromptClaim = tuple[str, int]


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
    #: Called (outside the lock) with the ids a release/heartbeat named without their lease's
    #: token: (ids with no token at all, ids with a wrong one); only a lease's first refusal.
    on_refused: Callable[[list[str], list[str]], None] | None = field(default=None, repr=False)
    #: Called (outside the lock) with the ids whose claim presented another prompt (first time
    #: per lease).
    on_mismatch: Callable[[list[str]], None] | None = field(default=None, repr=False)
    claim_seconds: float | None = None  # a new lease's wait for its first claim (None: lease)
    max_age_seconds: float | None = None  # cap on a lease's life, heartbeats included
    max_request_slots: int | None = None  # one request's share of the pool (None: the pool)
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
                raise DuplicateLeaseError(
                    f"request id {request_id} already holds a lease (a repeated request id?)"
                )
            held = len(self._reserved.get(request_id, ()))
            if self.max_request_slots is not None and held + count > self.max_request_slots:
                raise StagingShareError(
                    f"request needs {held + count} staging slots, more than its share of "
                    f"{self.max_request_slots} of {self.num_slots} (staging_request_share)"
                )
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

    def lease(
        self,
        request_id: str,
        wire_bytes: int = 0,
        consumers: int = 1,
        prompt_digest: str | None = None,
        num_tokens: int = 0,
    ) -> Lease:
        """Turn the reserved slots of a finished request into a lease bound to its prompt
        (``prompt_digest`` of its first ``num_tokens`` tokens) that expires unless claimed within
        ``claim_seconds``; its ``token`` is fresh (hand it to the decode engine, never log it)."""
        with self._lock:
            if request_id in self._leases:
                raise DuplicateLeaseError(f"request id {request_id} already holds a lease")
            slots = self._reserved.pop(request_id, [])
            now = self.clock()
            wait = self.lease_seconds
            if self.claim_seconds is not None:
                wait = min(wait, self.claim_seconds)
            lease = Lease(
                request_id, slots, now + wait, wire_bytes, consumers=max(1, consumers),
                prompt_digest=prompt_digest, num_tokens=num_tokens, created=now,
            )
            self._leases[request_id] = lease
            return lease

    # ---- side channel ------------------------------------------------------------------
    def release(
        self,
        request_ids: Iterable[str],
        consumer: int = 0,
        tokens: Sequence[str] | None = None,
        consumers: int = 0,
    ) -> LeaseAnswer:
        """Decode worker ``consumer`` (its TP rank) read these requests; slots are freed once
        every consumer released. ``tokens[i]`` is the capability presented for
        ``request_ids[i]`` (None: a trusted in-process call); ``consumers``: the caller's TP
        size (``_bind_consumers``). Returns (acknowledged, unknown, refused); a lease named
        without its token is unknown and refused to that caller and stays held."""
        released: list[str] = []
        unknown: list[str] = []
        refused: list[str] = []
        missing: list[str] = []
        wrong: list[str] = []
        ids = list(request_ids)
        with self._lock:
            for i, rid in enumerate(ids):
                lease = self._leases.get(rid)
                if lease is None:
                    unknown.append(rid)
                    continue
                if not self._holds(lease, tokens, i, missing, wrong):
                    unknown.append(rid)
                    refused.append(rid)
                    continue
                _bind_consumers(lease, consumers)
                if not 0 <= consumer < lease.consumers:
                    unknown.append(rid)  # a rank outside the lease's readers frees nothing
                    continue
                lease.released_by.add(consumer)
                released.append(rid)
                if len(lease.released_by) >= lease.consumers:
                    del self._leases[rid]
                    self._give_back(lease.slots)
        self._refused(missing, wrong)
        return LeaseAnswer(released, unknown, refused)

    def heartbeat(
        self,
        request_ids: Iterable[str],
        tokens: Sequence[str] | None = None,
        prompts: Sequence[PromptClaim] | None = None,
        consumers: int = 0,
    ) -> LeaseAnswer:
        """Extend leases of requests the decode engine still waits to read (also its claim
        before decoding: a lease it does not hold is unknown, and nothing is decoded; one held
        but named without its token is also refused). ``prompts[i]``: the (digest, token count)
        of the caller's own prompt for ``request_ids[i]``; a lease staged for another prompt is
        unknown and mismatched to it, and not extended. A call presenting no digest ("") is an
        older decode engine's: not checked. ``consumers``: the caller's TP size
        (``_bind_consumers``)."""
        extended: list[str] = []
        unknown: list[str] = []
        refused: list[str] = []
        mismatched: list[str] = []
        missing: list[str] = []
        wrong: list[str] = []
        first_mismatch: list[str] = []
        ids = list(request_ids)
        with self._lock:
            now = self.clock()
            for i, rid in enumerate(ids):
                lease = self._leases.get(rid)
                if lease is None:
                    unknown.append(rid)
                    continue
                if not self._holds(lease, tokens, i, missing, wrong):
                    unknown.append(rid)
                    refused.append(rid)
                    continue
                claim = prompts[i] if prompts is not None and i < len(prompts) else ("", 0)
                if not _same_prompt(lease, claim):
                    unknown.append(rid)
                    mismatched.append(rid)
                    lease.mismatches += 1
                    if lease.mismatches == 1:
                        first_mismatch.append(rid)
                    continue
                _bind_consumers(lease, consumers)
                until = now + self.lease_seconds
                if self.max_age_seconds is not None:
                    until = min(until, lease.created + max(self.max_age_seconds,
                                                           self.lease_seconds))
                lease.expires_at = max(lease.expires_at, until)
                lease.heartbeats += 1
                lease.claimed = True
                extended.append(rid)
        self._refused(missing, wrong)
        if first_mismatch:
            logger.warning(
                "claims of leases %s refused: the decode engine's prompt is not the one staged "
                "(kv_transfer_params of another prompt, their turbowire_prompt_hash replaced?)",
                first_mismatch[:5],
            )
            if self.on_mismatch is not None:
                self.on_mismatch(first_mismatch)
        return LeaseAnswer(extended, unknown, refused, mismatched)

    @staticmethod
    def _holds(
        lease: Lease, tokens: Sequence[str] | None, i: int, missing: list[str], wrong: list[str]
    ) -> bool:
        """Whether the caller presented the lease's token (constant-time compare)."""
        if tokens is None:
            return True
        given = tokens[i] if i < len(tokens) else ""
        if given and hmac.compare_digest(given.encode(), lease.token.encode()):
            return True
        lease.refusals += 1
        if lease.refusals == 1:  # counted once per lease: an old peer heartbeats repeatedly
            (wrong if given else missing).append(lease.request_id)
        return False

    def _refused(self, missing: list[str], wrong: list[str]) -> None:
        if not (missing or wrong):
            return
        if missing:
            logger.warning(
                "lease calls for %s refused: no lease token (a decode engine of an older "
                "turbowire, transfer format < 2? upgrade it)", missing[:5],
            )
        if wrong:
            logger.warning(
                "lease calls for %s refused: wrong lease token (forged or altered "
                "kv_transfer_params)", wrong[:5],
            )
        if self.on_refused is not None:
            self.on_refused(missing, wrong)

    def reap(self) -> list[Lease]:
        """Free every expired lease; returns them (the caller counts and logs)."""
        with self._lock:
            now = self.clock()
            expired = [lease for lease in self._leases.values() if lease.expires_at <= now]
            for lease in expired:
                del self._leases[lease.request_id]
                self._give_back(lease.slots)
        for lease in expired:
            if lease.claimed:
                logger.warning(
                    "lease of request %s expired after %d heartbeats (%.0f s old): %d staging "
                    "slots freed unread", lease.request_id, lease.heartbeats,
                    now - lease.created, len(lease.slots),
                )
            else:
                logger.warning(
                    "lease of request %s was never claimed by a decode engine: %d staging slots "
                    "freed unread (claim_timeout_seconds)", lease.request_id, len(lease.slots),
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

    def get_lease(self, request_id: str) -> Lease | None:
        """The lease a request holds (None: none); the pool's own object, not a copy."""
        with self._lock:
            return self._leases.get(request_id)

    def _give_back(self, slots: Iterable[int]) -> None:
        for s in slots:
            heapq.heappush(self._free, s)


def _bind_consumers(lease: Lease, consumers: int) -> None:
    """The decode engine's TP size, from its first call that holds the lease's token: each of
    its ranks releases the lease once, however many prefill ranks it read (a lease starts with
    the prefill engine's TP size, what an older decode engine, which sends none, releases)."""
    if consumers > 0 and not lease.bound:
        lease.consumers = consumers
        lease.bound = True


def _same_prompt(lease: Lease, claim: PromptClaim) -> bool:
    """Whether a claim's (digest, token count) is the lease's prompt; a claim without a digest
    (an older decode engine) or a lease not bound to a prompt is not checked."""
    digest, num_tokens = claim
    if not digest or lease.prompt_digest is None:
        return True
    return num_tokens == lease.num_tokens and hmac.compare_digest(
        digest.encode(), lease.prompt_digest.encode()
    )


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
