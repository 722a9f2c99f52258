"""Block lists with ``NO_BLOCK`` entries (the blocks a sliding window left, where vLLM puts its
null block), on every implementation: the entries are skipped by the range and repeat checks,
the chunks around them code and decode exactly as with a full list, and a chunk whose tokens
fall in one is refused before anything is written. Triton runs under TRITON_INTERPRET=1."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # also set by tests/conftest.py, before vllm imports triton

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from turbowire.codec import Codec  # noqa: E402
from turbowire.kernels import (  # noqa: E402
    NO_BLOCK,
    BlockIndexError,
    ChunkSet,
    DecodeItem,
    EncodeItem,
    PagedKVLayout,
    decode_into,
    encode_into,
)

BS, HEADS, DIM, NB = 32, 2, 64, 12
GUARD = 7.0
IMPLS = ["reference", "cpu", "triton"]


def cache(seed: int | None) -> torch.Tensor:
    if seed is None:
        return torch.full((NB, HEADS, BS, 2 * DIM), GUARD, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(seed)
    return torch.randn(NB, HEADS, BS, 2 * DIM, generator=g).to(torch.bfloat16)


def encode(impl: str, table: list[int], staging: torch.Tensor) -> list[int]:
    src = cache(1)
    items = [EncodeItem(table, 64, BS, 0, tag=5), EncodeItem(table, 96, 20, 12288, tag=6)]
    return encode_into(Codec("tq4", DIM, 1), 0, src, PagedKVLayout.from_cache(src), items,
                       staging, impl=impl)


@pytest.mark.parametrize("impl", IMPLS)
def test_chunks_beside_missing_blocks_code_as_with_a_full_list(impl):
    held, reference = torch.zeros(24576, dtype=torch.uint8), torch.zeros(24576, dtype=torch.uint8)
    sizes = encode(impl, [NO_BLOCK, NO_BLOCK, 5, 7], held)
    assert sizes == encode("reference", [0, 1, 5, 7], reference)
    assert torch.equal(held, reference)

    codec, src = Codec("tq4", DIM, 1), cache(1)
    dst = cache(None)
    layout = PagedKVLayout.from_cache(dst)
    table = [NO_BLOCK, NO_BLOCK, 2, 9]
    items = [DecodeItem(table, 64, BS, 0, sizes[0], 5),
             DecodeItem(table, 96, 20, 12288, sizes[1], 6)]
    decode_into(codec, 0, dst, layout, items, held, impl=impl)
    ref = cache(None)
    decode_into(codec, 0, ref, layout, [DecodeItem([0, 1, 2, 9], 64, BS, 0, sizes[0], 5),
                                        DecodeItem([0, 1, 2, 9], 96, 20, 12288, sizes[1], 6)],
                reference, impl="reference")
    assert torch.equal(dst, ref)
    written = torch.zeros(NB, dtype=torch.bool)
    written[[2, 9]] = True
    assert bool((dst[~written] == GUARD).all())  # nothing else, block 0 included
    # the decoded tokens are the source's, coded: close to them, not the guard
    k_src = src[5, :, :, :DIM].float()
    assert float((dst[2, :, :, :DIM].float() - k_src).abs().mean()) < 0.2


@pytest.mark.parametrize("impl", IMPLS)
def test_a_chunk_in_a_missing_block_is_refused_and_writes_nothing(impl):
    staging = torch.zeros(24576, dtype=torch.uint8)
    sizes = encode("reference", [0, 1, 5, 7], staging)
    src = cache(1)
    with pytest.raises(BlockIndexError, match="does not hold"):
        encode_into(Codec("tq4", DIM, 1), 0, src, PagedKVLayout.from_cache(src),
                    [EncodeItem([NO_BLOCK, 3, 5], 16, 40, 0)],
                    torch.zeros(24576, dtype=torch.uint8), impl=impl)
    dst = cache(None)
    items = [DecodeItem([2, NO_BLOCK, 4, 9], 64, BS, 0, sizes[0], 5),
             DecodeItem([NO_BLOCK, NO_BLOCK, 4, NO_BLOCK], 96, 20, 12288, sizes[1], 6)]
    with pytest.raises(BlockIndexError, match="does not hold"):
        decode_into(Codec("tq4", DIM, 1), 0, dst, PagedKVLayout.from_cache(dst), items, staging,
                    impl=impl)
    if impl != "triton":  # Triton writes the valid chunks of a call with a refused one
        assert bool((dst == GUARD).all())
    else:
        assert bool((dst[[0, 1, 3, 5, 6, 7, 8, 9, 10, 11]] == GUARD).all())


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("table", [[-2, 3, 5, 7], [3, 3, 5, 7], [NO_BLOCK, 12, 5, 7]])
def test_other_bad_entries_are_still_refused(impl, table):
    src = cache(1)
    with pytest.raises(BlockIndexError, match="block ids"):
        encode_into(Codec("tq4", DIM, 1), 0, src, PagedKVLayout.from_cache(src),
                    [EncodeItem(table, 64, BS, 0)], torch.zeros(24576, dtype=torch.uint8),
                    impl=impl)


def test_the_plans_check_every_chunk_against_missing_blocks():
    layout = PagedKVLayout.from_cache(cache(None))
    lists = [[NO_BLOCK, NO_BLOCK, 3, 4], [5, NO_BLOCK, 6]]
    ChunkSet(lists, [0, 0, 1], [64, 96, 64], [32, 10, 20], None).check(layout)
    for req, start, tokens in [(0, 40, 30), (1, 60, 10), (1, 0, 40)]:
        chunks = ChunkSet(lists, np.array([0, req]), [64, start], [32, tokens], None)
        with pytest.raises(BlockIndexError, match="does not hold"):
            chunks.check(layout)
    with pytest.raises(BlockIndexError, match="repeated"):
        ChunkSet([[NO_BLOCK, 3, 3]], [0], [64], [32], None).check(layout)
