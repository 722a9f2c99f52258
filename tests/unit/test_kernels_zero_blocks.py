"""``PagedKVLayout.zero_blocks``: every K/V element of the named blocks and nothing else, in each
cache kind (CPU packed, GPU kv-first and block-first, fp8 bits), ids bounds-checked."""

from __future__ import annotations

import pytest
import torch

from turbowire.kernels import BlockIndexError, PagedKVLayout

SHAPES = {
    "cpu_packed": (6, 2, 16, 128),  # [blocks, H, block_size, 2D]
    "kv_first": (2, 6, 16, 2, 64),
    "block_first": (6, 2, 16, 2, 64),
}


@pytest.mark.parametrize("kind", sorted(SHAPES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_only_the_named_blocks_are_zeroed(kind, dtype):
    cache = (torch.rand(SHAPES[kind]) + 0.5).to(dtype)
    layout = PagedKVLayout.from_cache(cache, head_dim=64)
    before = cache.float().clone()
    layout.zero_blocks(cache, [1, 4])
    k, v = (t.float() for t in layout.views(cache))
    k0, v0 = layout.views(before)
    for block in range(6):
        if block in (1, 4):
            assert not k[block].any() and not v[block].any()
        else:
            assert torch.equal(k[block], k0[block]) and torch.equal(v[block], v0[block])


def test_blocks_outside_the_cache_are_refused_and_nothing_is_written():
    cache = torch.ones(SHAPES["cpu_packed"], dtype=torch.bfloat16)
    layout = PagedKVLayout.from_cache(cache, head_dim=64)
    for ids in ([6], [-1], [0, 99]):
        with pytest.raises(BlockIndexError):
            layout.zero_blocks(cache, ids)
    assert bool((cache == 1).all())
    layout.zero_blocks(cache, [])  # nothing to clear
    assert bool((cache == 1).all())
