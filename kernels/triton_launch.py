"""Host side of the Triton codec kernels: validation, item tables, launches, error reporting.

``encode_into`` / ``decode_into`` (one layer) and ``encode_layers_into`` / ``decode_layers_into``
(several layers of one model in as few launches as possible: one per distinct layer policy)
take the same items (``kernels/items.py``) as the reference; callers reach them through the front
door (``turbowire.kernels.encode_into`` / ``encode_layers_into`` ..., ``kernels/dispatch.py``),
which picks this implementation for CUDA caches. Everything a peer can influence is checked on the
host before a launch (block ids, token ranges, buffer ranges); chunk headers and body checksums
are checked on the GPU by the decode kernel itself: each program verifies the chunk it decodes
(the reference decoder's checks) and writes nothing of it unless it passed. A refused chunk is
never written; other chunks of the same call may be (the reference and C paths check every chunk
of a call before writing any). Decoding reads the per-chunk statuses back to the host (one
synchronisation per call) to raise the same exception the reference path raises.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from turbowire.codec import Codec, GeometryError, StreamSpec
from turbowire.codec.errors import TruncatedPayloadError
from turbowire.codec.wire import HEADER_BYTES
from turbowire.kernels.fp8_cache import KVScales
from turbowire.kernels.items import DecodeItem, EncodeItem
from turbowire.kernels.paged import CacheLayoutError, PagedKVLayout
from turbowire.kernels.triton_common import (  # noqa: F401 - their old home, re-exported
    _MAX_LEVELS,
    DEFAULT_CONFIG,
    SUPPORTED_DTYPES,
    TUNED_ENCODE_REGISTERS,
    KernelConfig,
    StagingAlignmentError,
    _block_size_arg,
    _cache_geom,
    _check_disjoint,
    _check_jobs,
    _check_range,
    _decode_calls,
    _group_key,
    _kernel_cache,
    _Launch,
    _pow2,
    _raise_like_reference,
    _scale_columns,
    _sign_mask,
    _sizes,
    _slot_spans,
    _stream_consts,
    _tables,
    _transforms,
    applies,
    interpreting,
    triton_available,
)


def _head_shift(start: int, count: int, cache_heads: int, strides: tuple[int, int, int]) -> int:
    """Elements a run of heads starting at cache head ``start`` shifts the layer's planes by."""
    if start + count > cache_heads:
        raise GeometryError(f"heads {start}+{count} outside the cache's {cache_heads}")
    shift = start * strides[2]
    if shift % 16:
        raise CacheLayoutError(f"a run of heads shifts the cache planes by {shift} elements; "
                               "the kernels need multiples of 16")
    return shift


def _check_disjoint_writes(writes: list[tuple[int, range, list[tuple[int, int, str]]]],
                           by_head: bool) -> None:
    """No two chunks write the same slots of one cache (of one head, ``by_head``: head windows
    of several prefill ranks' chunks fill one token's heads side by side)."""
    groups: dict[tuple[int, int], list[tuple[int, int, str]]] = {}
    for ptr, heads, spans in writes:
        for h in heads if by_head else (0,):
            groups.setdefault((ptr, h), []).extend(spans)
    for spans in groups.values():
        _check_disjoint(spans)


class EncodePlan:
    """Validated launches of the encode kernel for (layer, cache, layout, items) jobs: one launch
    per distinct layer policy. ``launch()`` may be called repeatedly (and captured in a CUDA
    graph): the per-chunk checksum scratch is reset by the kernel itself."""

    def __init__(
        self,
        codec: Codec,
        jobs: Sequence[tuple[int, torch.Tensor, PagedKVLayout, Sequence[EncodeItem]]],
        staging: torch.Tensor,
        config: KernelConfig | None = None,
        kv_scales: Sequence[KVScales | None] | None = None,
    ) -> None:
        cfg = config or DEFAULT_CONFIG
        self.written: list[list[int]] = []
        self._calls: list[tuple[tuple[int], tuple[Any, ...], dict[str, Any]]] = []
        self.compiled: list[Any] = []  # the kernels of the last launch (registers, spills)
        if not jobs:
            return
        base, lay0 = _check_jobs(codec, jobs, staging, "staging")
        scale_cols = _scale_columns(base, len(jobs), kv_scales)
        dim = codec.head_dim
        launches: dict[tuple[tuple[StreamSpec, StreamSpec], int], _Launch] = {}
        spans: list[tuple[int, int, str]] = []
        strides = None
        for (layer, cache, layout, items), (kscale, vscale) in zip(jobs, scale_cols):
            geom = _cache_geom(cache, layout, base)
            if strides is not None and geom.strides != strides:
                raise CacheLayoutError("all layers of one call must share cache strides")
            strides = geom.strides
            sizes = []
            for item in items:
                # a run of heads (``head_count``): a chunk of those heads alone, read from
                # the cache's head ``head_start`` on (the layer's planes shifted by that many heads)
                heads = item.head_count or layout.num_heads
                shift = _head_shift(item.head_start, heads, layout.num_heads, geom.strides)
                launch = launches.setdefault((_group_key(codec, layer), heads), _Launch([]))
                blk0, _ids = launch.blocks.add(layout, item.block_ids, item.token_start,
                                               item.num_tokens)
                if item.num_tokens > (1 << 16):
                    raise GeometryError(
                        f"a chunk holds at most 65536 tokens, got {item.num_tokens}")
                if not 0 <= item.tag < 1 << 64:
                    raise GeometryError("tag must fit in 64 unsigned bits")
                nbytes, kbytes = _sizes(codec, layer, item.num_tokens, heads, item.token_start)
                _check_range(staging, item.out_offset, nbytes, "staging")
                spans.append((item.out_offset, item.out_offset + nbytes, "staging bytes"))
                p = _pow2(item.num_tokens)
                launch.max_tokens = max(launch.max_tokens, p)
                launch.rows.append([
                    geom.k_off + shift, geom.v_off + shift, item.token_start, item.num_tokens, p,
                    item.out_offset,
                    blk0, item.tag & 0xFFFFFFFF, item.tag >> 32, layer,
                    nbytes - HEADER_BYTES, kbytes, kscale, vscale,
                ])
                sizes.append(nbytes)
            self.written.append(sizes)
        _check_disjoint(spans)
        assert strides is not None
        device = base.device
        tab = _tables(dim, device)
        dtype_code = 2 if base.dtype == torch.float16 else 1  # fp8 caches are coded as bf16
        sqrt_d = float(torch.tensor(math.sqrt(dim), dtype=torch.float32))
        for ((kspec, vspec), heads), launch in launches.items():
            n = len(launch.rows)
            if n == 0:
                continue
            tf = _transforms(kspec, vspec)
            lanes = cfg.lanes_for(dim, True, tf)
            bt = cfg.tile_rows_for(dim, True, tf)
            sbt = cfg.sum_rows_for(dim, tf)
            lv = max(launch.max_tokens // sbt, 1).bit_length() - 1
            if lv > _MAX_LEVELS:
                raise GeometryError("chunk too long for the Triton chunk-mean fold")
            table = torch.tensor(launch.rows, dtype=torch.int64).to(device)
            blocks = torch.tensor(launch.blocks.ids or [0], dtype=torch.int32).to(device)
            acc = torch.zeros(2 * n, dtype=torch.int32, device=device)
            consts = {**_stream_consts(kspec, dim).prefixed("K"),
                      **_stream_consts(vspec, dim).prefixed("V")}
            args = (_kernel_cache(base), staging, table, blocks, tab, acc, strides[0], strides[1],
                    strides[2],
                    _block_size_arg(lay0.block_size), heads, codec.preset.preset_id,
                    codec.num_layers, dtype_code, n)
            kwargs = dict(
                D=dim, L=lanes, BT=bt, SBT=sbt, LV=lv, **consts, QMODE=cfg.qmode,
                FP8_MANUAL=interpreting(), SQRT_D=sqrt_d, S1M=_sign_mask(dim, 0),
                S2M=_sign_mask(dim, 1), NUM_WARPS=cfg.num_warps,
                SMAJOR=cfg.stream_major_for(kspec, vspec),
                **cfg.launch_options(cfg.encode_registers_for(kspec, vspec, dim)),
                enable_fp_fusion=False,
            )
            self._calls.append(((n * 2 * heads,), args, kwargs))

    def launch(self) -> None:
        from turbowire.kernels import triton_codec as tk

        self.compiled = [tk.encode_kernel[grid](*args, **kwargs)
                         for grid, args, kwargs in self._calls]


class DecodePlan:
    """Validated verify + decode launches for (layer, cache, layout, items) jobs: one launch per
    distinct layer policy, each program verifying the chunk it decodes (a refused chunk is not
    written, the others are). ``check()`` reads the statuses back (the one host
    synchronisation) and raises the reference's exception for the first refused chunk."""

    def __init__(
        self,
        codec: Codec,
        jobs: Sequence[tuple[int, torch.Tensor, PagedKVLayout, Sequence[DecodeItem]]],
        source: torch.Tensor,
        config: KernelConfig | None = None,
        kv_scales: Sequence[KVScales | None] | None = None,
    ) -> None:
        cfg = config or DEFAULT_CONFIG
        self.codec = codec
        self.source = source
        self._calls: list[tuple[Any, tuple[int, ...], tuple[Any, ...], dict[str, Any]]] = []
        self.compiled: list[Any] = []  # the kernels of the last launch (registers, spills)
        self._refs: list[tuple[int, DecodeItem, PagedKVLayout]] = []
        self.status: torch.Tensor | None = None
        self.fails: torch.Tensor | None = None
        if not jobs:
            return
        base, lay0 = _check_jobs(codec, jobs, source, "source")
        scale_cols = _scale_columns(base, len(jobs), kv_scales)
        dim = codec.head_dim
        launches: dict[tuple[tuple[StreamSpec, StreamSpec], int], _Launch] = {}
        writes: list[tuple[int, range, list[tuple[int, int, str]]]] = []  # cache, heads, slots
        strides = None
        for (layer, cache, layout, items), (kscale, vscale) in zip(jobs, scale_cols):
            geom = _cache_geom(cache, layout, base)
            if strides is not None and geom.strides != strides:
                raise CacheLayoutError("all layers of one call must share cache strides")
            strides = geom.strides
            for item in items:
                # a head window (``heads``): of a chunk of ``src_heads`` heads, decode heads
                # head0.. into the cache's heads dst_start.. (the planes shifted to match)
                w = item.heads
                src_heads = w.src_heads if w is not None else layout.num_heads
                head0, count = (w.src_start, w.count) if w is not None else (0, src_heads)
                dst = w.dst_start if w is not None else 0
                if dst + count > layout.num_heads:
                    raise GeometryError(f"head window {w} outside the cache's "
                                        f"{layout.num_heads} heads")
                shift = (dst - head0) * geom.strides[2]
                if shift % 16:
                    raise CacheLayoutError(f"a head window shifts the cache planes by {shift} "
                                           "elements; the kernels need multiples of 16")
                launch = launches.setdefault((_group_key(codec, layer), src_heads), _Launch([]))
                if item.nbytes < HEADER_BYTES:
                    raise TruncatedPayloadError(
                        f"payload has {item.nbytes} bytes, a chunk header alone has {HEADER_BYTES}"
                    )
                _check_range(source, item.in_offset, item.nbytes, "source")
                blk0, ids = launch.blocks.add(layout, item.block_ids, item.token_start,
                                              item.num_tokens)
                writes.append((cache.data_ptr(), range(dst, dst + count),
                               _slot_spans(layout, ids, item.token_start, item.num_tokens)))
                if not 0 < item.num_tokens <= (1 << 16):
                    raise GeometryError(f"a chunk holds 1..65536 tokens, got {item.num_tokens}")
                tag = item.expected_tag
                if tag is not None and not 0 <= tag < 1 << 64:
                    raise GeometryError("expected_tag must fit in 64 unsigned bits")
                nbytes, kbytes = _sizes(codec, layer, item.num_tokens, src_heads,
                                        item.token_start)
                body = nbytes - HEADER_BYTES
                launch.rows.append([  # the columns of DECODE_FIELDS, in order
                    geom.k_off + shift, geom.v_off + shift, item.token_start, item.num_tokens,
                    item.in_offset, item.nbytes, blk0, (tag or 0) & 0xFFFFFFFF, (tag or 0) >> 32,
                    int(tag is not None), layer, body, kbytes, len(self._refs), kscale, vscale,
                    head0, count,
                ])
                self._refs.append((layer, item, layout))
        _check_disjoint_writes(writes, any(item.heads is not None for _l, _c, _lay, its in jobs
                                           for item in its))
        if not self._refs:
            return
        assert strides is not None
        device = base.device
        tab = _tables(dim, device)
        self.status = torch.zeros(len(self._refs), dtype=torch.int32, device=device)
        self._acc = torch.zeros(2 * len(self._refs), dtype=torch.int32, device=device)
        self.fails = torch.zeros(1, dtype=torch.int32, device=device)
        for ((kspec, vspec), heads), launch in launches.items():
            n = len(launch.rows)
            if n == 0:
                continue
            table = torch.tensor(launch.rows, dtype=torch.int64).to(device)
            blocks = torch.tensor(launch.blocks.ids or [0], dtype=torch.int32).to(device)
            self._calls += _decode_calls(
                cfg, kspec, vspec, dim, n, max(r[3] for r in launch.rows), _kernel_cache(base),
                source, table, blocks, tab, self.status, self._acc, self.fails, strides,
                lay0.block_size, heads, codec.preset.preset_id, codec.num_layers)

    def launch(self) -> None:
        if self.fails is None:
            return
        self.fails.zero_()
        self.compiled = [kernel[grid](*args, **kwargs)
                         for kernel, grid, args, kwargs in self._calls]

    def check(self) -> None:
        if self.fails is None or self.status is None:
            return
        st = torch.cat([self.status, self.fails]).cpu()  # the one host synchronisation
        n = self.status.numel()
        if int(st[n]) == 0:
            return
        i = next(j for j in range(n) if int(st[j]) != 0)
        layer, item, layout = self._refs[i]
        _raise_like_reference(self.codec, layer, item, layout, self.source, int(st[i]))


# ------------------------------------------------------------------------------------------
# entry points (same contract as the reference dispatch)
# ------------------------------------------------------------------------------------------
def encode_into(
    codec: Codec,
    layer: int,
    kv_cache: torch.Tensor,
    layout: PagedKVLayout,
    items: Sequence[EncodeItem],
    staging: torch.Tensor,
    config: KernelConfig | None = None,
    kv_scales: KVScales | None = None,
) -> list[int]:
    """Encode items of one layer into ``staging``; bytes written per item."""
    return encode_layers_into(codec, [(layer, kv_cache, layout, items)], staging, config,
                              None if kv_scales is None else [kv_scales])[0]


def encode_layers_into(
    codec: Codec,
    jobs: Sequence[tuple[int, torch.Tensor, PagedKVLayout, Sequence[EncodeItem]]],
    staging: torch.Tensor,
    config: KernelConfig | None = None,
    kv_scales: Sequence[KVScales | None] | None = None,
) -> list[list[int]]:
    """Encode (layer, cache, layout, items) jobs with one launch per distinct layer policy.

    All caches must share dtype, geometry and strides (one model); returns bytes per item.
    fp8 caches need ``kv_scales``, one (K, V) pair per job."""
    plan = EncodePlan(codec, jobs, staging, config, kv_scales)
    plan.launch()
    return plan.written


def decode_into(
    codec: Codec,
    layer: int,
    kv_cache: torch.Tensor,
    layout: PagedKVLayout,
    items: Sequence[DecodeItem],
    source: torch.Tensor,
    config: KernelConfig | None = None,
    kv_scales: KVScales | None = None,
) -> None:
    """Verify and decode every chunk and scatter it; a chunk that fails is not written (the
    others of the call are), and the reference's exception is raised for the first one."""
    decode_layers_into(codec, [(layer, kv_cache, layout, items)], source, config,
                       None if kv_scales is None else [kv_scales])


def decode_layers_into(
    codec: Codec,
    jobs: Sequence[tuple[int, torch.Tensor, PagedKVLayout, Sequence[DecodeItem]]],
    source: torch.Tensor,
    config: KernelConfig | None = None,
    kv_scales: Sequence[KVScales | None] | None = None,
) -> None:
    """Decode (layer, cache, layout, items) jobs: one launch per distinct layer policy, each
    program verifying the chunk it decodes; raises the reference's exception for the first
    chunk that fails verification (that chunk is not written; the valid ones are)."""
    plan = DecodePlan(codec, jobs, source, config, kv_scales)
    plan.launch()
    plan.check()
