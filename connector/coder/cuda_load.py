"""The CUDA coder's load half: a decode plan per load, built while its READs move, launched per
run of landed groups, its verdict read back without a host synchronisation until the load ends.

Verification is part of the decode launch: each decode program checks the chunk it owns
(header, geometry, layer, token range, tag, body checksum: the reference decoder's checks)
before it writes anything, and writes that chunk only if it passed. The loader hands each run
of groups that landed together over in one call; its captured launch (``cuda_graphs``) is
replayed at once, else the handles wait for the first ask whether they ran and the runs queued
by then go out together: one launch, not one per group (each launch ends in a drain tail: H200,
Llama-3.1-8B shapes, 4k tokens, 8 groups landed at once: 0.70 ms landed -> finished one by one
vs 0.35 ms for one launch).

Refusals. A chunk that fails verification is never written; the load fails as a whole (vLLM
recomputes its blocks). Valid chunks launched with it may be written: every slot a refused load
writes is one its successful load would write, in blocks vLLM allocated to this request (the
plan's block ids are the load's own block table, bounds-checked when the plan is built), so what
a refused load leaves behind lies only in blocks vLLM recomputes for that same request.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from turbowire.connector import probe
from turbowire.connector.coder.base import ChunkOffsets
from turbowire.connector.coder.cuda_graphs import Captured, DecodeGraphs, Launch, Ranges
from turbowire.kernels import NO_BLOCK, BlockIndexError, ChunkSet, DecodeLayersPlan

if TYPE_CHECKING:
    import torch

    from turbowire.connector.metadata import LoadRequest
    from turbowire.connector.tp_plan import ChunkCut

MAX_LOAD_PLANS = 16  # loads decoding at once (a failed load's plan is evicted in age order)


@dataclass
class LoadPlans:
    load: Any
    recv_offset: int
    plans: list[tuple[DecodeLayersPlan, list[int]]]
    left: set[int]  # layers not handed over by the loader yet
    queued: range | None = None  # layers handed over, not launched yet
    waiting: list[PendingGroup] = field(default_factory=list)  # their handles
    # captured launches per layer run, keyed (first, last + 1); at most one launch of each
    # layer is ever replayed (DecodeGraphs.take)
    graphs: dict[tuple[int, int], Captured] = field(default_factory=dict)


class CudaDecoder:
    """The decode plans of one worker's loads (see the module)."""

    def __init__(self, coder: Any, recv: torch.Tensor | None) -> None:
        self.coder = coder  # the CudaCoder: codec, caches, families, kernel config
        self.recv = recv
        self.graphs = DecodeGraphs(coder.device)
        self.loads: OrderedDict[int, LoadPlans] = OrderedDict()

    def _build(self, load: LoadRequest, recv_offset: int, chunks: ChunkOffsets,
               cut: ChunkCut | None) -> LoadPlans:
        coder = self.coder
        assert self.recv is not None
        bs = coder.geometry.block_size
        table = load.block_ids
        idx = np.array([b.index for b in load.blocks], dtype=np.int64)
        ids = np.array([b.block_id for b in load.blocks], dtype=np.int64)
        tab = np.asarray(table, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= tab.size
                         or not np.array_equal(tab[np.clip(idx, 0, max(tab.size - 1, 0))], ids)):
            bad = next(b.index for b in load.blocks
                       if not 0 <= b.index < len(table) or table[b.index] != b.block_id)
            raise BlockIndexError(f"block table does not map block {bad}")
        tokens = np.array([b.num_tokens for b in load.blocks], dtype=np.int64)
        tags = np.array([b.tag for b in load.blocks], dtype=np.uint64)
        per_group: dict[int, tuple[ChunkSet, np.ndarray]] = {}
        plans = []
        for fam in coder.families:
            if fam.group not in per_group:
                # the blocks this group's table holds (every loaded block with one group)
                gtab = np.asarray(load.table(fam.group), dtype=np.int64)
                held = np.flatnonzero(gtab[idx] != NO_BLOCK) if idx.size else idx
                per_group[fam.group] = (ChunkSet(
                    [gtab], np.zeros(held.size, np.int64), idx[held] * bs, tokens[held],
                    tags[held]), held)
            cset, held = per_group[fam.group]
            if not held.size:  # none of the load's blocks is held by these layers' group
                continue
            rows = np.asarray(fam.layers)[:, None]
            offsets = recv_offset + chunks.offsets[rows, held[None, :]]
            sizes = chunks.sizes[rows, held[None, :]]
            # a cut: each chunk's bytes are cut.parts staged runs of heads of one size, each
            # decoded through its head window by a plan of its own
            windows = cut.windows if cut is not None else (None,)
            part = sizes // len(windows)
            for i, window in enumerate(windows):
                plans.append((DecodeLayersPlan(
                    coder.codec, fam.layers, [coder.caches.tensors[j] for j in fam.layers],
                    fam.layout, cset, offsets + i * part, part, self.recv, coder.kernel_config,
                    [coder.scales(j) for j in fam.layers], window=window,
                ), fam.layers))
        return LoadPlans(load, recv_offset, plans, set(range(coder.geometry.num_layers)))

    def entry(self, load: LoadRequest, recv_offset: int, chunks: ChunkOffsets,
              cut: ChunkCut | None = None) -> LoadPlans:
        key = id(load)
        entry = self.loads.get(key)
        if entry is None or entry.load is not load or entry.recv_offset != recv_offset:
            entry = self._build(load, recv_offset, chunks, cut)
            self.loads[key] = entry
            while len(self.loads) > MAX_LOAD_PLANS:
                self.loads.popitem(last=False)
        return entry

    def prepare(self, load: LoadRequest, recv_offset: int, chunks: ChunkOffsets,
                cut: ChunkCut | None = None) -> None:
        """Build and upload the load's plan while the bytes move (the validations raise here,
        failing the load before it lands) and capture the launches of its groups and runs."""
        entry = self.entry(load, recv_offset, chunks, cut)
        if entry.graphs or entry.queued is not None or entry.waiting:
            self.graphs.retired.clear()
            return
        runs = [*chunks.groups, *chunks.runs]
        entry.graphs = self.graphs.capture((layers, self.ranges(entry, layers))
                                           for layers in runs)

    def decode(self, load: LoadRequest, layers: range, recv_offset: int,
               chunks: ChunkOffsets, cut: ChunkCut | None = None) -> PendingGroup:
        """Queue the verify + decode of ``layers``; the captured launch of exactly the layers
        queued is replayed at once, else the load's queued layers go out together when a handle
        is first asked whether it ran."""
        entry = self.entry(load, recv_offset, chunks, cut)
        queued = entry.queued
        if queued is not None and queued.stop != layers.start:
            self.flush(entry)
            queued = None
        lo = layers.start if queued is None else queued.start
        entry.queued = range(lo, layers.stop)
        handle = PendingGroup(self, entry, layers)
        entry.waiting.append(handle)
        entry.left.difference_update(layers)
        if not entry.left:  # the plan lives on in the handles until they are settled
            self.loads.pop(id(load), None)
        if (lo, layers.stop) in entry.graphs:
            self.flush(entry)  # the captured launch: replay it now
        return handle

    @staticmethod
    def ranges(entry: LoadPlans, layers: range) -> Ranges:
        """(plan, lo, hi) per family plan holding some of ``layers`` (positions in the plan)."""
        out = []
        for plan, fam_layers in entry.plans:
            pos = [p for p, layer in enumerate(fam_layers) if layers.start <= layer < layers.stop]
            if pos:
                assert pos[-1] + 1 - pos[0] == len(pos), "a group's layers are contiguous"
                out.append((plan, pos[0], pos[-1] + 1))
        return out

    def flush(self, entry: LoadPlans) -> None:
        """Launch the entry's queued layers (replay their graphs, or launch them directly)."""
        queued, waiting = entry.queued, entry.waiting
        entry.queued, entry.waiting = None, []
        if queued is None:
            return
        with probe.mark("coder.launch"):
            caps = self.graphs.take(entry.graphs, queued)
            try:
                launch = (self.graphs.replay(caps) if caps
                          else self.graphs.launch(self.ranges(entry, queued)))
            except BaseException as exc:
                launch = Launch([], [], None, error=exc)
        for handle in waiting:
            handle.launch = launch
        if launch.error is not None:
            raise launch.error

    def abandon(self, entry: LoadPlans, handle: PendingGroup) -> None:
        """The load failed: nothing queued is launched any more, no captured launch replayed."""
        if handle in entry.waiting:
            entry.queued, entry.waiting = None, []
        self.graphs.retired.extend(entry.graphs.values())
        entry.graphs = {}
        if self.loads.get(id(entry.load)) is entry:
            del self.loads[id(entry.load)]


class PendingGroup:
    """The loader's handle on one landed group's decode (``coder.base.PendingDecode``)."""

    def __init__(self, decoder: CudaDecoder, entry: LoadPlans, layers: range) -> None:
        self._decoder = decoder
        self._entry = entry
        self.layers = layers
        self.launch: Launch | None = None

    def _launched(self) -> Launch:
        if self._entry.queued is not None:  # launch what the load has queued (this, or later
            self._decoder.flush(self._entry)  # groups: they must not wait for this one)
        assert self.launch is not None
        return self.launch

    def done(self) -> bool:
        """Whether the group's decode has run (first launches what the load has queued);
        never waits."""
        return self._launched().done()

    def result(self) -> None:
        """Wait for the group's decode; raise the reference's exception if one of the chunks
        launched with it was refused (that chunk was not written; the valid ones were)."""
        self._launched().check()

    def abandon(self) -> None:
        """The load failed: launch nothing more for it, and wait for what was launched (it
        reads the receive range the loader is about to give back)."""
        self._decoder.abandon(self._entry, self)
        if self.launch is not None and self.launch.event is not None:
            self.launch.event.synchronize()
