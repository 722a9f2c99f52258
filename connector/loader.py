"""The decode side's load state machine: handshake, claim, pipelined READs, decode, release.

Each load handshakes with the prefill engine once (cached per peer, in a thread so the engine
loop never blocks on the network), READs exactly the chunk bytes of the needed (block, layer)
pairs into the receive buffer, one READ per group of layers (``decode_pipeline_groups``, two in
flight; once a poll finds both landed, the link outpaces the engine's polls and every group left
goes out in one READ), claims the prefill lease while they move, and decodes each group as soon
as it has landed (nothing is decoded before the claim confirms the lease) while the later groups
are still on the wire, each run of consecutive groups that landed together in one decode call.
Each decode comes back as a handle (``PendingDecode``; the CUDA coder's may still be running):
the load finishes once all of them ran and none refused a chunk (one wait per load, when its
last group is handed over); it reports the load finished and, at the next poll, tells the
prefill engine to release the lease. Any failure lands in the failed set with its metric
reason; a READ that may still be writing when its load fails keeps its receive range
quarantined. The claim presents this engine's own prompt (``LoadRequest.prompt_digest``): a
lease staged for another prompt fails as ``prompt_mismatch`` before anything is decoded.

Its parts: ``loader_peers`` (handshakes, claims, releases on per-peer lanes), ``loader_reads``
(the READs on the wire, the landed groups taken for decoding), ``read_plan`` (the READs' groups
and descriptor rows), ``loader_failures`` (a failed load, its quarantined receive range).

Everything it talks to is injected (transport, side-channel clients, executor, the coder's
decode of a layer group into the paged cache), so a fake transport can unit-test it
(tests/unit/connector/test_loader.py), as vLLM tests its NIXL worker with a fake wrapper.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from turbowire.connector import probe
from turbowire.connector.coder.base import ChunkOffsets, PendingDecode
from turbowire.connector.config import TurboWireConfig
from turbowire.connector.geometry import KVGeometry, StagingLayout
from turbowire.connector.loader_failures import LoadFailures, Quarantined
from turbowire.connector.loader_peers import (  # noqa: F401 - the loader's errors, re-exported
    LeaseRefusedError,
    LoadFailed,
    PeerKey,
    PeerLinks,
    PeerState,
    PromptMismatchError,
)
from turbowire.connector.loader_reads import ReadPipeline, likely_runs
from turbowire.connector.metadata import LoadReport, LoadRequest
from turbowire.connector.read_plan import (
    ReadRows,
    chunk_sizes,
    cut_chunk_sizes,
    held_chunks,
    layer_groups,
    read_rows,
)
from turbowire.connector.staging import ByteRanges
from turbowire.connector.stats import P2P_LABEL, TurboWireConnectorStats
from turbowire.connector.tp_plan import (
    ChunkCut,
    HeadSource,
    TensorParallelError,
    chunk_cut,
    load_plan,
)
from turbowire.connector.transports.base import Transfer, Transport
from turbowire.errors import failure_reason
from turbowire.kernels import NO_BLOCK

if TYPE_CHECKING:
    from turbowire.connector.compat import CompatibilityRecord

logger = logging.getLogger(__name__)


@dataclass
class LoadJob:
    """One load's READs from one prefill rank (``source``): a load reads several when the
    prefill engine runs at a smaller TP size (``tp_plan``); it finishes once all have."""

    load: LoadRequest
    source: HeadSource
    created: float = field(default_factory=time.monotonic)
    recv_offset: int | None = None
    recv_nbytes: int = 0
    chunk_offsets: ChunkOffsets | None = None
    groups: list[range] = field(default_factory=list)  # layers of each READ
    xfers: list[Transfer] = field(default_factory=list)  # the READ of each posted group
    rows: ReadRows | None = None  # the descriptor rows of every group
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

    @property
    def prefill_rank(self) -> int:
        return self.source.prefill_rank

    @property
    def src_heads(self) -> int | None:
        """KV heads in each of the prefill rank's chunks (None: this rank's)."""
        return self.source.src_heads or None

    @property
    def peer_key(self) -> PeerKey:
        return (*self.load.peer.key, self.source.prefill_rank)

    cut: ChunkCut | None = None  # what of each K/V chunk this rank reads (None: all, in place)


DecodeGroup = Callable[..., PendingDecode]
"""decode(load, layers, recv_offset, chunks, cut=None): verify and decode the chunks of
``layers`` (landed at ``recv_offset + chunks[(block, layer)]``) into the paged cache, through
the ``cut`` (``tp_plan.ChunkCut``: the staged chunks of runs of heads a K/V chunk's bytes hold
and the window of each) when one is given; the handle says when that ran
(``CacheCoder.decode``). The load is finished once every handle ran, none refused."""

PrepareDecode = Callable[..., None]
"""prepare(load, recv_offset, chunks, cut=None): called once a load's first READs are posted, so
the decode is made ready while the bytes move (``CacheCoder.prepare_load``; ``cut`` as the
decode's, given when there is one); raising fails it."""


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
    tp_size: int = 1


class KVLoader(PeerLinks, ReadPipeline, LoadFailures):
    """Loads requests' KV from prefill engines; driven by the worker's per-step calls."""

    def __init__(
        self,
        config: TurboWireConfig,
        geometry: KVGeometry,
        layout: StagingLayout,
        chunk_nbytes: Callable[..., int],
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
        self.tp_size = local.tp_size
        self.record = local.record
        self.mem_type = local.mem_type
        self._recv_base = local.recv_base
        self._recv_device = local.recv_device
        self._num_local_blocks = local.num_local_blocks
        self._dense_bytes_per_token = local.dense_bytes_per_token
        self._transport = transport
        self._clients = clients
        self._recv_ranges = recv_ranges
        self.decode = decode  # the coder's decode of a landed run (swappable, as ``prepare``)
        self.prepare = prepare
        self._executor = executor
        self.stats = stats
        self._peers: OrderedDict[PeerKey, PeerState] = OrderedDict()
        self.max_peers = config.max_peers
        self._handshakes: dict[PeerKey, tuple[Future, float]] = {}
        self._jobs: list[LoadJob] = []
        # loads read from several prefill ranks: the reports of their finished parts, and how
        # many parts are left (request id -> ...)
        self._parts_done: dict[str, list[LoadReport]] = {}
        self._parts_left: dict[str, int] = {}
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
                self._queue(load)
        self._progress()

    def _queue(self, load: LoadRequest) -> None:
        """One job per prefill rank the load reads (one at equal TP sizes)."""
        try:
            sources = [HeadSource.same_rank(self.tp_rank)] if load.peer.tp_size == self.tp_size \
                else load_plan(self.record, load.peer.tp_size, self.tp_rank,
                               replicated=self.geometry.has_latent)
        except Exception as exc:  # noqa: BLE001 - the scheduler checked; never a stuck request
            self._fail_unplanned(dataclasses.replace(load, fail_reason="incompatible"))
            logger.error("KV load of request %s: no TP plan (%s)", load.request_id, exc)
            return
        if len(sources) > 1:
            self._parts_left[load.request_id] = len(sources)
            self._parts_done[load.request_id] = []
        self._jobs.extend(LoadJob(load, source) for source in sources)

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
        failed: set[str] = set()  # loads failed in this pass: their other parts go too
        for job in self._jobs:
            if job.load.request_id in failed:
                self._drop_job(job)
                continue
            try:
                with probe.mark("loader.advance"):
                    finished = self._advance(job, now)
                if finished:
                    self._spent.append(job)
                    continue  # finished
            except LoadFailed as exc:
                self._fail(job, exc.reason, str(exc))
                failed.add(job.load.request_id)
                continue
            except Exception as exc:  # noqa: BLE001 - every failure must reach failed_recving
                reason = failure_reason(exc)
                self._fail(job, reason, f"{type(exc).__name__}: {exc}")
                failed.add(job.load.request_id)
                continue
            still.append(job)
        if failed:
            for job in still:
                if job.load.request_id in failed:
                    self._drop_job(job)
            still = [job for job in still if job.load.request_id not in failed]
            for rid in failed:
                self._parts_left.pop(rid, None)
                self._parts_done.pop(rid, None)
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
        # each run of consecutive landed groups in one call; the next READs
        # go out before a run is decoded, so the link stays busy while the CPU/GPU decodes, and
        # groups that land meanwhile are taken by the next run
        while (landed := self._landed(job)) is not None:
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

    def _post(self, job: LoadJob, peer: PeerState) -> bool:
        staging = peer.info.staging
        load = job.load
        slots = [b.slot for b in load.blocks]
        bad = [s for s in slots if not 0 <= s < staging.num_slots]
        if bad:
            raise LoadFailed(
                "bounds", f"staging slots {bad[:5]} outside the peer's {staging.num_slots}"
            )
        bad_local = [b for table in (load.group_tables or [load.block_ids]) for b in table
                     if b != NO_BLOCK and not 0 <= b < self._num_local_blocks]
        if bad_local:
            raise LoadFailed("bounds", f"local block ids {bad_local[:5]} out of range")
        for block in load.blocks:
            if not 0 < block.num_tokens <= self.geometry.block_size:
                raise LoadFailed("bounds", f"block with {block.num_tokens} tokens")
        n_layers = self.geometry.num_layers
        groups = layer_groups(n_layers, self.config.decode_pipeline_groups)
        job.cut = self._cut(job.source, staging.head_groups)
        skip = None  # bytes of the staged runs of heads before this rank's, per chunk
        if job.cut is None:
            sizes = chunk_sizes(load.blocks, n_layers, self._sizer(job.src_heads))
        else:
            sizes, skip = cut_chunk_sizes(
                load.blocks, self._sizer(job.src_heads), self._part_sizer(job.cut),
                [not (layer.is_state or layer.is_latent) for layer in self.geometry.layers],
                job.cut.first, job.cut.parts)
        if load.group_tables:  # several KV cache groups: a group's freed blocks do not move
            if len(load.group_tables) != self.geometry.num_groups:
                raise LoadFailed("bounds", f"{len(load.group_tables)} block tables for "
                                           f"{self.geometry.num_groups} KV cache groups")
            sizes *= held_chunks(load.blocks, load.group_tables,
                                 [layer.group for layer in self.geometry.layers])
        flat = sizes.reshape(-1)
        ends = flat.cumsum()
        cursor = int(ends[-1]) if ends.size else 0
        offsets = ChunkOffsets((ends - flat).reshape(sizes.shape), sizes, groups,
                               likely_runs(groups, n_layers))
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
        job.rows = read_rows(offsets, slots, self._recv_base + start, self._recv_device,
                             staging.base_addr, staging.slot_bytes, staging.layer_offsets,
                             staging.device_id, skip)
        job.peer_agent = peer.agent
        job.posted = time.perf_counter()  # UCX may finish small READs inside the post call
        job.wait_seconds = time.monotonic() - job.created
        with probe.mark("loader.post_reads"):
            self._post_more(job)
        if self.prepare is not None:  # made ready while bytes move
            self.prepare(load, start, offsets, **({"cut": job.cut} if job.cut else {}))
        return True

    def _cut(self, source: HeadSource, head_groups: int) -> ChunkCut | None:
        """What this rank reads of each K/V chunk of ``source``'s prefill rank, which stages it
        as ``head_groups`` runs of heads (checked: a peer's number)."""
        try:
            return chunk_cut(source, head_groups, self.geometry.max_kv_heads)
        except TensorParallelError as exc:
            raise LoadFailed("incompatible", f"peer stages {head_groups} runs of heads per "
                                             f"chunk: {exc}") from exc

    def _part_sizer(self, cut: ChunkCut) -> Callable[[int, int, int], int]:
        """Exact bytes of one staged run of ``cut.sub_heads`` heads (0 for MLA / state layers,
        which move whole)."""
        def size(layer: int, tokens: int, block_index: int) -> int:
            spec = self.geometry.layers[layer]
            if spec.is_state or spec.is_latent:
                return 0
            return self._chunk_nbytes(layer, tokens, block_index, cut.sub_heads)
        return size

    def _sizer(self, heads: int | None) -> Callable[[int, int, int], int]:
        """Exact chunk bytes of a prefill rank whose chunks hold ``heads`` (None: this rank's)."""
        if heads is None:
            return self._chunk_nbytes
        return lambda layer, tokens, block_index: self._chunk_nbytes(layer, tokens, block_index,
                                                                     heads)

    def _decode_group(self, job: LoadJob, layers: range) -> float:
        """Hand one run of landed layer groups to the decode (its handle: ``job.pending``); the
        wall time of the call."""
        assert job.recv_offset is not None
        t0 = time.perf_counter()
        assert job.chunk_offsets is not None
        with probe.mark("loader.decode"):
            extra = {"cut": job.cut} if job.cut is not None else {}
            job.pending.append(self.decode(job.load, layers, job.recv_offset, job.chunk_offsets,
                                           **extra))
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
        left = self._parts_left.get(load.request_id)
        if left is not None:  # one of several prefill ranks read: the load waits for the rest
            self._parts_done[load.request_id].append(report)
            if left > 1:
                self._parts_left[load.request_id] = left - 1
                return
            del self._parts_left[load.request_id]
            report = combine_parts(self._parts_done.pop(load.request_id))
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

    def close(self) -> None:
        """Release what completed last, drop pending handshakes (the executor and clients
        belong to the worker)."""
        self._settle_completed()
        self._spent = []
        self._handshakes.clear()


def combine_parts(parts: list[LoadReport]) -> LoadReport:
    """One load read from several prefill ranks: each part wrote every token (its heads), so
    the tokens and dense bytes are one part's; the wire bytes and decode times add up, the
    transfer and waits take the slowest part."""
    first = parts[0]
    return dataclasses.replace(
        first,
        wire_bytes=sum(p.wire_bytes for p in parts),
        transfer_seconds=max(p.transfer_seconds for p in parts),
        decode_seconds=sum(p.decode_seconds for p in parts),
        handshake_seconds=max(p.handshake_seconds for p in parts),
        wait_seconds=max(p.wait_seconds for p in parts),
    )
