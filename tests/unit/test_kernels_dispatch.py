"""CPU reference path of the paged dispatch: layouts, guard blocks intact, bounds checks."""

from __future__ import annotations

import pytest
import torch

from turbowire.codec import ChecksumError, Codec
from turbowire.kernels import (
    BlockIndexError,
    CacheLayoutError,
    DecodeItem,
    EncodeItem,
    PagedKVLayout,
    decode_into,
    encode_into,
)

GUARD = 7.0


def caches(kind: str, nb: int = 12, bs: int = 32, heads: int = 2, dim: int = 64):
    g = torch.Generator().manual_seed(3)
    if kind == "cpu_packed":
        src = torch.randn(nb, heads, bs, 2 * dim, generator=g)
    elif kind == "LBNHC":
        src = torch.randn(2, nb, bs, heads, dim, generator=g)
    else:  # LBHNC memory seen through the logical LBNHC shape
        src = torch.randn(2, nb, heads, bs, dim, generator=g).permute(0, 1, 3, 2, 4)
    src = src.to(torch.bfloat16)
    dst = torch.full_like(src, GUARD)
    return src, dst


@pytest.mark.parametrize("kind", ["cpu_packed", "LBNHC", "LBHNC"])
@pytest.mark.parametrize("preset", ["raw", "tq4"])
def test_encode_decode_touches_only_target_slots(kind: str, preset: str) -> None:
    src, dst = caches(kind)
    layout = PagedKVLayout.from_cache(src)
    assert layout.block_size == 32 and layout.num_heads == 2 and layout.head_dim == 64
    codec = Codec(preset, 64, 2, chunk_tokens=64)
    src_blocks, dst_blocks = [4, 9, 1], [2, 6, 11]
    tokens = 70  # partial last block: 70 = 32 + 32 + 6
    staging = torch.zeros(1 << 20, dtype=torch.uint8)
    items = [EncodeItem(src_blocks, 0, 64, 0, tag=5), EncodeItem(src_blocks, 64, 6, 65536, tag=5)]
    written = encode_into(codec, 1, src, layout, items, staging)
    assert written == [codec.encoded_nbytes(1, 64, 2, 0), codec.encoded_nbytes(1, 6, 2, 64)]
    decode_into(codec, 1, dst, layout, [
        DecodeItem(dst_blocks, 0, 64, 0, written[0], 5),
        DecodeItem(dst_blocks, 64, 6, 65536, written[1], 5),
    ], staging)
    k_src, v_src = layout.gather(src, src_blocks, 0, tokens)
    k_dst, v_dst = layout.gather(dst, dst_blocks, 0, tokens)
    if preset == "raw":
        assert torch.equal(k_src, k_dst) and torch.equal(v_src, v_dst)
    else:
        err = (k_dst.float() - k_src.float()).pow(2).sum() / k_src.float().pow(2).sum()
        assert err < 0.02
    # every other slot still holds the guard pattern
    kd, vd = layout.views(dst)
    touched = torch.zeros(layout.num_blocks, layout.block_size, dtype=torch.bool)
    for t in range(tokens):
        touched[dst_blocks[t // 32], t % 32] = True
    assert bool((kd[~touched] == GUARD).all()) and bool((vd[~touched] == GUARD).all())


def test_remote_indices_are_bounds_checked() -> None:
    src, dst = caches("cpu_packed")
    layout = PagedKVLayout.from_cache(src)
    codec = Codec("raw", 64, 1)
    staging = torch.zeros(1 << 16, dtype=torch.uint8)
    with pytest.raises(BlockIndexError, match="block ids"):
        encode_into(codec, 0, src, layout, [EncodeItem([0, 99], 0, 40, 0)], staging)
    with pytest.raises(BlockIndexError, match="need 2 blocks"):
        encode_into(codec, 0, src, layout, [EncodeItem([0], 0, 40, 0)], staging)
    with pytest.raises(BlockIndexError, match="repeated"):
        encode_into(codec, 0, src, layout, [EncodeItem([3, 3], 0, 40, 0)], staging)
    with pytest.raises(BlockIndexError, match="outside"):
        encode_into(codec, 0, src, layout, [EncodeItem([0], 0, 8, 65530)], staging)
    n = encode_into(codec, 0, src, layout, [EncodeItem([0], 0, 8, 0)], staging)[0]
    with pytest.raises(BlockIndexError, match="outside"):
        decode_into(codec, 0, dst, layout, [DecodeItem([0], 0, 8, 65530, n)], staging)
    with pytest.raises(BlockIndexError, match="block ids"):
        # -2: out of range (-1 is NO_BLOCK, tests/unit/test_kernels_no_block.py)
        decode_into(codec, 0, dst, layout, [DecodeItem([-2], 0, 8, 0, n)], staging)
    assert bool((dst == GUARD).all())


def test_a_corrupt_chunk_writes_nothing() -> None:
    src, dst = caches("cpu_packed")
    layout = PagedKVLayout.from_cache(src)
    codec = Codec("tq4", 64, 1)
    staging = torch.zeros(1 << 16, dtype=torch.uint8)
    a, b = encode_into(codec, 0, src, layout,
                       [EncodeItem([0], 0, 32, 0), EncodeItem([1], 0, 32, 32768)], staging)
    staging[32768 + 200] ^= 0xFF
    with pytest.raises(ChecksumError):
        decode_into(codec, 0, dst, layout,
                    [DecodeItem([2], 0, 32, 0, a), DecodeItem([3], 0, 32, 32768, b)], staging)
    assert bool((dst == GUARD).all())


def test_unrecognised_caches_are_refused() -> None:
    with pytest.raises(CacheLayoutError):
        PagedKVLayout.from_cache(torch.zeros(3, 4, 5))
    with pytest.raises(CacheLayoutError):
        PagedKVLayout.from_cache(torch.zeros(3, 4, 5, 6, 7))
    with pytest.raises(CacheLayoutError):
        PagedKVLayout.from_cache(torch.zeros(4, 2, 32, 127))
