"""An MLA layer's paged cache (``LatentPages``) through the kernels' front door: rows found where
vLLM's own MLA cache write puts them, latent chunks written and read back into other blocks, a
chunk that starts inside vLLM's prefix written only from there, and nothing written for a chunk
that is refused or a block out of range."""

from __future__ import annotations

import pytest
import torch

from turbowire.codec import Codec
from turbowire.codec.errors import ChecksumError
from turbowire.codec.latent import latent_nbytes
from turbowire.kernels import (
    NO_BLOCK,
    BlockIndexError,
    CacheLayoutError,
    DecodeItem,
    EncodeItem,
    LatentPages,
    decode_into,
    decode_layers_into,
    decode_tail_into,
    encode_into,
    encode_layers_into,
)

NB, BS, L, R = 10, 16, 512, 64


def vllm_cache_write(latent: torch.Tensor, rope: torch.Tensor, cache: torch.Tensor,
                     slots: torch.Tensor) -> None:
    """vLLM CPU_MLA's own cache update (it touches nothing of its instance)."""
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl

    CPUMLAImpl.do_kv_cache_update(None, latent, rope.unsqueeze(1), cache, slots, "auto", None)


def filled_cache(seed: int, block_ids: list[int], tokens: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    cache = torch.zeros(NB, BS, L + R, dtype=torch.bfloat16)
    latent = torch.randn(tokens, L, generator=g).bfloat16()
    rope = torch.randn(tokens, R, generator=g).bfloat16()
    t = torch.arange(tokens)
    slots = torch.tensor(block_ids)[t // BS] * BS + t % BS
    vllm_cache_write(latent, rope, cache, slots)
    return cache, latent, rope


def test_rows_are_where_vllms_mla_cache_write_puts_them():
    ids = [7, 2, 5]
    cache, latent, rope = filled_cache(0, ids, 40)
    pages = LatentPages.from_cache(cache, L, R)
    got_latent, got_rope = pages.gather(cache, ids, 3, 30)
    assert torch.equal(got_latent, latent[3:33]) and torch.equal(got_rope, rope[3:33])


@pytest.mark.parametrize("preset", ["raw", "tq4"])
def test_encode_then_decode_into_other_blocks(preset):
    codec = Codec(preset, 128, 2)
    src_ids, dst_ids, tokens = [7, 2, 5], [1, 9, 4], 2 * BS + 5
    src, latent, rope = filled_cache(1, src_ids, tokens)
    pages = LatentPages.from_cache(src, L, R)
    sizes = [latent_nbytes(codec, 1, min(BS, tokens - i * BS), L, R, i * BS) for i in range(3)]
    offsets = [sum(sizes[:i]) for i in range(3)]
    staging = torch.zeros(sum(sizes), dtype=torch.uint8)
    items = [EncodeItem(src_ids, i * BS, min(BS, tokens - i * BS), offsets[i], tag=i)
             for i in range(3)]
    assert encode_into(codec, 1, src, pages, items, staging) == sizes
    dst = torch.zeros_like(src)
    decode_into(codec, 1, dst, pages, [
        DecodeItem(dst_ids, i * BS, it.num_tokens, offsets[i], sizes[i], expected_tag=i)
        for i, it in enumerate(items)], staging)
    back_latent, back_rope = pages.gather(dst, dst_ids, 0, tokens)
    assert torch.equal(back_rope, rope)
    if preset == "raw":
        assert torch.equal(back_latent, latent)
    else:
        err = (back_latent.float() - latent.float()).norm() / latent.float().norm()
        assert 0 < err < 0.12
    untouched = [b for b in range(NB) if b not in dst_ids]
    assert not dst[untouched].any()
    assert not dst[dst_ids[2], tokens - 2 * BS:].any()  # past the partial block's tokens
    # the multi-layer calls take the same path, one layer at a time
    again = torch.zeros_like(staging)
    encode_layers_into(codec, [(1, src, pages, items)], again)
    assert torch.equal(again, staging)
    dst2 = torch.zeros_like(src)
    decode_layers_into(codec, [(1, dst2, pages, [
        DecodeItem(dst_ids, i * BS, it.num_tokens, offsets[i], sizes[i])
        for i, it in enumerate(items)])], staging)
    assert torch.equal(dst2, dst)


def test_a_chunk_starting_inside_vllms_prefix_writes_only_its_tail():
    codec = Codec("raw", 128, 1)
    cache, latent, rope = filled_cache(2, [3, 4], 2 * BS)
    pages = LatentPages.from_cache(cache, L, R)
    staging = torch.zeros(latent_nbytes(codec, 0, 2 * BS, L, R), dtype=torch.uint8)
    encode_into(codec, 0, cache, pages, [EncodeItem([3, 4], 0, 2 * BS, 0)], staging)
    dst = torch.full_like(cache, 7.0)
    decode_tail_into(codec, 0, dst, pages,
                     DecodeItem([5, 6], 0, 2 * BS, 0, staging.numel()), staging, BS)
    assert (dst[5] == 7).all()  # vLLM's own block: not written
    assert torch.equal(dst[6], cache[4])


def test_a_refused_chunk_or_a_block_out_of_range_writes_nothing():
    codec = Codec("tq4", 128, 1)
    cache, *_ = filled_cache(3, [0, 1], 2 * BS)
    pages = LatentPages.from_cache(cache, L, R)
    n = latent_nbytes(codec, 0, BS, L, R)
    staging = torch.zeros(2 * n, dtype=torch.uint8)
    encode_into(codec, 0, cache, pages, [EncodeItem([0, 1], 0, BS, 0),
                                         EncodeItem([0, 1], BS, BS, n)], staging)
    dst = torch.zeros_like(cache)
    bad = staging.clone()
    bad[n + 200] ^= 1
    with pytest.raises(ChecksumError):
        decode_into(codec, 0, dst, pages, [DecodeItem([2, 3], 0, BS, 0, n),
                                           DecodeItem([2, 3], BS, BS, n, n)], bad)
    with pytest.raises(BlockIndexError):
        decode_into(codec, 0, dst, pages, [DecodeItem([2, NB], BS, BS, n, n)], staging)
    with pytest.raises(BlockIndexError):
        decode_into(codec, 0, dst, pages, [DecodeItem([3, NO_BLOCK], BS, BS, n, n)], staging)
    assert not dst.any()


def test_the_cache_as_vllm_registers_it_one_head_wide():
    """vLLM hands a connector an MLA cache as [num_blocks, 1, block_size, width]."""
    ids = [4, 8]
    cache, latent, rope = filled_cache(4, ids, 20)
    registered = cache.unsqueeze(1)
    pages = LatentPages.from_cache(registered, L, R)
    assert (pages.num_blocks, pages.block_size) == (NB, BS)
    got_latent, got_rope = pages.gather(registered, ids, 0, 20)
    assert torch.equal(got_latent, latent) and torch.equal(got_rope, rope)
    pages.scatter(registered, [1, 2], 0, latent, rope)
    assert torch.equal(cache[1], cache[4]) and torch.equal(cache[2, :4], cache[8, :4])


def test_caches_that_are_not_mla_rows_are_refused():
    with pytest.raises(CacheLayoutError, match="MLA cache"):
        LatentPages.from_cache(torch.zeros(NB, BS, L, dtype=torch.bfloat16), L, R)
    with pytest.raises(CacheLayoutError, match="kv-cache-dtype"):
        LatentPages.from_cache(torch.zeros(NB, BS, L + R, dtype=torch.uint8), L, R)
