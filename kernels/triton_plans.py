"""Launch plans of the connector's chunk pattern: the same chunks in every layer, built from arrays.

The connector moves block-granular chunks: each KV block of a request is one chunk in every
layer (a 32k-token request is 2048 blocks x 32 layers = 65536 chunks). ``EncodePlan`` /
``DecodePlan`` (``triton_launch``) take one Python item per (layer, chunk) and validate and
tabulate them one by one, which costs ~1-2 us of host time per item, and their table uploads
(pageable memory) synchronise the host with the stream. The plans here take the chunks once,
layer-independent, as arrays (block lists, token ranges, tags), plus one ``[layers, chunks]``
array of buffer offsets; they validate with vectorised numpy (the same refusals, the same
exceptions as the item plans), build one int64 table per layer policy and upload it from pinned
memory with a non-blocking copy on the stream current at construction. No host
synchronisation happens before ``DecodeLayersPlan.check``.

* ``EncodeLayersPlan.launch_layer(i)`` encodes the chunks of the plan's i-th layer (one launch;
  the connector calls it once per layer during the forward pass); ``launch()`` encodes all
  layers with one launch per layer policy. Both write the bytes ``EncodePlan`` writes (same
  kernel, same table rows).
* ``DecodeLayersPlan.launch(lo, hi)`` verifies and decodes the chunks of layers lo..hi-1 (one
  launch per layer policy; each program verifies the chunk it decodes and writes nothing of it
  unless it passed: a refused chunk is never written, the valid chunks of the range are);
  ``check(lo, hi)`` reads one flag back (the one synchronisation) and raises the reference's
  exception for the first refused chunk; ``flag(lo)`` is that flag on the device, for a caller
  that copies it to pinned memory and checks it once an event says the copy ran.

Every launch is issued on the caller's current stream; the plan's tensors are allocated on the
stream current at construction (use the plan on that stream, or order the streams).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from turbowire.codec import Codec, GeometryError
from turbowire.codec.errors import TruncatedPayloadError
from turbowire.codec.wire import HEADER_BYTES
from turbowire.kernels.fp8_cache import KVScales
from turbowire.kernels.items import DecodeItem, HeadWindow
from turbowire.kernels.paged import NO_BLOCK, BlockIndexError, CacheLayoutError, PagedKVLayout
from turbowire.kernels.triton_common import (
    _MAX_LEVELS,
    DEFAULT_CONFIG,
    SUPPORTED_DTYPES,
    KernelConfig,
    StagingAlignmentError,
    _block_size_arg,
    _cache_geom,
    _decode_calls,
    _group_key,
    _kernel_cache,
    _raise_like_reference,
    _scale_columns,
    _sign_mask,
    _sizes,
    _stream_consts,
    _tables,
    _transforms,
    interpreting,
)

__all__ = ["ChunkSet", "DecodeLayersPlan", "EncodeLayersPlan"]


class ChunkSet:
    """Chunks shared by every layer: chunk n covers tokens [start[n], start[n] + tokens[n]) of
    request ``req[n]``, whose token t lives in block ``block_lists[req[n]][t // block_size]``.

    Validated once for a layout (the refusals of ``PagedKVLayout.token_index``): block ids in
    range and distinct within each request, token ranges inside the request's list, 1..65536
    tokens per chunk."""

    def __init__(self, block_lists: Sequence[Sequence[int] | np.ndarray],
                 req: Sequence[int] | np.ndarray, start: Sequence[int] | np.ndarray,
                 tokens: Sequence[int] | np.ndarray, tags: Sequence[int] | np.ndarray | None
                 ) -> None:
        lists = [np.asarray(b, dtype=np.int64).reshape(-1) for b in block_lists]
        self.lengths = np.array([len(b) for b in lists], dtype=np.int64)
        self.offsets = np.zeros(len(lists) + 1, dtype=np.int64)
        np.cumsum(self.lengths, out=self.offsets[1:])
        self.block_ids = (np.concatenate(lists) if lists else np.zeros(0, np.int64))
        self.req = np.asarray(req, dtype=np.int64).reshape(-1)
        self.start = np.asarray(start, dtype=np.int64).reshape(-1)
        self.tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        n = self.req.size
        if self.start.size != n or self.tokens.size != n:
            raise ValueError("req, start and tokens must have one entry per chunk")
        self.has_tag = tags is not None
        if tags is None:
            self.tags = np.zeros(n, dtype=np.uint64)
        else:
            try:
                if isinstance(tags, np.ndarray) and tags.dtype == np.uint64:
                    self.tags = tags.reshape(-1)
                else:
                    self.tags = np.array([int(t) for t in tags], dtype=np.uint64)
            except OverflowError:
                raise GeometryError("tags must fit in 64 unsigned bits") from None
            if self.tags.size != n:
                raise ValueError("tags must have one entry per chunk")
        self._checked: tuple[int, int] | None = None
        self._size_keys: tuple[np.ndarray, np.ndarray] | None = None

    def __len__(self) -> int:
        return int(self.req.size)

    def check(self, layout: PagedKVLayout) -> None:
        """The refusals of the item plans for these chunks in caches of ``layout``."""
        key = (layout.num_blocks, layout.block_size)
        if self._checked == key:
            return
        n = len(self)
        if n and (self.req.min() < 0 or self.req.max() >= self.lengths.size):
            raise ValueError("chunk request index out of range")
        ids = self.block_ids
        held = ids != NO_BLOCK
        if held.any():
            lo, hi = int(ids[held].min()), int(ids[held].max())
            if lo < 0 or hi >= layout.num_blocks:
                raise BlockIndexError(
                    f"block ids must be in 0..{layout.num_blocks - 1}, got {lo}..{hi}")
            seg = np.repeat(np.arange(self.lengths.size, dtype=np.int64), self.lengths)[held]
            if np.unique(seg * layout.num_blocks + ids[held]).size != seg.size:
                raise BlockIndexError("repeated block ids in one request")
        if n:
            bad = (self.tokens <= 0) | (self.start < 0)
            if bad.any():
                i = int(np.argmax(bad))
                raise BlockIndexError(
                    f"bad token range start={int(self.start[i])} count={int(self.tokens[i])}")
            need = (self.start + self.tokens - 1) // layout.block_size + 1
            have = self.lengths[self.req]
            short = need > have
            if short.any():
                i = int(np.argmax(short))
                raise BlockIndexError(
                    f"tokens up to {int(self.start[i] + self.tokens[i] - 1)} need "
                    f"{int(need[i])} blocks, {int(have[i])} block ids given")
            if not held.all():  # no chunk's tokens may fall in an entry the request lacks
                lacking = np.concatenate([[0], np.cumsum(~held)])
                first = self.blk0() + self.start // layout.block_size
                end = self.blk0() + (self.start + self.tokens - 1) // layout.block_size + 1
                hit = lacking[end] > lacking[first]
                if hit.any():
                    i = int(np.argmax(hit))
                    raise BlockIndexError(
                        f"tokens {int(self.start[i])}..{int(self.start[i] + self.tokens[i] - 1)} "
                        "fall in a block the request does not hold")
            if int(self.tokens.max()) > (1 << 16):
                raise GeometryError(
                    f"a chunk holds at most 65536 tokens, got {int(self.tokens.max())}")
        self._checked = key

    def size_keys(self) -> tuple[np.ndarray, np.ndarray]:
        """Distinct (tokens, first chunk of a sequence) keys and each chunk's index in them
        (a chunk's size depends on nothing else within one layer policy)."""
        if self._size_keys is None:
            key = self.tokens * 2 + (self.start == 0)
            uniq, inv = np.unique(key, return_inverse=True)
            self._size_keys = (uniq, inv.reshape(-1))
        return self._size_keys

    def blk0(self) -> np.ndarray:
        """Per chunk, the offset of its request's block list in ``block_ids``."""
        return self.offsets[:-1][self.req]

    def slots(self, block_size: int) -> np.ndarray:
        """Every cache slot (block * block_size + offset) the chunks cover, one per token."""
        n = len(self)
        if n == 0:
            return np.zeros(0, np.int64)
        total = int(self.tokens.sum())
        first = np.zeros(n, np.int64)
        np.cumsum(self.tokens[:-1], out=first[1:])
        chunk = np.repeat(np.arange(n, dtype=np.int64), self.tokens)
        t = self.start[chunk] + (np.arange(total, dtype=np.int64) - first[chunk])
        blocks = self.block_ids[self.blk0()[chunk] + t // block_size]
        return blocks * block_size + t % block_size


def _pow2_array(n: np.ndarray) -> np.ndarray:
    """1 << ceil(log2(n)) per element (1 <= n <= 65536: log2 is exact at powers of two)."""
    return np.left_shift(1, np.ceil(np.log2(np.maximum(n, 1).astype(np.float64)))
                         .astype(np.int64))


def _size_table(codec: Codec, layers: Sequence[int], heads: int, chunks: ChunkSet
                ) -> tuple[np.ndarray, np.ndarray]:
    """(chunk bytes, K stream bytes) per layer and size key of ``chunks.size_keys()``,
    ``[layers, keys]``: one codec layout per layer policy and key."""
    uniq, _ = chunks.size_keys()
    n_l = len(layers)
    nb = np.zeros((n_l, uniq.size), np.int64)
    kb = np.zeros((n_l, uniq.size), np.int64)
    per_policy: dict[Any, tuple[np.ndarray, np.ndarray]] = {}
    for i, layer in enumerate(layers):
        key = _group_key(codec, layer)
        hit = per_policy.get(key)
        if hit is None:
            u_nb = np.empty(uniq.size, np.int64)
            u_kb = np.empty(uniq.size, np.int64)
            for j, k in enumerate(uniq.tolist()):
                tokens, is_first = divmod(int(k), 2)
                u_nb[j], u_kb[j] = _sizes(codec, layer, tokens, heads, 0 if is_first else tokens)
            hit = per_policy[key] = (u_nb, u_kb)
        nb[i], kb[i] = hit
    return nb, kb


def _device_rows(device: torch.device, n: int, fields: Sequence[tuple[str, Any]],
                 inv: np.ndarray) -> torch.Tensor:
    """An int64 item table ``[layers * n, len(fields)]`` (layer-major) built on the device.

    Each field is ("L", [layers]) (one value per layer), ("N", [n]) (per chunk), ("LN",
    [layers, n]), ("LK", [layers, keys]) (per layer and size key, gathered by ``inv``: each
    chunk's key) or ("LI", [layers]) (the layer's value plus the chunk's index 0..n-1). Only
    these arrays cross the bus (one pinned, non-blocking copy per kind); the table itself is
    written by a few device kernels, not by the host."""
    kinds: dict[str, list[np.ndarray]] = {"L": [], "N": [], "LN": [], "LK": []}
    where: list[tuple[str, int]] = []
    for kind, arr in fields:
        store = "L" if kind == "LI" else kind
        where.append((kind, len(kinds[store])))
        kinds[store].append(np.asarray(arr, dtype=np.int64))
    n_l = next(np.asarray(a).shape[0] for kind, a in fields if kind != "N")
    up: dict[str, torch.Tensor] = {}
    for kind, arrs in kinds.items():
        if arrs:
            up[kind] = _to_device(np.stack(arrs, axis=-1), torch.int64, device)
    if "LK" in up:
        up["LK"] = up["LK"][:, _to_device(inv.astype(np.int64), torch.int64, device)]
    cols = []
    for kind, j in where:
        if kind == "L":
            cols.append(up["L"][:, None, j].expand(n_l, n))
        elif kind == "LI":
            cols.append(up["L"][:, None, j] + torch.arange(n, dtype=torch.int64, device=device))
        elif kind == "N":
            cols.append(up["N"][None, :, j].expand(n_l, n))
        else:
            cols.append(up[kind][:, :, j])
    return torch.stack(cols, dim=-1).reshape(n_l * n, len(fields))


def _check_buffer(buf: torch.Tensor, what: str, device: torch.device) -> None:
    if buf.dtype != torch.uint8 or buf.dim() != 1:
        raise TypeError(f"{what} must be a 1-D uint8 tensor")
    if buf.device != device:
        raise CacheLayoutError(f"{what} is on {buf.device}, the cache on {device}")


def _check_caches(codec: Codec, caches: Sequence[torch.Tensor], layout: PagedKVLayout,
                  layouts: Sequence[PagedKVLayout] | None) -> torch.Tensor:
    if not caches:
        raise ValueError("a plan needs at least one layer")
    base = caches[0]
    if layout.head_dim != codec.head_dim:
        raise CacheLayoutError(f"cache head_dim {layout.head_dim} != codec head_dim "
                               f"{codec.head_dim}")
    if base.dtype not in SUPPORTED_DTYPES:
        raise CacheLayoutError(
            f"the Triton kernels code bf16/fp16/fp8-e4m3 caches, got {base.dtype}")
    for i, cache in enumerate(caches):
        lay = layouts[i] if layouts is not None else layout
        if cache.dtype != base.dtype or cache.device != base.device or lay != layout:
            raise CacheLayoutError("all layers of one call must share dtype, device and geometry")
    return base


def _check_offsets(buf: torch.Tensor, off: np.ndarray, nbytes: np.ndarray, what: str) -> None:
    """Range, 16-byte alignment and (for writes) disjointness of [off, off + nbytes) spans."""
    if off.size == 0:
        return
    end = off + nbytes
    bad = (off < 0) | (nbytes < 0) | (end > buf.numel())
    if bad.any():
        i = int(np.argmax(bad.reshape(-1)))
        o, n = int(off.reshape(-1)[i]), int(nbytes.reshape(-1)[i])
        raise BlockIndexError(
            f"{what} range {o}..{o + n} is outside the {buf.numel()}-byte buffer")
    mis = off % 16 != 0
    if mis.any():
        o = int(off.reshape(-1)[int(np.argmax(mis.reshape(-1)))])
        raise StagingAlignmentError(
            f"{what} offset {o} is not a multiple of 16 bytes (the Triton kernels need it)")


def _check_disjoint(off: np.ndarray, nbytes: np.ndarray, what: str) -> None:
    o = off.reshape(-1)
    e = (off + nbytes).reshape(-1)
    order = np.argsort(o, kind="stable")
    so, se = o[order], e[order]
    clash = so[1:] < se[:-1]
    if clash.any():
        i = int(np.argmax(clash))
        raise BlockIndexError(
            f"two chunks write the same {what} ({int(so[i])}..{int(se[i])} overlaps "
            f"{int(so[i + 1])})")


def _to_device(rows: np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host array on the device: through pinned memory and a non-blocking copy on the
    current stream (no host synchronisation; PyTorch's pinned allocator keeps the buffer
    until the copy has run)."""
    if device.type != "cuda":
        return torch.from_numpy(np.ascontiguousarray(rows)).to(dtype)
    host = torch.empty(rows.shape, dtype=dtype, pin_memory=True)
    host.numpy()[...] = rows
    return host.to(device, non_blocking=True)


class _Policy:
    """One layer policy's launch: its layers (positions in the plan) and their table rows."""

    def __init__(self, key: Any) -> None:
        self.key = key
        self.positions: list[int] = []
        self.table: torch.Tensor | None = None


class EncodeLayersPlan:
    """Encode launches for ``chunks`` in each of ``layers`` (see the module docstring).

    ``out_offsets[i, n]``: where chunk n of the i-th layer goes in ``staging``. ``written``
    holds the bytes each chunk takes, ``[layers, chunks]``, known without running anything."""

    def __init__(
        self,
        codec: Codec,
        layers: Sequence[int],
        caches: Sequence[torch.Tensor],
        layout: PagedKVLayout,
        chunks: ChunkSet,
        out_offsets: np.ndarray,
        staging: torch.Tensor,
        config: KernelConfig | None = None,
        kv_scales: Sequence[KVScales | None] | None = None,
        layouts: Sequence[PagedKVLayout] | None = None,
        check_disjoint: bool = True,
        head_groups: int = 1,
    ) -> None:
        """``check_disjoint=False``: the caller guarantees that no two chunks' staging ranges
        overlap (e.g. distinct slots of a fixed layout whose room each size was checked
        against), which saves a sort of every (layer, chunk) range. ``head_groups``: each chunk
        is staged as that many chunks of consecutive heads, back to back from its offset (a
        prefill engine cutting its chunks per decode rank's heads); ``written`` is then their
        sum."""
        cfg = config or DEFAULT_CONFIG
        self.layers = [int(x) for x in layers]
        n_l, n = len(self.layers), len(chunks)
        out = np.asarray(out_offsets, dtype=np.int64).reshape(n_l, n)
        if len(caches) != n_l:
            raise ValueError(f"{len(caches)} caches for {n_l} layers")
        base = _check_caches(codec, caches, layout, layouts)
        _check_buffer(staging, "staging", base.device)
        chunks.check(layout)
        scale_cols = _scale_columns(base, n_l, kv_scales)
        geoms = [_cache_geom(c, layout, base) for c in caches]
        if any(g.strides != geoms[0].strides for g in geoms):
            raise CacheLayoutError("all layers of one call must share cache strides")
        strides = geoms[0].strides
        self.n = n
        self.written = np.zeros((n_l, n), np.int64)
        self._layer_calls: list[list[tuple[Any, ...]]] = [[] for _ in range(n_l)]
        self._calls: list[tuple[Any, ...]] = []
        if n == 0:
            return
        groups = int(head_groups)
        if groups < 1 or layout.num_heads % groups:
            raise GeometryError(f"{layout.num_heads} KV heads do not split into {head_groups} "
                                "runs of heads")
        heads = layout.num_heads // groups
        nb_lk, kb_lk = _size_table(codec, self.layers, heads, chunks)
        _, inv = chunks.size_keys()
        self.written = groups * nb_lk[:, inv]
        _check_offsets(staging, out, self.written, "staging")
        if check_disjoint:
            _check_disjoint(out, self.written, "staging bytes")
        # one table row per run of heads: chunk c's run g is row c * groups + g, written right
        # after run g - 1 and read from the cache's head g * heads on (the planes shifted)
        g = np.tile(np.arange(groups, dtype=np.int64), n)
        run = np.repeat(np.arange(n, dtype=np.int64), groups)
        out = out[:, run] + g[None, :] * nb_lk[:, inv[run]]
        head_shift = g * heads * strides[2]
        if (head_shift % 16).any():
            raise CacheLayoutError("a run of heads shifts the cache planes by a number of "
                                   "elements that is not a multiple of 16")
        inv = inv[run]
        pow2 = _pow2_array(chunks.tokens)[run]
        blk0 = chunks.blk0()[run]
        tags = chunks.tags[run]
        tag_lo = (tags & np.uint64(0xFFFFFFFF)).astype(np.int64)
        tag_hi = (tags >> np.uint64(32)).astype(np.int64)
        rows_n = n * groups
        policies: dict[Any, _Policy] = {}
        for i, layer in enumerate(self.layers):
            policies.setdefault(_group_key(codec, layer), _Policy(_group_key(codec, layer))
                                ).positions.append(i)
        device = base.device
        dim = codec.head_dim
        tab = _tables(dim, device)
        self.blocks = _to_device(chunks.block_ids.astype(np.int32) if chunks.block_ids.size
                                 else np.zeros(1, np.int32), torch.int32, device)
        dtype_code = 2 if base.dtype == torch.float16 else 1  # fp8 caches are coded as bf16
        sqrt_d = float(torch.tensor(math.sqrt(dim), dtype=torch.float32))
        from turbowire.kernels.triton_codec import ENCODE_FIELDS

        nf = len(ENCODE_FIELDS)
        for (kspec, vspec), pol in policies.items():
            pos = pol.positions
            fields = [  # the columns of ENCODE_FIELDS, in order
                ("LN", np.array([geoms[i].k_off for i in pos])[:, None] + head_shift[None, :]),
                ("LN", np.array([geoms[i].v_off for i in pos])[:, None] + head_shift[None, :]),
                ("N", chunks.start[run]), ("N", chunks.tokens[run]), ("N", pow2), ("LN", out[pos]),
                ("N", blk0), ("N", tag_lo), ("N", tag_hi), ("L", [self.layers[i] for i in pos]),
                ("LK", nb_lk[pos] - HEADER_BYTES), ("LK", kb_lk[pos]),
                ("L", [scale_cols[i][0] for i in pos]), ("L", [scale_cols[i][1] for i in pos]),
            ]
            assert len(fields) == nf
            table = _device_rows(device, rows_n, fields, inv)
            acc = torch.zeros(2 * len(pos) * rows_n, dtype=torch.int32, device=device)
            tf = _transforms(kspec, vspec)
            lanes = cfg.lanes_for(dim, True, tf)
            bt = cfg.tile_rows_for(dim, True, tf)
            sbt = cfg.sum_rows_for(dim, tf)
            lv = max(int(pow2.max()) // sbt, 1).bit_length() - 1
            if lv > _MAX_LEVELS:
                raise GeometryError("chunk too long for the Triton chunk-mean fold")
            consts = {**_stream_consts(kspec, dim).prefixed("K"),
                      **_stream_consts(vspec, dim).prefixed("V")}
            kwargs = dict(
                D=dim, L=lanes, BT=bt, SBT=sbt, LV=lv, **consts, QMODE=cfg.qmode,
                FP8_MANUAL=interpreting(), SQRT_D=sqrt_d, S1M=_sign_mask(dim, 0),
                S2M=_sign_mask(dim, 1), NUM_WARPS=cfg.num_warps,
                SMAJOR=cfg.stream_major_for(kspec, vspec),
                **cfg.launch_options(cfg.encode_registers_for(kspec, vspec, dim)),
                enable_fp_fusion=False,
            )
            tail = (strides[0], strides[1], strides[2], _block_size_arg(layout.block_size),
                    heads, codec.preset.preset_id, codec.num_layers, dtype_code)
            kc = _kernel_cache(base)
            heads2 = 2 * heads
            n_all = len(pos) * rows_n
            self._calls.append(((n_all * heads2,),
                                (kc, staging, table, self.blocks, tab, acc) + tail + (n_all,),
                                kwargs))
            m = rows_n
            for j, i in enumerate(pos):
                self._layer_calls[i].append((
                    (m * heads2,),
                    (kc, staging, table[j * m:(j + 1) * m], self.blocks, tab,
                     acc[2 * j * m:2 * (j + 1) * m]) + tail + (m,), kwargs))
            pol.table = table
        self._policies = list(policies.values())

    @property
    def total_bytes(self) -> int:
        return int(self.written.sum())

    def launch_layer(self, i: int) -> None:
        """Encode the chunks of the plan's i-th layer (one launch) on the current stream."""
        from turbowire.kernels.triton_codec import encode_kernel

        for grid, args, kwargs in self._layer_calls[i]:
            encode_kernel[grid](*args, **kwargs)

    def launch(self) -> None:
        """Encode every layer: one launch per layer policy, on the current stream."""
        from turbowire.kernels.triton_codec import encode_kernel

        for grid, args, kwargs in self._calls:
            encode_kernel[grid](*args, **kwargs)


class DecodeLayersPlan:
    """Fused verify + decode launches for ``chunks`` in each of ``layers`` (module docstring).

    ``in_offsets[i, n]`` / ``nbytes[i, n]``: where chunk n of the i-th layer lies in ``source``
    and its size as the sender announced it. The chunks' expected tags are ``chunks.tags``
    (none checked when the chunk set has no tags). ``window``: every chunk holds
    ``window.src_heads`` heads, of which the plan writes ``window.count`` from ``src_start`` at
    the cache's head ``dst_start`` (a prefill rank of another TP size: ``DecodeItem.heads``,
    the same rows as ``DecodePlan``'s)."""

    def __init__(
        self,
        codec: Codec,
        layers: Sequence[int],
        caches: Sequence[torch.Tensor],
        layout: PagedKVLayout,
        chunks: ChunkSet,
        in_offsets: np.ndarray,
        nbytes: np.ndarray,
        source: torch.Tensor,
        config: KernelConfig | None = None,
        kv_scales: Sequence[KVScales | None] | None = None,
        layouts: Sequence[PagedKVLayout] | None = None,
        window: HeadWindow | None = None,
    ) -> None:
        cfg = config or DEFAULT_CONFIG
        self.codec = codec
        self.source = source
        self.layout = layout
        self.chunks = chunks
        self.window = window
        # the chunks' heads, and those of them written where
        self._src_heads = window.src_heads if window is not None else layout.num_heads
        head0, count, dst = ((window.src_start, window.count, window.dst_start)
                             if window is not None else (0, layout.num_heads, 0))
        if dst + count > layout.num_heads:
            raise GeometryError(f"head window {window} outside the cache's "
                                f"{layout.num_heads} heads")
        self.layers = [int(x) for x in layers]
        n_l, n = len(self.layers), len(chunks)
        self.n = n
        inn = np.asarray(in_offsets, dtype=np.int64).reshape(n_l, n)
        size = np.asarray(nbytes, dtype=np.int64).reshape(n_l, n)
        self.in_offsets, self.nbytes = inn, size
        if len(caches) != n_l:
            raise ValueError(f"{len(caches)} caches for {n_l} layers")
        base = _check_caches(codec, caches, layout, layouts)
        _check_buffer(source, "source", base.device)
        if n and (size < HEADER_BYTES).any():
            bad = int(size.reshape(-1)[int(np.argmax((size < HEADER_BYTES).reshape(-1)))])
            raise TruncatedPayloadError(
                f"payload has {bad} bytes, a chunk header alone has {HEADER_BYTES}")
        _check_offsets(source, inn, size, "source")
        chunks.check(layout)
        if n:
            bs = layout.block_size
            if bool((chunks.start % bs == 0).all()) and int(chunks.tokens.max()) <= bs:
                # each chunk starts at slot 0 of one block: disjoint iff the blocks are distinct
                slots = chunks.block_ids[chunks.blk0() + chunks.start // bs]
            else:
                slots = chunks.slots(bs)
            if np.unique(slots).size != slots.size:
                raise BlockIndexError("two chunks write the same cache slots")
            if len({c.data_ptr() for c in caches}) != n_l:
                raise BlockIndexError("two layers of one plan write the same cache")
        scale_cols = _scale_columns(base, n_l, kv_scales)
        geoms = [_cache_geom(c, layout, base) for c in caches]
        if any(g.strides != geoms[0].strides for g in geoms):
            raise CacheLayoutError("all layers of one call must share cache strides")
        strides = geoms[0].strides
        shift = (dst - head0) * strides[2]  # the planes shifted so head h lands at dst + h - head0
        if shift % 16:
            raise CacheLayoutError(f"a head window shifts the cache planes by {shift} elements; "
                                   "the kernels need multiples of 16")
        self._ranges: dict[tuple[int, int], list[tuple[Any, ...]]] = {}
        self._launched: set[int] = set()  # range starts launched (their flag may be set)
        self.status: torch.Tensor | None = None
        self.fails: torch.Tensor | None = None
        if n == 0:
            return
        device = base.device
        dim = codec.head_dim
        from turbowire.kernels.triton_codec import DECODE_FIELDS

        nf = len(DECODE_FIELDS)
        blk0 = chunks.blk0()
        tag_lo = (chunks.tags & np.uint64(0xFFFFFFFF)).astype(np.int64)
        tag_hi = (chunks.tags >> np.uint64(32)).astype(np.int64)
        nb_lk, kb_lk = _size_table(codec, self.layers, self._src_heads, chunks)
        _, inv = chunks.size_keys()
        body_lk = nb_lk - HEADER_BYTES

        def fields(sel: Sequence[int]) -> list[tuple[str, Any]]:
            sel = list(sel)
            return [  # the columns of DECODE_FIELDS, in order
                ("L", [geoms[i].k_off + shift for i in sel]),
                ("L", [geoms[i].v_off + shift for i in sel]),
                ("N", chunks.start), ("N", chunks.tokens), ("LN", inn[sel]), ("LN", size[sel]),
                ("N", blk0), ("N", tag_lo), ("N", tag_hi), ("N", np.full(n, int(chunks.has_tag))),
                ("L", [self.layers[i] for i in sel]), ("LK", body_lk[sel]), ("LK", kb_lk[sel]),
                # status: chunk c of the plan's i-th layer reports at i * n + c
                ("LI", [i * n for i in sel]), ("L", [scale_cols[i][0] for i in sel]),
                ("L", [scale_cols[i][1] for i in sel]),
                ("N", np.full(n, head0)), ("N", np.full(n, count)),  # the heads written
            ]

        assert len(fields([0])) == nf
        self.blocks = _to_device(chunks.block_ids.astype(np.int32) if chunks.block_ids.size
                                 else np.zeros(1, np.int32), torch.int32, device)
        self.status = torch.zeros(n_l * n, dtype=torch.int32, device=device)
        self._acc = torch.zeros(2 * n_l * n, dtype=torch.int32, device=device)
        # one flag per layer range start, 16 bytes apart (aligned kernel arguments)
        self.fails = torch.zeros(4 * n_l, dtype=torch.int32, device=device)
        self._tab = _tables(dim, device)
        self._base = base
        self._strides = strides
        self._cfg = cfg
        self._max_tokens = int(chunks.tokens.max())
        policies: dict[Any, _Policy] = {}
        for i, layer in enumerate(self.layers):
            policies.setdefault(_group_key(codec, layer), _Policy(_group_key(codec, layer))
                                ).positions.append(i)
        self._policy_of: list[tuple[_Policy, int]] = [None] * n_l  # type: ignore[list-item]
        for pol in policies.values():
            # each policy's table holds its layers, in plan order
            pol.table = _device_rows(device, n, fields(pol.positions), inv)
            for j, i in enumerate(pol.positions):
                self._policy_of[i] = (pol, j)
        self._policies = list(policies.values())

    def _calls_for(self, lo: int, hi: int) -> list[tuple[Any, ...]]:
        calls = self._ranges.get((lo, hi))
        if calls is not None:
            return calls
        if not 0 <= lo < hi <= len(self.layers):
            raise ValueError(f"layer range {lo}..{hi} outside the plan's {len(self.layers)}")
        n = self.n
        cfg = self._cfg
        dim = self.codec.head_dim
        lay = self.layout
        assert self.fails is not None and self.status is not None
        fail = self.fails[4 * lo:4 * lo + 1]
        calls = []
        for pol in self._policies:
            js = [j for j, i in enumerate(pol.positions) if lo <= i < hi]
            if not js:
                continue
            a, b = js[0], js[-1] + 1  # the policy's layers in [lo, hi) are contiguous in its table
            assert pol.table is not None
            kspec, vspec = pol.key
            calls += _decode_calls(
                cfg, kspec, vspec, dim, (b - a) * n, self._max_tokens, _kernel_cache(self._base),
                self.source, pol.table[a * n:b * n], self.blocks, self._tab, self.status, self._acc,
                fail,
                self._strides, lay.block_size, self._src_heads, self.codec.preset.preset_id,
                self.codec.num_layers)
        self._ranges[(lo, hi)] = calls
        return calls

    def launch(self, lo: int = 0, hi: int | None = None) -> None:
        """Verify and decode the chunks of the plan's layers lo..hi-1 on the current stream (one
        launch per layer policy); a chunk that fails verification is not written, the others
        are, and the range's flag counts the refusals."""
        if self.fails is None:
            return
        hi = len(self.layers) if hi is None else hi
        calls = self._calls_for(lo, hi)
        if lo in self._launched:  # a range starting here ran before: clear its flag
            self.fails[4 * lo:4 * lo + 1].zero_()
        self._launched.add(lo)
        for kernel, grid, args, kwargs in calls:
            kernel[grid](*args, **kwargs)

    def kernel_keys(self, lo: int = 0, hi: int | None = None) -> set[Any]:
        """What selects the compiled kernels a ``launch(lo, hi)`` uses (cache dtype, strides,
        launch shape, the layer policies of the range): a caller that captures launches into a
        CUDA graph captures only kernels it has launched (compiled) before."""
        hi = len(self.layers) if hi is None else hi
        if self.fails is None:
            return set()
        base = (self._base.dtype, self._strides, self._cfg, self.layout.block_size,
                self._src_heads)
        return {(*base, pol.key) for pol in self._policies
                if any(lo <= i < hi for i in pol.positions)}

    def flag(self, lo: int = 0) -> torch.Tensor | None:
        """The device flag of the range launched from ``lo`` (one int32, nonzero once a chunk of
        the range was refused): ``launch`` then a non-blocking copy of this to pinned memory
        reads the verdict without a host synchronisation (the connector's CUDA coder)."""
        return None if self.fails is None else self.fails[4 * lo:4 * lo + 1]

    def check(self, lo: int = 0, hi: int | None = None, flag: int | None = None) -> None:
        """After ``launch(lo, hi)``: the range's flag (``flag``: its value, already read back;
        None: read it now, the one host synchronisation); raises the reference's exception for
        the first chunk of the range that was refused."""
        if self.fails is None or self.status is None:
            return
        hi = len(self.layers) if hi is None else hi
        if (int(self.fails[4 * lo]) if flag is None else int(flag)) == 0:
            return
        n = self.n
        st = self.status[lo * n:hi * n].cpu()
        i = int(torch.nonzero(st).reshape(-1)[0])
        li, ci = lo + i // n, i % n
        ch = self.chunks
        tag = int(ch.tags[ci]) if ch.has_tag else None
        item = DecodeItem(ch.block_ids[ch.offsets[ch.req[ci]]:ch.offsets[ch.req[ci] + 1]].tolist(),
                          int(ch.start[ci]), int(ch.tokens[ci]), int(self.in_offsets[li, ci]),
                          int(self.nbytes[li, ci]), tag, self.window)
        _raise_like_reference(self.codec, self.layers[li], item, self.layout, self.source,
                              int(st[i]))
