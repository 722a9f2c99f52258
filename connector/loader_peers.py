"""The loader's calls to prefill engines: handshake (cached per peer), the claim of a lease,
its release; and the errors a load fails with.

Side-channel calls run on the executor's lane of their peer (``submit_to((host, port), ...)``
when the executor has one: :class:`~turbowire.connector.sidechannel.client.PeerExecutors`), so a
peer that never answers stalls only its own loads. At most ``max_peers`` handshakes are kept
(least recently used dropped, its NIXL agent removed once no READ uses it). ``PeerLinks`` is a
part of :class:`~turbowire.connector.loader.KVLoader` (its state lives on the loader).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from turbowire.connector.metadata import LoadRequest, PeerAddress
from turbowire.connector.sidechannel.client import PeerTimeoutError
from turbowire.connector.stats import P2P_LABEL
from turbowire.errors import TurboWireError

if TYPE_CHECKING:
    from turbowire.connector.compat import CompatibilityRecord
    from turbowire.connector.config import TurboWireConfig
    from turbowire.connector.geometry import KVGeometry, StagingLayout
    from turbowire.connector.loader import LoadJob
    from turbowire.connector.sidechannel.client import PeerInfo
    from turbowire.connector.stats import TurboWireConnectorStats
    from turbowire.connector.tp_plan import ChunkCut, HeadSource
    from turbowire.connector.transports.base import Transport

logger = logging.getLogger(__name__)


class LoadFailed(TurboWireError):
    """A load failed; ``reason`` is the metric label (timeout, lease_expired, bounds, ...)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason  # type: ignore[misc]  # per instance: one class, many reasons


class PromptMismatchError(LoadFailed):
    """The prefill engine refused the claim: its lease holds the KV of another prompt than this
    request's (the params belong to another prompt; their ``turbowire_prompt_hash`` was
    replaced or the prompt differs). Nothing is decoded; the prompt is recomputed."""

    reason = "prompt_mismatch"

    def __init__(self, message: str) -> None:
        super().__init__(type(self).reason, message)


class LeaseRefusedError(LoadFailed):
    """The prefill engine holds the lease but refused the claim: the lease token presented (the
    request's ``turbowire_lease_token``) is not that lease's. Not an expiry: ``lease_seconds``
    has nothing to do with it; the request's ``kv_transfer_params`` were altered, or name another
    request's lease."""

    reason = "lease_refused"

    def __init__(self, message: str) -> None:
        super().__init__(type(self).reason, message)


PeerKey = tuple[str, str, int, int]
"""(engine id, host, port, prefill rank): one handshake per prefill rank a load reads."""


@dataclass
class PeerState:
    info: PeerInfo
    agent: str
    handshake_seconds: float


class PeerLinks:
    """Handshakes, claims and releases of a loader (see the module)."""

    config: TurboWireConfig
    geometry: KVGeometry
    layout: StagingLayout
    engine_id: str
    tp_rank: int
    record: CompatibilityRecord
    mem_type: str
    stats: TurboWireConnectorStats
    max_peers: int
    _transport: Transport
    _clients: Any
    _executor: Executor
    _peers: OrderedDict[PeerKey, PeerState]
    _handshakes: dict[PeerKey, tuple[Future, float]]
    _stale_agents: set[str]

    tp_size: int

    if TYPE_CHECKING:  # the loader's: exact chunk bytes of a prefill rank's chunks
        def _sizer(self, heads: int | None) -> Callable[[int, int, int], int]: ...
        def _cut(self, source: HeadSource, head_groups: int) -> ChunkCut | None: ...
        def _part_sizer(self, cut: ChunkCut) -> Callable[[int, int, int], int]: ...

    def _submit(self, peer: PeerAddress, fn: Callable[..., Any], *args: Any,
                **kwargs: Any) -> Future:
        """Run a side-channel call on ``peer``'s own lane when the executor has lanes."""
        submit_to = getattr(self._executor, "submit_to", None)
        if submit_to is not None:
            return submit_to((peer.host, peer.port), fn, *args, **kwargs)
        return self._executor.submit(fn, *args, **kwargs)

    def _peer_for(self, job: LoadJob) -> PeerState | None:
        """The handshake with the prefill rank ``job`` reads (its agent and staging), started
        on the peer's lane and taken once answered; None while it is on the way."""
        peer = job.load.peer
        key = job.peer_key
        state = self._peers.get(key)
        if state is not None:
            self._peers.move_to_end(key)
            return state
        pending = self._handshakes.get(key)
        if pending is None:
            future = self._submit(peer, self._handshake_rpc, peer, job.prefill_rank)
            self._handshakes[key] = (future, time.perf_counter())
            return None
        future, started = pending
        if not future.done():
            return None
        del self._handshakes[key]
        try:
            info = future.result()  # raises the handshake's error for this job (retried next job)
        except PeerTimeoutError as exc:
            if not self._may_retry(job, exc, "handshake"):
                raise
            return None  # the next call sends a new one
        self._check_peer_geometry(info, peer, job)
        agent = self._transport.add_peer(info.staging.agent_metadata)  # main thread only
        self._stale_agents.discard(agent)  # the same agent answered again: still in use
        elapsed = time.perf_counter() - started
        state = PeerState(info, agent, elapsed)
        self._peers[key] = state
        self._evict_peers()
        self.stats.observe(
            "handshake_seconds", elapsed, transport=P2P_LABEL, preset=self.config.preset
        )
        job.handshake_seconds = elapsed
        logger.info(
            "handshake with prefill engine %s at %s:%d (rank %d) done in %.1f ms",
            peer.engine_id, peer.host, peer.port, job.prefill_rank, elapsed * 1e3,
        )
        return state

    def _evict_peers(self) -> None:
        """Keep at most ``max_peers`` handshakes: the least recently used beyond it is dropped
        (its NIXL agent is removed once no READ uses it; named again, it is handshaken again)."""
        while len(self._peers) > self.max_peers:
            key, old = self._peers.popitem(last=False)
            self._stale_agents.add(old.agent)
            logger.info("dropping the handshake with prefill engine %s at %s:%d rank %d "
                        "(max_peers)", *key)

    def _claimed(self, job: LoadJob) -> bool:
        """Extend the prefill lease (one heartbeat round trip, sent when the READs are posted):
        a slot is only decoded once its lease is known to have held, so an expired (possibly
        reused) slot is never decoded. Bytes read from a slot reused meanwhile would also fail
        the chunk tag or checksum. A lease the prefill engine holds but refuses (wrong or missing
        lease token) fails as ``lease_refused``, one it no longer holds as ``lease_expired``."""
        if job.claimed:
            return True
        if job.claim is None:
            load = job.load
            client = self._clients.get(load.peer.host, load.peer.port)
            # this engine's own prompt: the prefill engine refuses a lease staged for another
            claim = ({"prompts": [(load.prompt_digest, load.prompt_tokens)]}
                     if load.prompt_digest else {})
            job.claim = self._submit(
                load.peer, client.heartbeat, [load.remote_request_id], self.engine_id,
                lease_tokens=[load.lease_token], tp_size=self.tp_size, **claim,
            )
            return False
        if not job.claim.done():
            return False
        try:
            reply = job.claim.result()
        except PeerTimeoutError as exc:
            if not self._may_retry(job, exc, "claim"):
                raise
            job.claim = None
            return self._claimed(job)  # sends it again
        rid = job.load.remote_request_id
        if rid in getattr(reply, "prompt_mismatch", ()):
            raise PromptMismatchError(
                f"the prefill engine {job.load.peer.engine_id} refused this engine's claim on "
                f"the lease of request {rid}: it staged another prompt than this request's (the "
                "kv_transfer_params belong to another prompt, their turbowire_prompt_hash "
                "replaced?); nothing is decoded"
            )
        if rid in reply.refused:
            raise LeaseRefusedError(
                f"the prefill engine {job.load.peer.engine_id} holds the lease of request {rid} "
                "but refused this engine's claim on it: the turbowire_lease_token in the "
                "request's kv_transfer_params is not that lease's (the params were altered, or "
                "their remote_request_id belongs to another request/lease); forward the prefill "
                "engine's kv_transfer_params unchanged (not an expiry: lease_seconds does not "
                "matter here)"
            )
        if rid in reply.unknown:
            raise LoadFailed(
                "lease_expired",
                f"the prefill engine no longer holds request {rid} "
                "(lease expired before the decode engine got to it; raise lease_seconds)",
            )
        job.claimed = True
        return True

    def _may_retry(self, job: LoadJob, exc: PeerTimeoutError, what: str) -> bool:
        """Whether a side-channel call of ``job`` that timed out is sent again: yes while the
        lease may still hold (``lease_seconds`` from the load's start, within
        ``transfer_timeout_seconds``). A prefill engine starved of CPU answers late, not never
        (bench/RESULTS.md "Starved CPUs"); a hung one fails the load once that window has
        passed, as ``peer_unreachable``."""
        window = min(job.load.lease_seconds, self.config.transfer_timeout_seconds)
        if time.monotonic() + self.config.handshake_timeout_seconds > job.created + window:
            return False
        logger.warning(
            "the %s for request %s timed out (%s); sending it again while its lease may hold",
            what, job.load.request_id, exc,
        )
        return True

    def _handshake_rpc(self, peer: PeerAddress, prefill_rank: int) -> PeerInfo:
        """Network part of the handshake with one prefill rank (thread pool; no NIXL calls
        here)."""
        client = self._clients.get(peer.host, peer.port)
        return client.handshake(self.record, self.engine_id, prefill_rank)

    def _check_peer_geometry(self, info: PeerInfo, peer: PeerAddress, job: LoadJob) -> None:
        from turbowire.connector.compat import IncompatiblePeerError

        if info.engine_id != peer.engine_id:
            raise IncompatiblePeerError(
                "engine_id", peer.engine_id, info.engine_id,
                message=f"{peer.host}:{peer.port} now serves engine {info.engine_id}, not "
                f"{peer.engine_id} (restarted?): its staged KV is gone",
            )
        staging = info.staging
        if staging.mem_type != self.mem_type:
            raise LoadFailed(
                "incompatible", f"peer staging is {staging.mem_type}, ours {self.mem_type}"
            )
        if len(staging.layer_offsets) != self.geometry.num_layers:
            raise LoadFailed("incompatible", "peer staging has a different layer count")
        cut = self._cut(job.source, staging.head_groups)  # refuses a bad number of runs
        part = self._part_sizer(cut) if cut is not None else None
        for layer, off in enumerate(staging.layer_offsets):
            full = self._sizer(job.src_heads)(layer, self.geometry.block_size, 0)
            if part is not None and part(layer, self.geometry.block_size, 0):  # runs of heads
                full = cut.groups * part(layer, self.geometry.block_size, 0)
            if off + full > staging.slot_bytes:
                raise LoadFailed("bounds", f"peer slot too small for layer {layer}")

    def _forget_peer(self, peer: PeerAddress) -> None:
        """Drop the cached handshake of a peer a load just failed on, so the next load with it
        handshakes again. A prefill engine restarted at the same address under the same
        ``engine_id`` has a new NIXL agent and staging pool: reusing the cached ones failed every
        later load with that engine (``transport``) until this engine restarted too."""
        for key in [k for k in self._peers if k[:3] == peer.key]:  # every rank of it
            self._stale_agents.add(self._peers.pop(key).agent)
            logger.info(
                "forgetting the handshake with prefill engine %s at %s:%d rank %d after a "
                "failed load", *key,
            )

    def _release_async(self, load: LoadRequest, count_failure: bool = True) -> None:
        """Tell the prefill engine it may free the staged slots (fire and forget, logged).

        A release that does not get through is counted ``peer_unreachable`` unless the load
        already failed (``count_failure=False``): that load is counted once, by its own reason;
        counting the release too made one dead prefill engine two failures per request."""
        if self._clients is None:
            return

        def call() -> None:
            try:
                reply = self._clients.get(load.peer.host, load.peer.port).release(
                    [load.remote_request_id], self.engine_id, self.tp_rank,
                    lease_tokens=[load.lease_token], tp_size=self.tp_size,
                )
                if reply.refused:
                    logger.warning(
                        "prefill engine %s refused the release of %s: the lease token of the "
                        "request's kv_transfer_params is not that lease's (altered params, or "
                        "another request's); the lease expires on its own",
                        load.peer.engine_id, load.remote_request_id,
                    )
                elif reply.unknown:
                    logger.warning(
                        "prefill engine %s had no lease for %s any more (expired?)",
                        load.peer.engine_id, load.remote_request_id,
                    )
            except Exception as exc:  # noqa: BLE001 - the lease then expires on its own
                logger.warning("lease release for %s failed: %s", load.remote_request_id, exc)
                if count_failure:
                    self.stats.record_failure("peer_unreachable")

        try:
            self._submit(load.peer, call)
        except RuntimeError:  # the worker's pool is shut down (engine exit): send it from here
            call()
