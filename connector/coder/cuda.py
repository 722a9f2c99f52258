"""The CUDA coder: Triton plans per scheduler step on a side stream, decode plans per load, no
host synchronisation on the save path.

Save (prefill). One ``save_kv_layer`` of a step builds one plan for the step's saves
(``EncodeLayersPlan``: block tables, chunk token ranges, tags and staging offsets of every
layer, validated once with vectorised checks and uploaded in one non-blocking copy per table on
the side stream; sizes from the codec's ``encoded_nbytes``, checked once per build, never read
back). Each layer's call then records an event on the forward stream after the layer's KV
write, makes the side stream wait for it and launches that layer's encode there: layer i's
encode runs while layer i+1 computes (``mode="layer"``; ``"batched"``, the ``after_forward``
save schedule, launches every layer in ``finish_save``). ``finish_save`` launches the layers
vLLM did not hand over, then makes the forward stream wait for the side stream: an event wait,
not a host synchronisation. That is enough: the scheduler publishes a request only after it got
the step's sampled tokens, computed on the forward stream after that wait. Encode time comes
from CUDA events read once they have completed, never waited for.

Per-layer launches won over one batched launch after the last layer (H200, Llama-3.1-8B layer
shapes: within the noise at 4k tokens, ahead in most runs at 32k; bench/RESULTS.md "GPU
connector path"); the first ``DEFER_LAYERS`` calls of a step only note their layer (building the
plan at the first layer stalled the GPU: vLLM's host is then barely one layer ahead). The
per-layer launch runs eagerly between vLLM's piecewise CUDA graph pieces (the attention op is
the split point; ``requires_piecewise_for_cudagraph`` keeps FULL graphs off unless the save is
``after_forward``).

Layers whose caches differ (dtype, layout, strides: a draft model's) form families; every plan
is built per family, for the save, the load (``cuda_load``) and the store alike.

Store saves: every chunk of a step in one plan on a side stream of their own (the forward waits
for P2P encodes, never for a store save), the blobs copied to pinned host memory there; the
store's background thread waits for the copy. Tests drive this coder on CPU under Triton's
interpreter: the same plans, launched inline without streams.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from turbowire.connector import probe
from turbowire.connector.coder import host
from turbowire.connector.coder.base import BlobPlan, ChunkOffsets, check_sizes
from turbowire.connector.coder.cuda_load import CudaDecoder, PendingGroup
from turbowire.errors import TurboWireError
from turbowire.kernels import (
    NO_BLOCK,
    BlockIndexError,
    ChunkSet,
    EncodeLayersPlan,
    block_kernel_config,
    resolve_scales,
)

if TYPE_CHECKING:
    from turbowire.codec import Codec
    from turbowire.connector.caches import EngineCaches
    from turbowire.connector.geometry import KVGeometry, StagingLayout
    from turbowire.connector.metadata import LoadRequest
    from turbowire.connector.tp_plan import ChunkCut

MODES = ("layer", "batched")
DEFER_LAYERS = 2  # save_kv_layer calls of a step that only note their layer (see the module)
MAX_PENDING_TIMINGS = 8  # steps whose encode time is still being measured


@dataclass
class Family:
    """Layers whose caches share dtype, layout and strides: one plan covers them."""

    layers: list[int]
    layout: Any
    group: int = 0  # the KV cache group whose block table the layers use


@dataclass
class SaveStep:
    meta: Any
    plans: list[tuple[EncodeLayersPlan, list[int]]]
    where: dict[int, tuple[int, int]]  # layer -> (plan index, position in the plan)
    tokens: int
    wire_bytes: int
    launched: set[int] = field(default_factory=set)
    timings: list[tuple[Any, Any]] = field(default_factory=list)


class CudaBlobs:
    """A step's store blobs on their way to pinned host memory (or a host fallback's)."""

    background = True

    def __init__(self, host_buf: torch.Tensor, bases: list[int], sizes: list[int],
                 began: Any, copied: Any, t0: float) -> None:
        self.host, self.bases, self.sizes = host_buf, bases, sizes
        self.began, self.copied, self.t0 = began, copied, t0

    def wait(self) -> list[tuple[bytes | BaseException, float]]:
        if self.copied is not None:
            self.copied.synchronize()  # the store's thread waits, the engine thread does not
            seconds = self.began.elapsed_time(self.copied) / 1e3  # encode + copy on the device
        else:
            seconds = time.perf_counter() - self.t0
        buf = self.host.numpy()
        return [(buf[b:b + n].tobytes(), seconds)
                for b, n in zip(self.bases, self.sizes, strict=True)]


class CudaCoder:
    """Save and load of one worker's paged caches through the Triton plans (see the module)."""

    def __init__(self, codec: Codec, geometry: KVGeometry, caches: EngineCaches,
                 layout: StagingLayout | None, staging: torch.Tensor | None,
                 recv: torch.Tensor | None, chunk_nbytes: Any, *, mode: str = "layer",
                 kernel_config: Any = "auto") -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.codec = codec
        self.geometry = geometry
        self.caches = caches
        self.layout = layout
        self.staging = staging
        self.chunk_nbytes = chunk_nbytes
        self.mode = mode
        self.kernel_config = (block_kernel_config(geometry.block_size)
                              if kernel_config == "auto" else kernel_config)
        self.device = caches.device
        self.cuda = self.device.type == "cuda"
        self.side: torch.cuda.Stream | None = (
            torch.cuda.Stream(self.device) if self.cuda else None)
        self._store_side: torch.cuda.Stream | None = None
        fams: dict[tuple[Any, ...], Family] = {}
        for layer, cache in enumerate(caches.tensors):
            lay = caches.layouts[layer]
            group = geometry.layers[layer].group
            key = (group, cache.dtype, lay, tuple(lay.views(cache)[0].stride()))
            fams.setdefault(key, Family([], lay, group)).layers.append(layer)
        self.families = list(fams.values())
        self._noted: tuple[Any, list[int]] | None = None  # (meta, layers) before the plan
        self._step: SaveStep | None = None
        self._pending: list[list[tuple[Any, Any]]] = []
        self.recv = recv
        self.decoder = CudaDecoder(self, recv)

    def scales(self, layer: int) -> Any:
        return resolve_scales(self.caches.tensors[layer], self.caches.kv_scales(layer))

    # ------------------------------------------------------------------ save
    def _build_step(self, meta: Any) -> SaveStep:
        assert self.staging is not None and self.layout is not None
        bs = self.geometry.block_size
        all_slots = np.array([b.slot for save in meta.saves for b in save.blocks], np.int64)
        if all_slots.size and (all_slots.min() < 0 or all_slots.max() >= self.layout.num_slots):
            bad = all_slots[(all_slots < 0) | (all_slots >= self.layout.num_slots)][:5].tolist()
            raise IndexError(f"staging slot {bad} out of range [0, {self.layout.num_slots})")
        if np.unique(all_slots).size != all_slots.size:
            raise BlockIndexError("two blocks of one step are staged into the same slot")
        offs = np.array(self.layout.layer_offsets, dtype=np.int64)
        per_group: dict[int, tuple[ChunkSet, np.ndarray]] = {}

        def group_chunks(group: int) -> tuple[ChunkSet, np.ndarray]:
            """The step's chunks of the blocks ``group``'s table still holds (every block with
            one KV cache group; a sliding window's freed blocks are not staged) and their
            slots."""
            if group not in per_group:
                req, start, tokens, slots, tags = [], [], [], [], []
                for r, save in enumerate(meta.saves):
                    table = save.table(group)
                    for b in save.blocks:
                        if table[b.index] == NO_BLOCK:
                            continue
                        req.append(r)
                        start.append(b.index * bs)
                        tokens.append(b.num_tokens)
                        slots.append(b.slot)
                        tags.append(b.tag)
                per_group[group] = (
                    ChunkSet([s.table(group) for s in meta.saves], req, start, tokens, tags),
                    np.array(slots, dtype=np.int64))
            return per_group[group]

        # decode_tp_size: each chunk staged as one chunk per decode rank's heads, back to back
        cut = self.layout.head_groups

        def run_heads(layer: int) -> tuple[int, ...]:
            """The heads argument of ``chunk_nbytes`` for one run (none: whole chunks)."""
            return (self.geometry.layers[layer].num_kv_heads // cut,) if cut > 1 else ()

        plans = []
        where: dict[int, tuple[int, int]] = {}
        wire = 0
        for fam in self.families:
            chunks, slot = group_chunks(fam.group)
            if not slot.size:  # no block of the step is held by these layers' group
                continue
            out = slot[None, :] * self.layout.slot_bytes + offs[:, None]  # [layers, chunks]
            _, inv = chunks.size_keys()
            _, reps = np.unique(inv, return_index=True)  # one chunk of each size key
            plan = EncodeLayersPlan(
                self.codec, fam.layers, [self.caches.tensors[i] for i in fam.layers],
                fam.layout, chunks, out[fam.layers], self.staging, self.kernel_config,
                [self.scales(i) for i in fam.layers],
                # distinct slots, each chunk within its layer's room (checked below, before any
                # launch): no two chunks' staging bytes overlap
                check_disjoint=False, head_groups=cut,
            )
            for pos, layer in enumerate(fam.layers):  # once per layer and size key
                promised = [cut * self.chunk_nbytes(layer, int(chunks.tokens[i]),
                                                    int(chunks.start[i]) // bs, *run_heads(layer))
                            for i in reps.tolist()]
                check_sizes(plan.written[pos, reps], promised,
                            self.layout.full_chunk_bytes[layer], layer)
                where[layer] = (len(plans), pos)
            wire += plan.total_bytes
            plans.append((plan, fam.layers))
        tokens = sum(b.num_tokens for save in meta.saves for b in save.blocks)
        return SaveStep(meta, plans, where, tokens, wire)

    def _step_for(self, meta: Any) -> SaveStep:
        step = self._step
        if step is None or step.meta is not meta:
            with probe.mark("coder.save_plan"):
                ctx = torch.cuda.stream(self.side) if self.side is not None \
                    else contextlib.nullcontext()
                with ctx:  # tables uploaded in the side stream's order
                    step = self._build_step(meta)
            self._step = step
        return step

    def _launch(self, step: SaveStep, layers: Sequence[int] | None) -> None:
        """Encode ``layers`` (None: every layer not launched yet) after everything the current
        stream has queued so far (the layers' KV writes)."""
        if self.side is None:
            self._launch_now(step, layers)
            return
        self.side.wait_event(torch.cuda.current_stream(self.device).record_event())
        with torch.cuda.stream(self.side):
            t0 = torch.cuda.Event(enable_timing=True)
            t1 = torch.cuda.Event(enable_timing=True)
            t0.record(self.side)
            self._launch_now(step, layers)
            t1.record(self.side)
            step.timings.append((t0, t1))

    def _launch_now(self, step: SaveStep, layers: Sequence[int] | None) -> None:
        if layers is None:
            todo = [i for i in range(self.geometry.num_layers) if i not in step.launched]
            if not todo:
                return
            if len(todo) == self.geometry.num_layers:
                for plan, _ in step.plans:
                    plan.launch()
                step.launched.update(todo)
                return
            layers = todo
        for layer in layers:
            if layer in step.where:  # else its group holds none of the step's blocks
                p, pos = step.where[layer]
                step.plans[p][0].launch_layer(pos)
            step.launched.add(layer)

    def save_layer(self, layer: int, meta: Any) -> None:
        """vLLM's ``save_kv_layer`` for one layer of this step's saves (the first
        ``DEFER_LAYERS`` calls of a step only note their layer)."""
        if self._step is None or self._step.meta is not meta:
            if self._noted is None or self._noted[0] is not meta:
                self._noted = (meta, [])
            if len(self._noted[1]) < DEFER_LAYERS:
                self._noted[1].append(layer)
                return
        with probe.mark("coder.save_layer"):
            step = self._step_for(meta)
            todo = [layer]
            if self._noted is not None and self._noted[0] is meta:
                todo = self._noted[1] + todo
                self._noted = None
            todo = [x for x in todo if x not in step.launched]
            if self.mode == "layer" and todo:
                self._launch(step, todo)

    def finish_save(self, meta: Any) -> tuple[int, int]:
        """``wait_for_save``: encode what is left, order the current stream after every encode
        of the step; (tokens, wire bytes) of the step's saves."""
        with probe.mark("coder.finish_save"):
            step = self._step_for(meta)
            self._launch(step, None)
            if self.side is not None:
                torch.cuda.current_stream(self.device).wait_event(self.side.record_event())
        if step.timings:
            self._pending.append(step.timings)
            del self._pending[:-MAX_PENDING_TIMINGS]
        self._step = None
        self._noted = None
        return step.tokens, step.wire_bytes

    def encode_seconds(self) -> list[float]:
        """GPU time of the encode launches of every earlier step whose events have completed
        (one value per step); never waits."""
        done: list[float] = []
        still: list[list[tuple[Any, Any]]] = []
        for timings in self._pending:
            if all(t1.query() for _, t1 in timings):
                done.append(sum(t0.elapsed_time(t1) for t0, t1 in timings) / 1e3)
            else:
                still.append(timings)
        self._pending = still
        return done

    # ------------------------------------------------------------------ load
    def prepare_load(self, load: LoadRequest, recv_offset: int, chunks: ChunkOffsets,
                     cut: ChunkCut | None = None) -> None:
        """The loader's hook once a load's READs are posted (see ``cuda_load``)."""
        with probe.mark("coder.prepare_load"):
            self.decoder.prepare(load, recv_offset, chunks, cut)

    def decode(self, load: LoadRequest, layers: range, recv_offset: int,
               chunks: ChunkOffsets, cut: ChunkCut | None = None) -> PendingGroup:
        """A landed run through the load's prepared plan (``cut``: a prefill rank of another
        TP size, or one staging runs of heads: a plan per head window)."""
        return self.decoder.decode(load, layers, recv_offset, chunks, cut)

    # ------------------------------------------------------------------ store
    def encode_chunks(self, plan: BlobPlan) -> Any:
        """Every chunk of the step in one plan on the store's side stream; a plan the kernels
        refuse (one bad chunk) falls back to the host calls, chunk by chunk, which isolate it."""
        try:
            return self._encode_blobs(plan)
        except TurboWireError:
            return host.encode_blobs(self.codec, self.caches, plan)

    def decode_chunks(self, block_ids: Sequence[int], token_start: int, num_tokens: int,
                      chunks: Sequence[tuple[int, int]], tag: int, source: torch.Tensor,
                      skip: int) -> int:
        """A stored chunk through the kernels' per-layer calls (Triton for these caches)."""
        return host.decode_stored(self.codec, self.caches, block_ids, token_start, num_tokens,
                                  chunks, tag, source, skip)

    def _encode_blobs(self, plan: BlobPlan) -> CudaBlobs:
        t0 = time.perf_counter()
        bases, total = [], 0
        for size in plan.blob_nbytes:
            bases.append(total)
            total += -(-size // 64) * 64
        out = np.array([[base + off for off in offs]
                        for base, offs in zip(bases, plan.layer_offsets, strict=True)],
                       dtype=np.int64).T  # [layers, chunks]
        cset = ChunkSet(plan.block_ids, plan.request, plan.token_start,
                        [plan.num_tokens] * len(bases), plan.tags)
        layers = list(range(self.geometry.num_layers))
        began = copied = None
        ctx: Any = contextlib.nullcontext()
        if self.cuda:
            if self._store_side is None:
                self._store_side = torch.cuda.Stream(self.device)
            side = self._store_side
            side.wait_event(torch.cuda.current_stream(self.device).record_event())
            ctx = torch.cuda.stream(side)
        with ctx:
            if self.cuda:
                began = torch.cuda.Event(enable_timing=True)
                began.record(side)
            # allocated on the side stream: reused only by later side-stream work, i.e. after
            # the copy below, so nothing needs to hold it
            blobs = torch.empty(total, dtype=torch.uint8, device=self.device)
            enc = EncodeLayersPlan(
                self.codec, layers, self.caches.tensors, self.caches.layouts[0], cset, out,
                blobs, kv_scales=[self.scales(i) for i in layers], layouts=self.caches.layouts)
            check_sizes(enc.written.T, plan.layer_nbytes, None, -1)
            enc.launch()
            if self.cuda:
                host_buf = torch.empty(total, dtype=torch.uint8, pin_memory=True)
                host_buf.copy_(blobs, non_blocking=True)
                copied = torch.cuda.Event(enable_timing=True)
                copied.record(side)
            else:
                host_buf = blobs
        return CudaBlobs(host_buf, bases, list(plan.blob_nbytes), began, copied, t0)
