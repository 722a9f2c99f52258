"""The decode side's load state machine: handshake, claim, pipelined READs, decode, release.

Each load handshakes with the prefill engine once (cached per peer, in a thread so the engine
loop never blocks on the network), READs exactly the chunk bytes of the needed (block, layer)
pairs into the receive buffer, one READ per group of layers (``decode_pipeline_groups``, two in
flight; once a poll finds both landed, the link outpaces the engine's polls and every group left
goes out in one READ), claims the prefill lease while they move, and decodes each group as soon
as it has landed (nothing is decoded before the claim confirms the lease) while the later groups
are still on the wire, each run of consecutive groups that landed together in one decode call.
A decode may come back as a handle still running on the GPU (``PendingDecode``): the load
finishes once all of them ran and none refused a chunk (one wait per load, when its last group
is handed over); it reports the load finished and, at the next poll, tells the prefill engine
to release the lease. Any failure lands in the failed set with its metric reason; a READ that
may still be writing when its load fails keeps its receive range quarantined.

The claim presents this engine's own prompt (digest and token count, ``LoadRequest.
prompt_digest``): the prefill engine refuses a lease it staged for another prompt, so params of
one prompt presented with another fail as ``prompt_mismatch`` before anything is decoded, even
when their ``turbowire_prompt_hash`` was replaced.

Side-channel calls run on the executor's lane of their peer (``submit_to((host, port), ...)``
when the executor has one: :class:`~turbowire.connector.sidechannel.client.PeerExecutors`), so a
peer that never answers stalls only its own loads. At most ``max_peers`` handshakes are kept
(least recently used dropped, its NIXL agent removed once no READ uses it).

Everything it talks to is injected (transport, side-channel clients, executor, the decode of a
layer group into the paged cache), so a fake transport can unit-test it
(tests/unit/connector/test_loader.py), as vLLM tests its NIXL worker with a fake wrapper.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from turbowire.connector.config import TurboWireConfig
from turbowire.connector.geometry import KVGeometry, StagingLayout
from turbowire.connector.metadata import LoadReport, LoadRequest, PeerAddress
from turbowire.connector.sidechannel.client import PeerTimeoutError
from turbowire.connector.staging import ByteRanges
from turbowire.connector.stats import P2P_LABEL, TurboWireConnectorStats
from turbowire.connector.transports.base import Transfer, TransferState, Transport, TransportError
from turbowire.errors import TurboWireError, failure_reason

if TYPE_CHECKING:
    from turbowire.connector.compat import CompatibilityRecord
    from turbowire.connector.sidechannel.client import PeerInfo

logger = logging.getLogger(__name__)

# Layer-group READs of one load on the wire at once: two keep the link busy while the group
# that landed is decoded, and the groups land one after another instead of all at the end.
READS_IN_FLIGHT = 2

# Failure reasons that say the cached handshake of the peer may be stale (the prefill engine
# died, restarted at the same address, or its NIXL agent went away): the next load re-handshakes.
PEER_FAILURES = frozenset({"transport", "peer_unreachable", "timeout"})


def _distinct(xfers: Iterator[Transfer]) -> list[Transfer]:
    """Each transfer once, in order (one READ may carry several layer groups)."""
    seen: set[int] = set()
    out = []
    for x in xfers:
        if id(x) not in seen:
            seen.add(id(x))
            out.append(x)
    return out


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


@dataclass
class PeerState:
    info: PeerInfo
    agent: str
    handshake_seconds: float


@dataclass
class LoadJob:
    load: LoadRequest
    created: float = field(default_factory=time.monotonic)
    recv_offset: int | None = None
    recv_nbytes: int = 0
    chunk_offsets: Mapping[tuple[int, int], tuple[int, int]] = field(default_factory=dict)
    groups: list[range] = field(default_factory=list)  # layers of each READ
    xfers: list[Transfer] = field(default_factory=list)  # the READ of each posted group
    group_descs: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)
    desc_all: tuple[np.ndarray, np.ndarray] | None = None  # every group's rows, group_descs' base
    group_rows: list[int] = field(default_factory=list)  # first row of each group, then the end
    peer_agent: str = ""
    decoded: list[bool] = field(default_factory=list)
    pending: list[PendingDecode] = field(default_factory=list)  # decodes not settled yet
    transferred_at: float | None = None  # when the last READ was seen done
    decode_seconds: float = 0.0
    wait_seconds: float = 0.0  # queued -> READs posted (handshake, receive buffer)
    posted: float = 0.0
    handshake_seconds: float = 0.0
    claim: Future | None = None
    claimed: bool = False
    tokens: int = 0  # of all blocks, counted when the READs are posted


@dataclass
class Quarantined:
    """A failed load's receive range that READs still on the wire may write into.

    It is given back only once every one of those READs has ended (DONE or FAILED: NIXL no
    longer writes into it), so a late byte can never land in a range another load decodes from;
    without the hand-back, every load failed on a dead or stalled peer shrank the receive buffer
    for good until loads could only wait for ``transfer_timeout_seconds``.
    """

    offset: int
    nbytes: int
    xfers: list[Transfer]
    agent: str


def layer_groups(num_layers: int, groups: int) -> list[range]:
    """Split layers 0..num_layers-1 into at most ``groups`` contiguous, near-equal ranges."""
    groups = max(1, min(groups, num_layers))
    base, extra = divmod(num_layers, groups)
    out: list[range] = []
    start = 0
    for g in range(groups):
        size = base + (1 if g < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out



class ChunkOffsets(Mapping[tuple[int, int], tuple[int, int]]):
    """Where each chunk of a load lies in its receive range: ``(block position, layer) ->
    (offset, bytes)``, backed by two ``[layers, blocks]`` arrays (``offsets``, ``sizes``) that a
    decode can take whole; ``groups``: the layers of each READ, in the order they are handed to
    the decode (the GPU path prepares one launch per group)."""

    def __init__(self, offsets: np.ndarray, sizes: np.ndarray,
                 groups: list[range] | None = None) -> None:
        self.offsets = offsets
        self.sizes = sizes
        self.groups = groups

    def __getitem__(self, key: tuple[int, int]) -> tuple[int, int]:
        bi, layer = key
        if not (0 <= layer < self.sizes.shape[0] and 0 <= bi < self.sizes.shape[1]):
            raise KeyError(key)
        return int(self.offsets[layer, bi]), int(self.sizes[layer, bi])

    def __iter__(self) -> Iterator[tuple[int, int]]:
        for layer in range(self.sizes.shape[0]):
            for bi in range(self.sizes.shape[1]):
                yield (bi, layer)

    def __len__(self) -> int:
        return int(self.sizes.size)


class PendingDecode(Protocol):
    """A layer group's decode that may still be running on the GPU (connector/gpu_path.py)."""

    def done(self) -> bool:
        """Whether it ran (its verdict is known); never waits."""
        ...

    def result(self) -> None:
        """Wait for it; raise the decode's refusal (a refused chunk is never written into the
        cache; valid chunks launched with it may be: they are blocks of the same load, which
        fails as a whole, so vLLM recomputes them)."""
        ...

    def abandon(self) -> None:
        """The load failed: run nothing more of it, wait for what reads the receive range."""
        ...


DecodeGroup = Callable[[LoadRequest, range, int, Mapping[tuple[int, int], tuple[int, int]]],
                       "PendingDecode | None"]
"""decode(load, layers, recv_offset, chunk_offsets): verify and decode the chunks of ``layers``
(landed at ``recv_offset + chunk_offsets[(block, layer)]``; a ``ChunkOffsets``) into the paged
cache. Returns None when that is done (a refusal raises), or a ``PendingDecode``: the load is
finished only once every group's decode has run and none was refused."""

PrepareDecode = Callable[[LoadRequest, int, Mapping[tuple[int, int], tuple[int, int]]], None]
"""prepare(load, recv_offset, chunk_offsets): called once a load's first READs are posted, so
the decode's plan is built while the bytes move; raising fails the load."""


@dataclass(frozen=True)
class LocalEnd:
    """This engine's side of a load: who it is and where the received bytes land."""

    engine_id: str
    tp_rank: int
    record: CompatibilityRecord
    mem_type: str  # "DRAM" / "VRAM": both ends must agree
    recv_base: int  # address of the receive buffer registered with the transport
    recv_device: int
    num_local_blocks: int
    dense_bytes_per_token: int


class KVLoader:
    """Loads requests' KV from prefill engines; driven by the worker's per-step calls."""

    def __init__(
        self,
        config: TurboWireConfig,
        geometry: KVGeometry,
        layout: StagingLayout,
        chunk_nbytes: Callable[[int, int, int], int],
        local: LocalEnd,
        transport: Transport,
        clients: Any,
        recv_ranges: ByteRanges,
        decode: DecodeGroup,
        executor: Executor,
        stats: TurboWireConnectorStats,
        prepare: PrepareDecode | None = None,
    ) -> None:
        self.config = config
        self.geometry = geometry
        self.layout = layout
        self._chunk_nbytes = chunk_nbytes
        self.engine_id = local.engine_id
        self.tp_rank = local.tp_rank
        self.record = local.record
        self.mem_type = local.mem_type
        self._recv_base = local.recv_base
        self._recv_device = local.recv_device
        self._num_local_blocks = local.num_local_blocks
        self._dense_bytes_per_token = local.dense_bytes_per_token
        self._transport = transport
        self._clients = clients
        self._recv_ranges = recv_ranges
        self._decode = decode
        self.prepare = prepare
        self._executor = executor
        self.stats = stats
        self._peers: OrderedDict[tuple[str, str, int], PeerState] = OrderedDict()
        self.max_peers = config.max_peers
        self._handshakes: dict[tuple[str, str, int], tuple[Future, float]] = {}
        self._jobs: list[LoadJob] = []
        self._finished: set[str] = set()
        # loads completed in the last results(): lease release and metrics still to do
        self._completed: list[tuple[LoadRequest, LoadReport]] = []
        self._failed: set[str] = set()
        # finished loads and settled decode handles, freed at the next results(): freeing a
        # load's decode plan and buffers took ~50 us between its verdict and its report (H200)
        self._spent: list[object] = []
        self._reports: dict[str, LoadReport] = {}
        self._quarantine: list[Quarantined] = []
        self._stale_agents: set[str] = set()  # NIXL agents of forgotten peers, to remove
        self.quarantined_bytes = 0
        # hand a run of groups that landed together to one decode call (False: one call per
        # group, as before; the GPU bench measures both)
        self.merge_landed = True
        # post every group left in one READ when a poll finds the link idle (False: two READs
        # in flight until the end, as before; the GPU bench measures both)
        self.coalesce_idle = True

    @property
    def pending(self) -> int:
        """Loads not finished yet."""
        return len(self._jobs)

    def take_reports(self) -> dict[str, LoadReport]:
        """Per-request reports of the loads that ended since the last call."""
        reports, self._reports = self._reports, {}
        return reports

    def start(self, loads: list[LoadRequest]) -> None:
        """Queue new loads (and lease releases) and move every load forward."""
        for load in loads:
            if load.fail_reason:
                self._fail_unplanned(load)
            elif load.release_only:
                self._release_async(load)
            else:
                self._jobs.append(LoadJob(load))
        self._progress()

    def _fail_unplanned(self, load: LoadRequest) -> None:
        """A load the scheduler announced to vLLM but could not plan (counted there): reported
        failed at once, so vLLM recomputes (or fails) the request instead of waiting for KV that
        never comes; the prefill lease, if the params named one, is released."""
        logger.error("KV load of request %s not planned (%s): reported failed",
                     load.request_id, load.fail_reason)
        self._failed.add(load.request_id)
        self._reports[load.request_id] = LoadReport(failed=load.fail_reason)
        if load.remote_request_id and load.peer.host:
            self._release_async(load, count_failure=False)

    def _submit(self, peer: PeerAddress, fn: Callable[..., Any], *args: Any,
                **kwargs: Any) -> Future:
        """Run a side-channel call on ``peer``'s own lane when the executor has lanes."""
        submit_to = getattr(self._executor, "submit_to", None)
        if submit_to is not None:
            return submit_to((peer.host, peer.port), fn, *args, **kwargs)
        return self._executor.submit(fn, *args, **kwargs)

    def results(self) -> tuple[set[str], set[str]]:
        """(finished incl. failed, failed) since the last call."""
        self._spent = []
        self._settle_completed()
        self._progress()
        finished, failed = self._finished | self._failed, self._failed
        self._finished, self._failed = set(), set()
        return finished, failed


    def _progress(self) -> None:
        self._reclaim()
        if not self._jobs:
            return
        now = time.monotonic()
        still: list[LoadJob] = []
        for job in self._jobs:
            try:
                if self._advance(job, now):
                    self._spent.append(job)
                    continue  # finished
            except LoadFailed as exc:
                self._fail(job, exc.reason, str(exc))
                continue
            except Exception as exc:  # noqa: BLE001 - every failure must reach failed_recving
                reason = failure_reason(exc)
                self._fail(job, reason, f"{type(exc).__name__}: {exc}")
                continue
            still.append(job)
        self._jobs = still

    def _advance(self, job: LoadJob, now: float) -> bool:
        """Move a job forward; True when it completed successfully."""
        if now - job.created > self.config.transfer_timeout_seconds:
            raise LoadFailed(
                "timeout",
                f"load did not finish within transfer_timeout_seconds="
                f"{self.config.transfer_timeout_seconds}",
            )
        if not job.xfers:
            peer = self._peer_for(job)
            if peer is None:
                return False
            self._claimed(job)  # the claim's round trip runs while the READs move
            if not self._post(job, peer):
                return False
        if not self._claimed(job):
            return False  # nothing is decoded before the lease is confirmed
        # decode every group that has landed, in order (the READs posted meanwhile included),
        # each run of consecutive landed groups in one call (``merge_landed``); the next READs
        # go out before a run is decoded, so the link stays busy while the CPU/GPU decodes, and
        # groups that land meanwhile are taken by the next run
        while (landed := self._take_landed(job)) is not None:
            layers, handles = landed
            try:
                job.decode_seconds += self._decode_group(job, layers)
            finally:  # after the launch: a NIXL release is host time the decode need not wait
                for xfer in handles:
                    xfer.release()
        done = len(job.xfers) == len(job.groups) and all(job.decoded)
        if done:
            if job.transferred_at is None:
                job.transferred_at = time.perf_counter()
            # the bookkeeping first, while the GPU decodes: the range is given back before the
            # wait below, which returns (or fails the load) before anything can reuse it
            self._free_recv(job)
        # GPU decodes: settle those that ran (a refusal fails the load now); once every group
        # is decoded, wait for the rest: the one host synchronisation of the load
        t0 = time.perf_counter()
        while job.pending and (done or job.pending[0].done()):
            handle = job.pending.pop(0)
            self._spent.append(handle)
            handle.result()
        job.decode_seconds += time.perf_counter() - t0
        if not done:
            return False
        self._complete(job, job.transferred_at - job.posted, job.decode_seconds)
        return True

    def _take_landed(self, job: LoadJob) -> tuple[range, list[Transfer]] | None:
        """The layers of the next run of landed groups and their READ handles (the caller
        releases them once the run's decode is launched, even if it raises), the next READs
        posted; None if the next group has not landed. With ``merge_landed`` off, one group per
        run: a decode call per READ."""
        g = next((i for i, d in enumerate(job.decoded) if not d), len(job.xfers))
        first = g
        handles: list[Transfer] = []
        try:
            if self.coalesce_idle and self._link_idle(job, g):
                self._post_more(job, rest=True)
            while g < len(job.xfers):
                xfer = job.xfers[g]
                if not handles or handles[-1] is not xfer:  # one READ may carry several groups
                    state = xfer.state()  # (asked once per READ: they landed together)
                    if state is TransferState.PENDING:
                        break
                    if state is TransferState.FAILED:
                        raise LoadFailed("transport",
                                         f"NIXL READ of layer group {g} finished in error")
                    handles.append(xfer)
                job.decoded[g] = True  # handed over: its handle is the caller's to release
                g += 1
                self._post_more(job)  # before the decode; a READ posted here may have landed
                if not self.merge_landed and (g == len(job.xfers) or job.xfers[g] is not xfer):
                    break  # one call per READ (the groups of one READ are handed over together)
        except BaseException:
            for xfer in handles:  # landed, never decoded: the load fails, the handles go
                xfer.release()
            raise
        if g == first:
            return None
        return range(job.groups[first].start, job.groups[g - 1].stop), handles

    def _peer_for(self, job: LoadJob) -> PeerState | None:
        peer = job.load.peer
        state = self._peers.get(peer.key)
        if state is not None:
            self._peers.move_to_end(peer.key)
            return state
        pending = self._handshakes.get(peer.key)
        if pending is None:
            future = self._submit(peer, self._handshake_rpc, peer)
            self._handshakes[peer.key] = (future, time.perf_counter())
            return None
        future, started = pending
        if not future.done():
            return None
        del self._handshakes[peer.key]
        try:
            info = future.result()  # raises the handshake's error for this job (retried next job)
        except PeerTimeoutError as exc:
            if not self._may_retry(job, exc, "handshake"):
                raise
            return None  # the next call sends a new one
        self._check_peer_geometry(info, peer)
        agent = self._transport.add_peer(info.staging.agent_metadata)  # main thread only
        self._stale_agents.discard(agent)  # the same agent answered again: still in use
        elapsed = time.perf_counter() - started
        state = PeerState(info, agent, elapsed)
        self._peers[peer.key] = state
        self._evict_peers()
        self.stats.observe(
            "handshake_seconds", elapsed, transport=P2P_LABEL, preset=self.config.preset
        )
        job.handshake_seconds = elapsed
        logger.info(
            "handshake with prefill engine %s at %s:%d done in %.1f ms",
            peer.engine_id, peer.host, peer.port, elapsed * 1e3,
        )
        return state

    def _evict_peers(self) -> None:
        """Keep at most ``max_peers`` handshakes: the least recently used beyond it is dropped
        (its NIXL agent is removed once no READ uses it; named again, it is handshaken again)."""
        while len(self._peers) > self.max_peers:
            key, old = self._peers.popitem(last=False)
            self._stale_agents.add(old.agent)
            logger.info("dropping the handshake with prefill engine %s at %s:%d (max_peers)",
                        *key)

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
                lease_tokens=[load.lease_token], **claim,
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

    def _handshake_rpc(self, peer: PeerAddress) -> PeerInfo:
        """Network part of the handshake (thread pool; no NIXL calls here)."""
        client = self._clients.get(peer.host, peer.port)
        return client.handshake(self.record, self.engine_id, self.tp_rank)

    def _check_peer_geometry(self, info: PeerInfo, peer: PeerAddress) -> None:
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
        for layer, off in enumerate(staging.layer_offsets):
            if off + self.layout.full_chunk_bytes[layer] > staging.slot_bytes:
                raise LoadFailed("bounds", f"peer slot too small for layer {layer}")

    def _chunk_sizes(self, load: LoadRequest) -> np.ndarray:
        """Bytes of every chunk, [layers, blocks]: the size depends on the layer, the block's
        tokens and whether it is a sequence's first block (``chunk_nbytes``), so it is asked
        once per layer and distinct (tokens, first) pair."""
        tokens = np.array([b.num_tokens for b in load.blocks], dtype=np.int64)
        index = np.array([b.index for b in load.blocks], dtype=np.int64)
        _, rep, inv = np.unique(tokens * 2 + (index == 0), return_index=True,
                                return_inverse=True)
        reps = [(int(tokens[i]), int(index[i])) for i in rep]
        sizes = np.empty((self.geometry.num_layers, len(load.blocks)), dtype=np.int64)
        for layer in range(self.geometry.num_layers):
            per_key = np.array([self._chunk_nbytes(layer, t, i) for t, i in reps], np.int64)
            sizes[layer] = per_key[inv.reshape(-1)]
        return sizes

    def _post(self, job: LoadJob, peer: PeerState) -> bool:
        staging = peer.info.staging
        load = job.load
        slots = [b.slot for b in load.blocks]
        bad = [s for s in slots if not 0 <= s < staging.num_slots]
        if bad:
            raise LoadFailed(
                "bounds", f"staging slots {bad[:5]} outside the peer's {staging.num_slots}"
            )
        bad_local = [b for b in load.block_ids if not 0 <= b < self._num_local_blocks]
        if bad_local:
            raise LoadFailed("bounds", f"local block ids {bad_local[:5]} out of range")
        for block in load.blocks:
            if not 0 < block.num_tokens <= self.geometry.block_size:
                raise LoadFailed("bounds", f"block with {block.num_tokens} tokens")
        groups = layer_groups(self.geometry.num_layers, self.config.decode_pipeline_groups)
        # the groups cover the layers in order, so the receive range holds the chunks
        # layer-major (each group's chunks contiguous), blocks in load order inside a layer;
        # built as arrays: a 32k-token load is 65536 chunks (a Python loop took ~1 s)
        sizes = self._chunk_sizes(load)
        flat = sizes.reshape(-1)
        ends = np.cumsum(flat)
        cursor = int(ends[-1]) if ends.size else 0
        offsets = ChunkOffsets((ends - flat).reshape(sizes.shape), sizes, groups)
        slot_arr = np.array(slots, dtype=np.int64)
        remote_addr = (staging.base_addr + slot_arr[None, :] * staging.slot_bytes
                       + np.array(staging.layer_offsets, dtype=np.int64)[:, None]).reshape(-1)
        if cursor > self._recv_ranges.capacity:
            raise LoadFailed(
                "recv_buffer_too_small",
                f"request needs {cursor} B of receive buffer, recv_bytes is "
                f"{self._recv_ranges.capacity}: raise recv_bytes",
            )
        start = self._recv_ranges.allocate(cursor)
        if start is None:
            return False  # wait for other loads to free the buffer
        job.recv_offset, job.recv_nbytes, job.chunk_offsets = start, cursor, offsets
        job.tokens = sum(b.num_tokens for b in load.blocks)  # for the report, not after the wait
        job.groups = groups
        base = self._recv_base + start
        n = len(load.blocks)
        local_addr = base + offsets.offsets.reshape(-1)
        # (addr, len, dev) rows of every chunk, layer-major: a group's READ, or the READ of all
        # groups left, is a slice (a view, nothing copied when it is posted)
        local_all = np.stack([local_addr, flat, np.full(flat.size, self._recv_device, np.int64)],
                             axis=1).astype(np.uint64)
        remote_all = np.stack([remote_addr, flat,
                               np.full(flat.size, staging.device_id, np.int64)],
                              axis=1).astype(np.uint64)
        job.desc_all = (local_all, remote_all)
        job.group_rows = [layers.start * n for layers in groups] + [flat.size]
        job.group_descs = [
            (local_all[lo:hi], remote_all[lo:hi])
            for lo, hi in zip(job.group_rows[:-1], job.group_rows[1:], strict=True)
        ]
        job.peer_agent = peer.agent
        job.posted = time.perf_counter()  # UCX may finish small READs inside the post call
        job.wait_seconds = time.monotonic() - job.created
        self._post_more(job)
        if self.prepare is not None:  # e.g. the GPU decode plan, built while the bytes move
            self.prepare(load, start, offsets)
        return True

    @staticmethod
    def _link_idle(job: LoadJob, g: int) -> bool:
        """Every READ posted and not yet decoded has landed (from group ``g`` on) and groups are
        left to post: the link went idle before this poll, i.e. the READs land faster than the
        engine polls (vLLM polls once per step)."""
        if len(job.xfers) >= len(job.groups) or g >= len(job.xfers):
            return False
        return all(job.xfers[i].state() is not TransferState.PENDING
                   for i in range(g, len(job.xfers)))

    def _post_more(self, job: LoadJob, rest: bool = False) -> None:
        """Keep READS_IN_FLIGHT layer groups on the wire. Posting every group at once made them
        share the link and land together at the end, leaving nothing to overlap the decode with.
        ``rest``: every group not posted yet, in one READ (the link went idle waiting for a poll:
        two at a time would cost a poll, an engine step, per two groups)."""
        if len(job.xfers) >= len(job.groups):
            return
        if rest:
            assert job.desc_all is not None  # set with group_descs when the READs are posted
            first = job.group_rows[len(job.xfers)]
            local, remote = job.desc_all[0][first:], job.desc_all[1][first:]
            self._post_read(job, local, remote, len(job.groups) - len(job.xfers))
            return
        in_flight = sum(1 for g in range(len(job.xfers)) if not job.decoded[g])
        while in_flight < READS_IN_FLIGHT and len(job.xfers) < len(job.groups):
            local, remote = job.group_descs[len(job.xfers)]
            self._post_read(job, local, remote, 1)
            in_flight += 1

    def _post_read(self, job: LoadJob, local: np.ndarray, remote: np.ndarray,
                   groups: int) -> None:
        """One READ carrying the next ``groups`` layer groups (``job.xfers`` holds it once per
        group)."""
        try:
            xfer = self._transport.read(job.peer_agent, local, remote, self.mem_type)
        except TransportError:
            if not job.xfers:
                self._free_recv(job)
            raise  # READs already posted may still land: _fail quarantines the range
        job.xfers.extend([xfer] * groups)
        job.decoded.extend([False] * groups)


    def _decode_group(self, job: LoadJob, layers: range) -> float:
        """Verify and decode one landed layer group (or hand it to the GPU: ``job.pending``);
        the wall time of the call."""
        assert job.recv_offset is not None
        t0 = time.perf_counter()
        pending = self._decode(job.load, layers, job.recv_offset, job.chunk_offsets)
        if pending is not None:
            job.pending.append(pending)
        return time.perf_counter() - t0

    def _complete(self, job: LoadJob, transfer_seconds: float, decode_seconds: float) -> None:
        """The load is finished and reported; its lease release and metrics wait for the next
        ``results()`` (``_settle_completed``): vLLM schedules the request as soon as this call
        returns, and neither needs to hold it up."""
        load = job.load
        tokens = job.tokens
        dense = tokens * self._dense_bytes_per_token
        wire = job.recv_nbytes
        report = LoadReport(
            tokens=tokens,
            dense_bytes=dense,
            wire_bytes=wire,
            transfer_seconds=transfer_seconds,
            decode_seconds=decode_seconds,
            handshake_seconds=job.handshake_seconds,
            wait_seconds=job.wait_seconds,
        )
        self._completed.append((load, report))
        self._finished.add(load.request_id)
        self._reports[load.request_id] = report

    def _settle_completed(self) -> None:
        """Release the leases of the loads completed since the last call and record their
        metrics."""
        completed, self._completed = self._completed, []
        for load, rep in completed:
            self._release_async(load)
            self.stats.record_recv(P2P_LABEL, load.preset, rep.dense_bytes, rep.wire_bytes)
            self.stats.observe(
                "transfer_seconds", rep.transfer_seconds, transport=P2P_LABEL, preset=load.preset
            )
            self.stats.observe(
                "decode_seconds", rep.decode_seconds, transport=P2P_LABEL, preset=load.preset
            )
            logger.debug(
                "loaded %s: %d tokens, %d wire B (%.2fx), wait %.1f ms, transfer %.1f ms, "
                "decode %.1f ms", load.request_id, rep.tokens, rep.wire_bytes,
                rep.dense_bytes / max(rep.wire_bytes, 1), rep.wait_seconds * 1e3,
                rep.transfer_seconds * 1e3, rep.decode_seconds * 1e3,
            )

    def _fail(self, job: LoadJob, reason: str, message: str) -> None:
        load = job.load
        logger.error(
            "KV load of request %s from engine %s failed (%s): %s",
            load.request_id, load.peer.engine_id, reason, message,
        )
        self.stats.record_failure(reason)
        for pending in job.pending:  # GPU decodes still reading the receive range
            try:
                pending.abandon()
            except Exception as exc:  # noqa: BLE001 - the load has failed already
                logger.debug("abandoning a decode of %s: %s", load.request_id, exc)
        job.pending.clear()
        in_flight = _distinct(
            x for g, x in enumerate(job.xfers)
            if not job.decoded[g] and x.state() is TransferState.PENDING
        )
        if in_flight and job.recv_offset is not None:
            # A READ may still write into the receive range: not reused before it ended.
            self._quarantine.append(
                Quarantined(job.recv_offset, job.recv_nbytes, in_flight, job.peer_agent)
            )
            self.quarantined_bytes += job.recv_nbytes
            logger.warning(
                "receive range [%d, %d) quarantined: %d READ(s) of the failed load may still "
                "write into it", job.recv_offset, job.recv_offset + job.recv_nbytes,
                len(in_flight),
            )
            job.recv_offset = None
        else:
            self._free_recv(job)
        if reason in PEER_FAILURES:
            self._forget_peer(load.peer)
        ended = [g for g, x in enumerate(job.xfers)
                 if not job.decoded[g] and x.state() is not TransferState.PENDING]
        for x in _distinct(job.xfers[g] for g in ended):
            x.release()
        for g in ended:
            job.decoded[g] = True
        self._release_async(load, count_failure=False)  # its failure is counted above
        self._failed.add(load.request_id)
        self._reports[load.request_id] = LoadReport(failed=reason)

    def _reclaim(self) -> None:
        """Give back quarantined ranges whose READs have all ended; remove the NIXL agents of
        forgotten peers that no READ uses any more."""
        if self._quarantine:
            still: list[Quarantined] = []
            for q in self._quarantine:
                if any(x.state() is TransferState.PENDING for x in q.xfers):
                    still.append(q)
                    continue
                for x in q.xfers:
                    x.release()
                self._recv_ranges.free(q.offset, q.nbytes)
                self.quarantined_bytes -= q.nbytes
                logger.info(
                    "receive range [%d, %d) reclaimed: the failed load's READs ended",
                    q.offset, q.offset + q.nbytes,
                )
            self._quarantine = still
        if self._stale_agents:
            remove = getattr(self._transport, "remove_peer", None)
            in_use = {p.agent for p in self._peers.values()}
            in_use |= {q.agent for q in self._quarantine}
            in_use |= {j.peer_agent for j in self._jobs if j.xfers}
            for agent in sorted(self._stale_agents - in_use):
                self._stale_agents.discard(agent)
                if remove is not None:
                    try:
                        remove(agent)
                    except Exception as exc:  # noqa: BLE001 - NIXL raises its own error types
                        logger.info("removing stale NIXL peer %s: %s", agent, exc)

    def _forget_peer(self, peer: PeerAddress) -> None:
        """Drop the cached handshake of a peer a load just failed on, so the next load with it
        handshakes again. A prefill engine restarted at the same address under the same
        ``engine_id`` has a new NIXL agent and staging pool: reusing the cached ones failed every
        later load with that engine (``transport``) until this engine restarted too."""
        state = self._peers.pop(peer.key, None)
        if state is not None:
            self._stale_agents.add(state.agent)
            logger.info(
                "forgetting the handshake with prefill engine %s at %s:%d after a failed load",
                peer.engine_id, peer.host, peer.port,
            )

    def _free_recv(self, job: LoadJob) -> None:
        if job.recv_offset is not None and self._recv_ranges is not None:
            self._recv_ranges.free(job.recv_offset, job.recv_nbytes)
            job.recv_offset = None

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
                    lease_tokens=[load.lease_token],
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

    def close(self) -> None:
        """Release what completed last, drop pending handshakes (the executor and clients
        belong to the worker)."""
        self._settle_completed()
        self._spent = []
        self._handshakes.clear()
