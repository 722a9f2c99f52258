"""Where vLLM's CPU attention really keeps a token's K and V, learned from vLLM's own write op.

vLLM CPU_ATTN allocates a layer's cache as ``[num_blocks, H, block_size, 2*D]`` but its kernels
do not store K|V per token in the last dim. ``cpu_attn.py`` views each (block, head) as
``[2*block_size, D]``, hands the first half to ``cpu_attn_reshape_and_cache`` as the key cache
and the second as the value cache, and each attention ISA packs them its own way: ``vec`` and
``vec16`` keep keys transposed (``[D, block_size]``) and values token-major; ``amx`` packs keys
as dim pairs in 16-token groups and values as token pairs in 16-dim groups (VNNI pairs for AMX
tiles). A table of known layouts would go stale with the next vLLM release, so nothing here is
assumed: :func:`probe_layout` writes tokens with distinct values through vLLM's op into a scratch
cache, reads back where every (slot, head, dim) landed, and keeps that placement as an
:class:`ElementMap` per K and V. Served three ways, fastest first:

- ``strided``: the placement is an arithmetic progression in slot, head and dim; strided K/V
  views exist and the C codec walks them (``vec``, ``vec16``).
- ``tiled``: offset = head term + slot term + dim term, but slot and dim terms are tables; the C
  codec reads them through per-slot and per-dim offset tables (``amx``).
- ``generic``: anything else that is still a one-to-one placement inside a block; the reference
  codec gathers/scatters through the full probed table (slower, logged once as a warning).

Only a placement the probe cannot reconstruct (an op that loses or duplicates values) refuses
the engine, since transfers would then corrupt the cache.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from turbowire.kernels.paged import CacheLayoutError, PagedKVLayout

logger = logging.getLogger(__name__)

WriteFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
"""write(key [T, H, D], value [T, H, D], cache [blocks, H, bs, 2D], slot_mapping [T])."""

# every vLLM CPU attention ISA name (vllm/v1/attention/backends/cpu_attn.py, _get_attn_isa);
# a vLLM build accepts the ones compiled for its architecture
VLLM_CPU_ATTN_ISAS = ("amx", "vec", "vec16", "neon", "rvv", "vxe", "vsx")


class CpuCacheLayoutError(CacheLayoutError):
    """vLLM's CPU attention stores KV in a way that cannot be read back reliably."""


@dataclass(frozen=True)
class ElementMap:
    """Where element (slot, head, dim) of one block lives, in elements from the block's start.

    ``offsets`` is the full probed table ``[block_size, H, D]``; ``slot_offsets`` /
    ``dim_offsets`` / ``head_stride`` are its factors when it is separable
    (``offsets[s, h, d] == base + h * head_stride + slot_offsets[s] + dim_offsets[d]``)."""

    offsets: torch.Tensor = field(compare=False, repr=False)
    base: int | None
    head_stride: int | None
    slot_offsets: tuple[int, ...] | None
    dim_offsets: tuple[int, ...] | None

    @classmethod
    def from_offsets(cls, offsets: torch.Tensor) -> "ElementMap":
        rel = offsets.to(torch.int64)
        base = rel[0, 0, 0]
        heads = rel[0, :, 0] - base
        slots = rel[:, 0, 0] - base
        dims = rel[0, 0, :] - base
        rebuilt = base + heads[None, :, None] + slots[:, None, None] + dims[None, None, :]
        step = int(heads[1]) if heads.numel() > 1 else 0
        linear_heads = torch.equal(heads, torch.arange(heads.numel()) * step)
        if not (torch.equal(rebuilt, rel) and linear_heads):
            return cls(rel, None, None, None, None)
        return cls(rel, int(base), step, tuple(slots.tolist()), tuple(dims.tolist()))

    @property
    def separable(self) -> bool:
        return self.slot_offsets is not None

    def strides(self) -> tuple[int, int] | None:
        """(slot stride, dim stride) when both terms are arithmetic progressions."""
        if self.slot_offsets is None or self.dim_offsets is None:
            return None
        out = []
        for table in (self.slot_offsets, self.dim_offsets):
            step = table[1] - table[0] if len(table) > 1 else 1
            if step <= 0 or any(b - a != step for a, b in zip(table, table[1:])):
                return None
            out.append(step)
        return out[0], out[1]

    def describe(self) -> str:
        st = self.strides()
        if st is not None:
            return f"slot stride {st[0]}, dim stride {st[1]}"
        if self.separable:
            return "slot and dim offset tables"
        return "a non-separable placement"


@dataclass(frozen=True)
class CpuAttnKVLayout(PagedKVLayout):
    """A vLLM CPU attention cache ``[blocks, H, bs, 2D]`` with K/V placed as vLLM's op does."""

    isa: str = ""
    k_map: ElementMap | None = field(default=None, compare=False, repr=False)
    v_map: ElementMap | None = field(default=None, compare=False, repr=False)

    @property
    def maps(self) -> tuple[ElementMap, ElementMap]:
        if self.k_map is None or self.v_map is None:
            raise CpuCacheLayoutError("CpuAttnKVLayout built without probed element maps")
        return self.k_map, self.v_map

    @property
    def path(self) -> str:
        """How it is served: "strided", "tiled" or "generic" (see the module docstring)."""
        k, v = self.maps
        if k.strides() is not None and v.strides() is not None:
            return "strided"
        return "tiled" if k.separable and v.separable else "generic"

    def describe(self) -> str:
        k, v = self.maps
        return f"{self.path} (keys: {k.describe()}; values: {v.describe()})"

    def block_stride(self, kv_cache: torch.Tensor) -> int:
        if tuple(kv_cache.shape[1:]) != (self.num_heads, self.block_size, 2 * self.head_dim):
            raise CacheLayoutError(
                f"cache {tuple(kv_cache.shape)} is not [blocks, {self.num_heads}, "
                f"{self.block_size}, {2 * self.head_dim}]"
            )
        s0, s1, s2, s3 = kv_cache.stride()
        d = self.head_dim
        if s3 != 1 or s2 != 2 * d or s1 != self.block_size * 2 * d:
            raise CpuCacheLayoutError(
                f"CPU KV cache strides {kv_cache.stride()} are not block-contiguous"
            )
        return s0

    def views(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V as [num_blocks, block_size, H, D] strided views ("strided" layouts only)."""
        s0 = self.block_stride(kv_cache)
        out = []
        for m in self.maps:
            st = m.strides()
            if st is None:
                raise CacheLayoutError(
                    f"vLLM CPU attention (isa {self.isa}) places KV {self.describe()}: no strided "
                    "view exists; use gather/scatter or the C codec's offset tables"
                )
            out.append(kv_cache.as_strided(
                (kv_cache.shape[0], self.block_size, self.num_heads, self.head_dim),
                (s0, st[0], m.head_stride, st[1]),
                kv_cache.storage_offset() + m.base,
            ))
        return out[0], out[1]

    def c_tables(self) -> tuple[tuple[int, list[int], np.ndarray | None, np.ndarray | None], ...]:
        """Per K and V: (base offset in elements, [block, slot, head, dim] strides, slot table or
        None, dim table or None) for the C codec; a table replaces its stride. "generic"
        placements have no such form (CacheLayoutError)."""
        per_block = self.num_heads * self.block_size * 2 * self.head_dim
        out = []
        for m in self.maps:
            if not m.separable:
                raise CacheLayoutError("a non-separable placement has no C codec form")
            assert m.slot_offsets is not None and m.dim_offsets is not None
            lo = int(m.base or 0) + min(m.slot_offsets) + min(m.dim_offsets)
            hi = (int(m.base or 0) + (self.num_heads - 1) * int(m.head_stride or 0)
                  + max(m.slot_offsets) + max(m.dim_offsets))
            if lo < 0 or hi >= per_block or len(m.slot_offsets) != self.block_size or len(
                    m.dim_offsets) != self.head_dim:
                raise CacheLayoutError("element map reaches outside its block")  # C trusts it
            st = m.strides()
            slot_tab = None if st else np.asarray(m.slot_offsets, dtype=np.int64)
            dim_tab = None if st else np.asarray(m.dim_offsets, dtype=np.int64)
            strides = [0, st[0] if st else 0, int(m.head_stride or 0), st[1] if st else 0]
            out.append((int(m.base or 0), strides, slot_tab, dim_tab))
        return tuple(out)

    def _flat_index(
        self, kv_cache: torch.Tensor, block_ids: Sequence[int] | torch.Tensor, token_start: int,
        num_tokens: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The cache as [blocks, elements per block] and the tokens' (block, slot) indices,
        bounds-checked (ids may come from a peer)."""
        s0 = self.block_stride(kv_cache)
        blocks, slots = self.token_index(block_ids, token_start, num_tokens, kv_cache.device)
        per_block = self.num_heads * self.block_size * 2 * self.head_dim
        flat = kv_cache.as_strided(
            (kv_cache.shape[0], per_block), (s0, 1), kv_cache.storage_offset()
        )
        return flat, blocks, slots

    def gather(
        self, kv_cache: torch.Tensor, block_ids: Sequence[int] | torch.Tensor, token_start: int,
        num_tokens: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        flat, blocks, slots = self._flat_index(kv_cache, block_ids, token_start, num_tokens)
        rows = blocks[:, None, None]
        return tuple(  # type: ignore[return-value]
            flat[rows, m.offsets.to(kv_cache.device)[slots]] for m in self.maps
        )

    def scatter(
        self, kv_cache: torch.Tensor, block_ids: Sequence[int] | torch.Tensor, token_start: int,
        k: torch.Tensor, v: torch.Tensor,
    ) -> None:
        if k.shape[1:] != (self.num_heads, self.head_dim) or v.shape != k.shape:
            raise CacheLayoutError(
                f"scatter of {tuple(k.shape)}/{tuple(v.shape)} into a cache of "
                f"{self.num_heads} heads x {self.head_dim}"
            )
        flat, blocks, slots = self._flat_index(kv_cache, block_ids, token_start, k.shape[0])
        rows = blocks[:, None, None]
        for m, x in zip(self.maps, (k, v), strict=True):
            flat[rows, m.offsets.to(kv_cache.device)[slots]] = x.to(kv_cache.dtype)

    def for_cache(self, kv_cache: torch.Tensor) -> "CpuAttnKVLayout":
        """This placement for another cache of the same geometry (its own block count)."""
        base = PagedKVLayout.from_cache(kv_cache, head_dim=self.head_dim)
        if (base.num_heads, base.block_size) != (self.num_heads, self.block_size):
            raise CacheLayoutError(
                f"cache {tuple(kv_cache.shape)} does not have the probed geometry "
                f"({self.num_heads} heads, block size {self.block_size})"
            )
        return dataclasses.replace(self, num_blocks=base.num_blocks)


# ---- the probe --------------------------------------------------------------------------------
_DIGIT = 250  # small integers are exact in bf16 (up to 256) and fp16: a read-back is bit exact


def vllm_write_op(dtype: torch.dtype, block_size: int, head_dim: int,
                  isa: str | None = None) -> tuple[WriteFn, str]:
    """vLLM's own cache-write op for ``isa`` (default: the ISA vLLM picks for this geometry)."""
    try:
        from vllm import _custom_ops as ops
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except ImportError as exc:
        raise CpuCacheLayoutError(
            f"vLLM's CPU attention ops are not available in this process ({exc})"
        ) from exc
    if not hasattr(ops, "cpu_attn_reshape_and_cache"):
        raise CpuCacheLayoutError("this vLLM build has no cpu_attn_reshape_and_cache op")
    chosen = isa or _get_attn_isa(dtype, block_size, head_dim)

    def write(key, value, cache, slots):
        nb, heads, bs, _ = cache.shape
        key_cache, value_cache = cache.view(nb, heads, bs * 2, head_dim).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, chosen)

    return write, chosen


def probe_placement(write: WriteFn, dtype: torch.dtype, heads: int, block_size: int,
                    head_dim: int) -> tuple[ElementMap, ElementMap]:
    """Write two full blocks (block ids 2 then 0 of a 3-block scratch cache) with distinct
    values, a few base-250 digits at a time, and return where each K and V element landed."""
    nb, blocks = 3, (2, 0)
    tokens = len(blocks) * block_size
    n = tokens * heads * head_dim
    per_block = heads * block_size * 2 * head_dim
    ids = torch.arange(2 * n, dtype=torch.int64)
    passes = 1
    while _DIGIT**passes < 2 * n:
        passes += 1
    slots = torch.tensor(
        [blocks[t // block_size] * block_size + t % block_size for t in range(tokens)],
        dtype=torch.long,
    )
    found = torch.zeros(nb * per_block, dtype=torch.int64)
    written = None
    scale = 1
    for _ in range(passes):
        digit = (ids // scale) % _DIGIT + 1  # 0 marks "not written"
        cache = torch.zeros(nb, heads, block_size, 2 * head_dim, dtype=dtype)
        key = digit[:n].reshape(tokens, heads, head_dim).to(dtype)
        value = digit[n:].reshape(tokens, heads, head_dim).to(dtype)
        try:
            write(key, value, cache, slots)
        except RuntimeError as exc:  # vLLM's TORCH_CHECKs: unsupported ISA or geometry
            raise CpuCacheLayoutError(f"vLLM's cache write refused the probe: {exc}") from exc
        got = cache.reshape(-1).to(torch.float32)
        if not torch.equal(got, got.round()) or got.min() < 0 or got.max() > _DIGIT:
            raise CpuCacheLayoutError("vLLM's cache write changed the probe values")
        got = got.to(torch.int64)
        mask = got > 0
        if written is None:
            written = mask
        elif not torch.equal(written, mask):
            raise CpuCacheLayoutError("vLLM's cache write placed the probe differently per pass")
        found += (got - 1).clamp(min=0) * scale
        scale *= _DIGIT
    assert written is not None
    where = written.nonzero().squeeze(1)
    position = torch.full((2 * n,), -1, dtype=torch.int64)
    if where.numel() != 2 * n or found[where].max() >= 2 * n:
        raise CpuCacheLayoutError(
            f"vLLM's cache write stored {where.numel()} of {2 * n} probe values"
        )
    position[found[where]] = where
    if bool((position < 0).any()):
        raise CpuCacheLayoutError("vLLM's cache write lost or duplicated probe values")
    maps = []
    for part in (position[:n], position[n:]):
        pos = part.reshape(len(blocks), block_size, heads, head_dim)
        rel = [pos[i] - b * per_block for i, b in enumerate(blocks)]
        if not all(torch.equal(rel[0], r) for r in rel[1:]):
            raise CpuCacheLayoutError("vLLM's cache write places tokens differently per block")
        if int(rel[0].min()) < 0 or int(rel[0].max()) >= per_block:
            raise CpuCacheLayoutError("vLLM's cache write places tokens outside their block")
        maps.append(ElementMap.from_offsets(rel[0]))
    return maps[0], maps[1]


_PROBED: dict[tuple, CpuAttnKVLayout] = {}


def probe_layout(dtype: torch.dtype, heads: int, block_size: int, head_dim: int,
                 isa: str | None = None, write: WriteFn | None = None) -> CpuAttnKVLayout:
    """The placement of vLLM CPU attention ``isa`` for this geometry (probed once per process
    and geometry; ``write`` replaces vLLM's op, for tests of the probe itself)."""
    cacheable = write is None
    if write is None:
        write, isa = vllm_write_op(dtype, block_size, head_dim, isa)
    key = (dtype, heads, block_size, head_dim, isa)
    hit = _PROBED.get(key) if cacheable else None
    if hit is not None:
        return hit
    k_map, v_map = probe_placement(write, dtype, heads, block_size, head_dim)
    layout = CpuAttnKVLayout(
        "cpu_packed", 0, block_size, heads, head_dim, "LBHNC", isa=isa or "custom",
        k_map=k_map, v_map=v_map,
    )
    if cacheable:
        _PROBED[key] = layout
    return layout


def cpu_attn_layout(
    kv_cache: torch.Tensor, head_dim: int, isa: str | None = None
) -> CpuAttnKVLayout:
    """The layout of one vLLM CPU attention cache tensor, with vLLM's real placement."""
    base = PagedKVLayout.from_cache(kv_cache, head_dim=head_dim)
    probed = probe_layout(kv_cache.dtype, base.num_heads, base.block_size, head_dim, isa)
    return probed.for_cache(kv_cache)
