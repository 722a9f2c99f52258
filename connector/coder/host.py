"""The host coder: the kernels' per-layer calls (``turbowire.kernels.encode_into`` ...), which
pick the C codec or the reference for CPU caches (and Triton for CUDA caches the plans do not
serve). Every call returns once its bytes are written: a save is final when ``finish_save``
returns, a decode when ``decode`` does (its handle is done at once).

The store path's kernel calls live here too (``encode_blobs``, ``decode_stored``): the CUDA
coder falls back to them for a step its plan refused, and the store decodes a fetched chunk
with them on either coder.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from turbowire.connector import probe
from turbowire.connector.coder.base import BlobPlan, ChunkOffsets, DoneDecode, check_sizes
from turbowire.errors import TurboWireError
from turbowire.kernels import (
    NO_BLOCK,
    BlockIndexError,
    DecodeItem,
    EncodeItem,
    decode_layers_into,
    decode_state_into,
    decode_tail_into,
    encode_into,
    encode_layers_into,
    encode_state_into,
)

if TYPE_CHECKING:
    from turbowire.codec import Codec
    from turbowire.connector.caches import EngineCaches
    from turbowire.connector.geometry import KVGeometry, StagingLayout
    from turbowire.connector.metadata import LoadRequest, SaveRequest
    from turbowire.connector.tp_plan import ChunkCut


def wait_for_device(device: torch.device) -> None:
    """Wait for what the current stream queued (CUDA): the bytes are final once it returns."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


class HostBlobs:
    """Store blobs encoded inline: ready when ``encode_chunks`` returns."""

    background = False

    def __init__(self, results: list[tuple[bytes | BaseException, float]]) -> None:
        self.results = results

    def wait(self) -> list[tuple[bytes | BaseException, float]]:
        return self.results


def encode_blobs(codec: Codec, caches: EngineCaches, plan: BlobPlan) -> HostBlobs:
    """Each chunk of ``plan`` into its own blob, one chunk at a time: a chunk the kernels refuse
    (``TurboWireError``) is reported and the others go on."""
    results: list[tuple[bytes | BaseException, float]] = []
    device = caches.device
    for n, start in enumerate(plan.token_start):
        t0 = time.perf_counter()
        blob = torch.zeros(plan.blob_nbytes[n], dtype=torch.uint8, device=device)
        ids = plan.block_ids[plan.request[n]]
        jobs = [(layer, caches.tensors[layer], caches.layouts[layer],
                 [EncodeItem(ids, start, plan.num_tokens, off, plan.tags[n])])
                for layer, off in enumerate(plan.layer_offsets[n])]
        try:
            written = encode_layers_into(codec, jobs, blob,
                                         kv_scales=[caches.kv_scales(j[0]) for j in jobs])
        except TurboWireError as exc:
            results.append((exc, time.perf_counter() - t0))
            continue
        check_sizes([w[0] for w in written], plan.layer_nbytes[n], None, -1)
        results.append((bytes(blob.cpu().numpy()), time.perf_counter() - t0))
    return HostBlobs(results)


def decode_stored(codec: Codec, caches: Any, block_ids: Sequence[int], token_start: int,
                  num_tokens: int, chunks: Sequence[tuple[int, int]], tag: int,
                  source: torch.Tensor, skip: int) -> int:
    """Decode one stored chunk's layer chunks (``(offset, bytes)`` in ``source``, checked by
    the caller) into the caches; ``skip`` tokens at its start are vLLM's own (not written).
    The tokens written."""
    if caches.device.type != "cpu":
        source = source.to(caches.device)
    items = [DecodeItem(block_ids, token_start, num_tokens, off, size, tag)
             for off, size in chunks]
    if skip > 0:  # starts inside vLLM's own prefix cache: write only the tail
        for layer, item in enumerate(items):
            decode_tail_into(codec, layer, caches.tensors[layer], caches.layouts[layer], item,
                             source, skip, kv_scales=caches.kv_scales(layer))
        return num_tokens - skip
    jobs = [(layer, caches.tensors[layer], caches.layouts[layer], [item])
            for layer, item in enumerate(items)]
    decode_layers_into(codec, jobs, source,
                       kv_scales=[caches.kv_scales(layer) for layer in range(len(jobs))])
    return num_tokens


def decode_landed(codec: Codec, geometry: KVGeometry, caches: EngineCaches,
                  recv: torch.Tensor, load: LoadRequest, layers: range, recv_offset: int,
                  chunks: ChunkOffsets, cut: ChunkCut | None = None) -> None:
    """Verify and decode a load's landed chunks of ``layers`` (in ``recv``) into the caches
    through the kernels' per-layer calls; ``cut``: each K/V chunk's bytes are ``cut.parts``
    staged runs of heads, each decoded through its head window (a prefill rank of another TP
    size, or one that cut its chunks per decode rank's heads). Bytes final on return. The K/V
    layers whose caches share dtype and layout decode in one multi-layer call (Triton: one
    launch per layer policy, one status read)."""
    bs = geometry.block_size
    table = load.block_ids
    for block in load.blocks:
        if block.index >= len(table) or table[block.index] != block.block_id:
            raise BlockIndexError(f"block table does not map block {block.index}")
    calls: dict[tuple[Any, ...], list[tuple[int, list[DecodeItem]]]] = {}
    for layer in layers:
        items = []
        group_table = load.table(geometry.layers[layer].group)
        if geometry.layers[layer].is_state:
            for bi, block in enumerate(load.blocks):
                if group_table[block.index] != NO_BLOCK:
                    off, size = chunks[(bi, layer)]
                    decode_state_into(caches.layouts[layer], layer, geometry.num_layers,
                                      group_table[block.index], recv, recv_offset + off, size,
                                      block.tag)
            continue
        # a hybrid model's partial block: the slots past its tokens are zeroed, as vLLM
        # zeroes the blocks it allocates for models with Mamba layers (see zero_blocks)
        partial = []
        windows = cut.windows if cut is not None and not geometry.layers[layer].is_latent \
            else (None,)
        for bi, block in enumerate(load.blocks):
            if group_table[block.index] == NO_BLOCK:  # not held by this layer's group
                continue
            off, size = chunks[(bi, layer)]
            part = size // len(windows)  # the runs of one chunk are all of one size
            items.extend(DecodeItem(block_ids=group_table, token_start=block.index * bs,
                                    num_tokens=block.num_tokens,
                                    in_offset=recv_offset + off + i * part, nbytes=part,
                                    expected_tag=block.tag, heads=window)
                         for i, window in enumerate(windows))
            if block.num_tokens < bs and geometry.state_groups:
                partial.append(group_table[block.index])
        caches.layouts[layer].zero_blocks(caches.tensors[layer], partial)
        cache = caches.tensors[layer]
        key = (cache.dtype, caches.layouts[layer], cache.stride())
        calls.setdefault(key, []).append((layer, items))
    for jobs in calls.values():
        decode_layers_into(codec, [(layer, caches.tensors[layer], caches.layouts[layer], items)
                                   for layer, items in jobs], recv,
                           kv_scales=[caches.kv_scales(layer) for layer, _ in jobs])
    wait_for_device(caches.device)


class HostCoder:
    """Encode and decode through the kernels' per-layer calls (see the module)."""

    def __init__(self, codec: Codec, geometry: KVGeometry, caches: EngineCaches,
                 layout: StagingLayout | None, staging: torch.Tensor | None,
                 recv: torch.Tensor | None, chunk_nbytes: Any) -> None:
        self.codec = codec
        self.geometry = geometry
        self.caches = caches
        self.layout = layout
        self.staging = staging
        self.recv = recv
        self.chunk_nbytes = chunk_nbytes
        self.device = caches.device
        self._done: set[int] = set()  # layers of the step encoded so far
        self._seconds = 0.0
        self._steps: list[float] = []

    # ------------------------------------------------------------------ save
    def save_layer(self, layer: int, meta: Any) -> None:
        with probe.mark("coder.save_layer"):
            self._encode_layer(layer, meta.saves)

    def finish_save(self, meta: Any) -> tuple[int, int]:
        with probe.mark("coder.finish_save"):
            for layer in range(self.geometry.num_layers):
                if layer not in self._done:
                    self._encode_layer(layer, meta.saves)
            wait_for_device(self.device)
        tokens = wire = 0
        groups = [layer.group for layer in self.geometry.layers]
        for save in meta.saves:
            for block in save.blocks:
                tokens += block.num_tokens
                wire += sum(self._staged_nbytes(layer, block.num_tokens, block.index)
                            for layer in range(self.geometry.num_layers)
                            if save.table(groups[layer])[block.index] != NO_BLOCK)
        self._done.clear()
        self._steps.append(self._seconds)
        self._seconds = 0.0
        return tokens, wire

    def encode_seconds(self) -> list[float]:
        steps, self._steps = self._steps, []
        return steps

    def _cut(self, layer: int) -> int:
        """Chunks of consecutive heads this layer's chunk is staged as (``decode_tp_size``)."""
        spec = self.geometry.layers[layer]
        groups = self.layout.head_groups if self.layout is not None else 1
        return 1 if spec.is_state or spec.is_latent else groups

    def _staged_nbytes(self, layer: int, num_tokens: int, block_index: int) -> int:
        groups = self._cut(layer)
        if groups == 1:
            return self.chunk_nbytes(layer, num_tokens, block_index)
        heads = self.geometry.layers[layer].num_kv_heads // groups
        return groups * self.chunk_nbytes(layer, num_tokens, block_index, heads)

    def _encode_layer(self, layer: int, saves: Sequence[SaveRequest]) -> None:
        assert self.staging is not None and self.layout is not None
        if self.geometry.layers[layer].is_state:
            self._encode_state(layer, saves)
            return
        items, promised = [], []
        bs = self.geometry.block_size
        group = self.geometry.layers[layer].group
        cut = self._cut(layer)
        sub = self.geometry.layers[layer].num_kv_heads // cut
        for save in saves:
            table = save.table(group)
            for block in save.blocks:
                if table[block.index] == NO_BLOCK:  # its group no longer holds it: not staged
                    continue
                at = self.layout.chunk_offset(block.slot, layer)
                if cut == 1:
                    items.append(EncodeItem(block_ids=table, token_start=block.index * bs,
                                            num_tokens=block.num_tokens, out_offset=at,
                                            tag=block.tag))
                    promised.append(self.chunk_nbytes(layer, block.num_tokens, block.index))
                    continue
                # one chunk per run of heads, back to back (all of one size)
                size = self.chunk_nbytes(layer, block.num_tokens, block.index, sub)
                items.extend(EncodeItem(block_ids=table, token_start=block.index * bs,
                                        num_tokens=block.num_tokens, out_offset=at + g * size,
                                        tag=block.tag, head_start=g * sub, head_count=sub)
                             for g in range(cut))
                promised.extend([size] * cut)
        t0 = time.perf_counter()
        written = encode_into(self.codec, layer, self.caches.tensors[layer],
                              self.caches.layouts[layer], items, self.staging,
                              kv_scales=self.caches.kv_scales(layer))
        self._seconds += time.perf_counter() - t0
        check_sizes(written, promised, self.layout.full_chunk_bytes[layer], layer)
        self._done.add(layer)

    def _encode_state(self, layer: int, saves: Sequence[SaveRequest]) -> None:
        """A state layer: the state chunk of each block its group's table holds (the block with
        the state at the prompt's end, in the step that finishes the prompt)."""
        assert self.staging is not None and self.layout is not None
        group = self.geometry.layers[layer].group
        t0 = time.perf_counter()
        for save in saves:
            table = save.table(group)
            for block in save.blocks:
                if table[block.index] == NO_BLOCK:
                    continue
                written = encode_state_into(
                    self.caches.layouts[layer], layer, self.geometry.num_layers,
                    table[block.index], block.tag, self.staging,
                    self.layout.chunk_offset(block.slot, layer))
                check_sizes([written], [self.chunk_nbytes(layer, block.num_tokens, block.index)],
                            self.layout.full_chunk_bytes[layer], layer)
        self._seconds += time.perf_counter() - t0
        self._done.add(layer)

    # ------------------------------------------------------------------ load
    def prepare_load(self, load: LoadRequest, recv_offset: int, chunks: ChunkOffsets,
                     cut: ChunkCut | None = None) -> None:
        """Nothing to get ready: each group decodes when it lands."""

    def decode(self, load: LoadRequest, layers: range, recv_offset: int,
               chunks: ChunkOffsets, cut: ChunkCut | None = None) -> DoneDecode:
        """Verify and decode the chunks of ``layers`` now; the handle is done."""
        assert self.recv is not None
        decode_landed(self.codec, self.geometry, self.caches, self.recv, load, layers,
                      recv_offset, chunks, cut)
        return DoneDecode(layers)

    # ------------------------------------------------------------------ store
    def encode_chunks(self, plan: BlobPlan) -> HostBlobs:
        return encode_blobs(self.codec, self.caches, plan)

    def decode_chunks(self, block_ids: Sequence[int], token_start: int, num_tokens: int,
                      chunks: Sequence[tuple[int, int]], tag: int, source: torch.Tensor,
                      skip: int) -> int:
        return decode_stored(self.codec, self.caches, block_ids, token_start, num_tokens,
                             chunks, tag, source, skip)
