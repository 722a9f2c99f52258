"""Where vLLM's CPU attention really keeps a token's K and V (verified at start, not assumed).

vLLM CPU_ATTN allocates a layer's cache as ``[num_blocks, H, block_size, 2*D]`` but does not store
K|V per token in the last dim: ``cpu_attn.py`` views each (block, head) as ``[2*block_size, D]``
and hands the first half to its kernels as the key cache and the second half as the value cache,
and the ``vec`` ISA kernel then writes keys *transposed* (``[D, block_size]``, tokens contiguous)
and values token-major (``[block_size, D]``). Reading "token t" as row t of ``[block_size, 2*D]``
therefore mixes keys, values and other tokens: whole blocks still round-trip (every byte is
copied) but a partial last block or a decode-side prefix hit does not.

:func:`cpu_kv_layout` returns a :class:`turbowire.kernels.PagedKVLayout` whose K/V views match
the real memory. It does not trust a table: at start it writes known keys and values with vLLM's
own ``cpu_attn_reshape_and_cache`` op into a scratch cache and keeps the candidate mapping that
reads them back exactly; if none does, the engine refuses to start instead of corrupting KV.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

from turbowire.kernels import PagedKVLayout

logger = logging.getLogger(__name__)


class CpuCacheLayoutError(RuntimeError):
    """vLLM's CPU attention stores KV in a way this connector does not recognise."""


ViewFn = Callable[[torch.Tensor, int, int, int, int], tuple[torch.Tensor, torch.Tensor]]


def _split_kv_transposed_k(kv: torch.Tensor, nb: int, heads: int, bs: int, d: int):
    """Per (block, head): K as [D, bs] (token-contiguous), then V as [bs, D] (``vec`` ISA)."""
    s0, s1, s2, s3 = kv.stride()
    if s3 != 1 or s2 != 2 * d or s1 != bs * 2 * d:
        raise CpuCacheLayoutError(f"CPU KV cache strides {kv.stride()} are not block-contiguous")
    off = kv.storage_offset()
    k = kv.as_strided((nb, bs, heads, d), (s0, 1, s1, bs), off)
    v = kv.as_strided((nb, bs, heads, d), (s0, d, s1, 1), off + bs * d)
    return k, v


def _split_kv_token_major(kv: torch.Tensor, nb: int, heads: int, bs: int, d: int):
    """Per (block, head): K as [bs, D] then V as [bs, D] (both token-major)."""
    s0, s1, s2, s3 = kv.stride()
    if s3 != 1 or s2 != 2 * d or s1 != bs * 2 * d:
        raise CpuCacheLayoutError(f"CPU KV cache strides {kv.stride()} are not block-contiguous")
    off = kv.storage_offset()
    k = kv.as_strided((nb, bs, heads, d), (s0, d, s1, 1), off)
    v = kv.as_strided((nb, bs, heads, d), (s0, d, s1, 1), off + bs * d)
    return k, v


def _packed_per_token(kv: torch.Tensor, nb: int, heads: int, bs: int, d: int):
    """K|V side by side in the last dim of each token (what the shape suggests)."""
    return kv[..., :d].permute(0, 2, 1, 3), kv[..., d:].permute(0, 2, 1, 3)


CANDIDATES: dict[str, ViewFn] = {
    "kT_v": _split_kv_transposed_k,
    "k_v": _split_kv_token_major,
    "packed": _packed_per_token,
}


@dataclasses.dataclass(frozen=True)
class CpuAttnKVLayout(PagedKVLayout):
    """PagedKVLayout with the K/V views of vLLM's CPU attention memory order."""

    mapping: str = "kT_v"

    def views(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return CANDIDATES[self.mapping](
            kv_cache, kv_cache.shape[0], self.num_heads, self.block_size, self.head_dim
        )


def _reshape_and_cache_fn(dtype: torch.dtype, block_size: int, head_dim: int):
    """vLLM's own cache-write op for this engine's CPU attention ISA, or None off CPU builds."""
    try:
        from vllm import _custom_ops as ops
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except ImportError:
        return None, None
    if not hasattr(ops, "cpu_attn_reshape_and_cache"):
        return None, None
    isa = _get_attn_isa(dtype, block_size, head_dim)

    def write(key, value, cache, slots):
        nb, heads, bs, _ = cache.shape
        kv = cache.view(nb, heads, bs * 2, head_dim)
        key_cache, value_cache = kv.chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa)

    return write, isa


def detect_mapping(dtype: torch.dtype, heads: int, block_size: int, head_dim: int) -> tuple[str, str]:
    """Probe vLLM's cache write on a scratch cache; return (mapping name, isa)."""
    write, isa = _reshape_and_cache_fn(dtype, block_size, head_dim)
    if write is None:
        raise CpuCacheLayoutError("vLLM's CPU attention ops are not available in this process")
    nb = 3
    scratch = torch.zeros(nb, heads, block_size, 2 * head_dim, dtype=dtype)
    tokens = block_size + 5  # a full block and a partial one
    gen = torch.Generator().manual_seed(1234)
    # small integers are exact in bf16/fp16, so a read-back compares bit for bit
    key = torch.randint(-60, 60, (tokens, heads, head_dim), generator=gen).to(dtype)
    value = torch.randint(-60, 60, (tokens, heads, head_dim), generator=gen).to(dtype)
    blocks = [2, 0]
    slots = torch.tensor(
        [blocks[t // block_size] * block_size + t % block_size for t in range(tokens)],
        dtype=torch.long,
    )
    write(key, value, scratch, slots)
    for name, fn in CANDIDATES.items():
        try:
            k_view, v_view = fn(scratch, nb, heads, block_size, head_dim)
        except CpuCacheLayoutError:
            continue
        b = torch.tensor([blocks[t // block_size] for t in range(tokens)])
        s = torch.arange(tokens) % block_size
        if torch.equal(k_view[b, s], key) and torch.equal(v_view[b, s], value):
            return name, isa
    raise CpuCacheLayoutError(
        f"vLLM CPU attention (isa {isa}) stores KV in a layout turbowire does not know; "
        "transfers would corrupt the cache, so the connector refuses to start"
    )


def cpu_kv_layout(kv_cache: torch.Tensor, head_dim: int) -> PagedKVLayout:
    """The layout of one CPU cache tensor, with views matching where vLLM writes tokens."""
    base = PagedKVLayout.from_cache(kv_cache, head_dim=head_dim)
    mapping, isa = _detect_cached(kv_cache.dtype, base.num_heads, base.block_size, head_dim)
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(PagedKVLayout)}
    return CpuAttnKVLayout(**fields, mapping=mapping)


_DETECTED: dict[tuple, tuple[str, str]] = {}


def _detect_cached(dtype: torch.dtype, heads: int, bs: int, d: int) -> tuple[str, str]:
    key = (dtype, heads, bs, d)
    if key not in _DETECTED:
        _DETECTED[key] = detect_mapping(dtype, heads, bs, d)
        logger.info(
            "vLLM CPU attention (isa %s) keeps KV as %s; turbowire gathers/scatters accordingly",
            _DETECTED[key][1], _DETECTED[key][0],
        )
    return _DETECTED[key]


# ---- a contiguous detour so the codec's fast paths apply ----------------------------------
_SCRATCH = threading.local()


def _scratch(numel: int, like: torch.Tensor) -> torch.Tensor:
    """A per-thread scratch buffer reused across calls: a fresh allocation per layer paid its
    page faults on every step (about as much time as the codec itself)."""
    buf = getattr(_SCRATCH, "buf", None)
    if buf is None or buf.numel() < numel or buf.dtype != like.dtype or buf.device != like.device:
        buf = torch.empty(max(numel, 1), dtype=like.dtype, device=like.device)
        _SCRATCH.buf = buf
    return buf[:numel]


def _distinct_tables(items: list) -> tuple[list[list[int]], list[int]]:
    """The distinct block tables of the items (a request's chunks all carry the request's whole
    table: copying it per chunk made the scratch quadratic in the request length) and, per item,
    the index of its table."""
    seen: dict[int, tuple[Any, int]] = {}
    tables: list[list[int]] = []
    which: list[int] = []
    for it in items:
        hit = seen.get(id(it.block_ids))
        if hit is None or hit[0] is not it.block_ids:
            ids = it.block_ids
            ids = ids.reshape(-1).tolist() if isinstance(ids, torch.Tensor) else ids
            hit = seen[id(it.block_ids)] = (it.block_ids, len(tables))
            tables.append([int(b) for b in ids])
        which.append(hit[1])
    return tables, which


def _packed_copy(
    cache: torch.Tensor, layout: CpuAttnKVLayout, tables: list[list[int]], needed: list[set[int]]
) -> tuple[torch.Tensor, PagedKVLayout, list[list[int]]]:
    """Copy the needed blocks into a scratch cache with K|V per token (unit-stride head_dim),
    the layout the codec kernels are fastest on. Table r maps onto its own segment."""
    total = sum(len(t) for t in tables)
    h, bs, d = layout.num_heads, layout.block_size, layout.head_dim
    scratch = _scratch(total * h * bs * 2 * d, cache).view(total, h, bs, 2 * d)
    k_view, v_view = layout.views(cache)
    mapped: list[list[int]] = []
    src: list[int] = []
    dst: list[int] = []
    base = 0
    for table, want in zip(tables, needed, strict=True):
        mapped.append(list(range(base, base + len(table))))
        for i in sorted(want):
            src.append(table[i])
            dst.append(base + i)
        base += len(table)
    if src:
        s = torch.tensor(src, dtype=torch.long, device=cache.device)
        t = torch.tensor(dst, dtype=torch.long, device=cache.device)
        scratch[t, :, :, :d] = k_view[s].permute(0, 2, 1, 3)
        scratch[t, :, :, d:] = v_view[s].permute(0, 2, 1, 3)
    return scratch, PagedKVLayout.from_cache(scratch, head_dim=d), mapped


def encode_via_packed(codec, layer: int, cache: torch.Tensor, layout: CpuAttnKVLayout,
                      items: list, staging: torch.Tensor) -> list[int]:
    """``encode_into`` for a CPU attention cache, through a contiguous scratch copy."""
    from turbowire.kernels import EncodeItem, encode_into

    bs = layout.block_size
    tables, which = _distinct_tables(items)
    needed: list[set[int]] = [set() for _ in tables]
    for it, r in zip(items, which, strict=True):
        if it.num_tokens <= 0 or it.token_start < 0:
            raise IndexError(f"bad token range start={it.token_start} count={it.num_tokens}")
        last = (it.token_start + it.num_tokens - 1) // bs
        if last >= len(tables[r]):
            raise IndexError(f"block table of {len(tables[r])} blocks does not cover block {last}")
        needed[r].update(range(it.token_start // bs, last + 1))
    scratch, slayout, mapped = _packed_copy(cache, layout, tables, needed)
    moved = [
        EncodeItem(mapped[r], it.token_start, it.num_tokens, it.out_offset, it.tag)
        for it, r in zip(items, which, strict=True)
    ]
    return encode_into(codec, layer, scratch, slayout, moved, staging)


def decode_via_packed(codec, layer: int, cache: torch.Tensor, layout: CpuAttnKVLayout,
                      items: list, source: torch.Tensor) -> None:
    """``decode_into`` for a CPU attention cache: verify+decode every item into a scratch copy,
    then write only the decoded tokens into the real cache (one indexed copy for all items)."""
    from turbowire.kernels import DecodeItem, decode_into

    tables, which = _distinct_tables(items)
    for table in tables:  # bounds-check the real destination before anything is decoded
        layout.token_index(table, 0, len(table) * layout.block_size)
    scratch, slayout, mapped = _packed_copy(cache, layout, tables, [set() for _ in tables])
    moved = [
        DecodeItem(mapped[r], it.token_start, it.num_tokens, it.in_offset, it.nbytes,
                   it.expected_tag)
        for it, r in zip(items, which, strict=True)
    ]
    decode_into(codec, layer, scratch, slayout, moved, source)
    if not items:
        return
    bs = layout.block_size
    tok = torch.cat([torch.arange(it.token_start, it.token_start + it.num_tokens) for it in items])
    blk = tok // bs
    slot = tok % bs
    owner = torch.repeat_interleave(
        torch.tensor(which), torch.tensor([it.num_tokens for it in items])
    )
    dst_tables = torch.cat([torch.tensor(t, dtype=torch.long) for t in tables])
    src_tables = torch.cat([torch.tensor(m, dtype=torch.long) for m in mapped])
    firsts = torch.tensor([0] + [len(t) for t in tables[:-1]]).cumsum(0)
    row = firsts[owner] + blk
    ks, vs = slayout.views(scratch)
    kc, vc = layout.views(cache)
    kc[dst_tables[row], slot] = ks[src_tables[row], slot]
    vc[dst_tables[row], slot] = vs[src_tables[row], slot]
