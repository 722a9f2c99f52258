"""Head windows (``DecodeItem.heads``): a decode rank of another TP size than the prefill rank
that staged a chunk writes exactly its share of the chunk's heads, at its own heads' offset,
and leaves every other head and token alone; a chunk of other heads than the window expects is
refused with nothing written. Checked against the whole chunk decoded by the reference, on every
path, which must write the same bits: the reference, the C codec (it writes windows of a chunk's
every head; a part of a chunk's heads falls to the reference) and the Triton kernels (Triton's
interpreter on CPU: the same kernels serve CUDA caches).

Runs of heads (``EncodeItem.head_count``): each run's chunk is that of those heads alone, byte
for byte, on every path."""

from __future__ import annotations

import pytest
import torch

from turbowire.codec import Codec
from turbowire.codec.errors import GeometryError
from turbowire.kernels import (
    DecodeItem,
    EncodeItem,
    HeadWindow,
    KernelConfig,
    PagedKVLayout,
    decode_into,
    decode_layers_into,
    encode_into,
)

NB, BS, D = 8, 16, 64
GUARD = 3.0


def gpu_style(heads: int, fill: float | None = None, seed: int = 0) -> torch.Tensor:
    """A 5-D [2, blocks, bs, H, D] cache (vLLM's GPU layout), on CPU."""
    if fill is not None:
        return torch.full((2, NB, BS, heads, D), fill, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, NB, BS, heads, D, generator=g).bfloat16()


def cpu_style(heads: int, fill: float) -> torch.Tensor:
    """A 4-D [blocks, H, bs, 2D] cache (K|V packed, vLLM's CPU layout)."""
    return torch.full((NB, heads, BS, 2 * D), fill, dtype=torch.bfloat16)


def staged(codec: Codec, cache: torch.Tensor, blocks: list[int], tokens: int
           ) -> tuple[torch.Tensor, list[int]]:
    """The chunks a prefill rank stages: one per block, back to back."""
    layout = PagedKVLayout.from_cache(cache)
    sizes = [codec.encoded_nbytes(0, min(BS, tokens - i * BS), layout.num_heads, i * BS)
             for i in range(len(blocks))]
    buf = torch.zeros(sum(sizes), dtype=torch.uint8)
    offs = [sum(sizes[:i]) for i in range(len(sizes))]
    items = [EncodeItem(blocks, i * BS, min(BS, tokens - i * BS), offs[i], tag=7 + i)
             for i in range(len(blocks))]
    encode_into(codec, 0, cache, layout, items, buf, impl="reference")
    return buf, offs


def items(blocks: list[int], tokens: int, offs: list[int], buf: torch.Tensor,
          window: HeadWindow | None) -> list[DecodeItem]:
    ends = offs[1:] + [buf.numel()]
    return [DecodeItem(blocks, i * BS, min(BS, tokens - i * BS), offs[i], ends[i] - offs[i],
                       expected_tag=7 + i, heads=window) for i in range(len(blocks))]


def whole(codec: Codec, buf: torch.Tensor, offs: list[int], blocks: list[int], tokens: int,
          heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [tokens, heads, D] of the chunks decoded whole (the reference)."""
    ref = gpu_style(heads, fill=0.0)
    decode_into(codec, 0, ref, PagedKVLayout.from_cache(ref),
                items(blocks, tokens, offs, buf, None), buf, impl="reference")
    return PagedKVLayout.from_cache(ref).gather(ref, blocks, 0, tokens)


# "auto" on these CPU caches: the C codec where it serves the call, else the reference;
# "triton-by-head": the verify pass then one program per (chunk, stream, head), the decode of
# long chunks (here forced for every chunk)
IMPLS = ["auto", "reference", "cpu", "triton", "triton-by-head"]
BY_HEAD = KernelConfig(decode_heads_from=1, verify_warps=1, verify_words=16)


def kw(impl: str) -> dict:
    """The front door's keyword arguments for ``impl``."""
    if impl == "triton-by-head":
        return {"impl": "triton", "kernel_config": BY_HEAD}
    return {"impl": impl}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("preset", ["raw", "tq4", "k8v4"])
@pytest.mark.parametrize("make_cache", [gpu_style, cpu_style], ids=["gpu_layout", "cpu_layout"])
def test_wider_decode_tp_takes_its_share_of_each_chunk(preset, make_cache, impl):
    """P TP=1 (4 heads) -> D TP=2 (2 heads per rank): rank r writes heads 2r, 2r+1."""
    codec = Codec(preset, D, 2)
    tokens, src_blocks, dst_blocks = 40, [5, 1, 6], [2, 7, 0]
    buf, offs = staged(codec, gpu_style(4, seed=1), src_blocks, tokens)
    k_all, v_all = whole(codec, buf, offs, src_blocks, tokens, 4)
    for rank in range(2):
        cache = make_cache(2, GUARD)
        layout = PagedKVLayout.from_cache(cache)
        decode_into(codec, 0, cache, layout,
                    items(dst_blocks, tokens, offs, buf, HeadWindow(4, 2 * rank, 2, 0)), buf,
                    **kw(impl))
        k, v = layout.gather(cache, dst_blocks, 0, tokens)
        assert torch.equal(k, k_all[:, 2 * rank:2 * rank + 2])
        assert torch.equal(v, v_all[:, 2 * rank:2 * rank + 2])
        # the partial last block's slots past the tokens and every other block: untouched
        k_full, _ = layout.gather(cache, dst_blocks, 0, len(dst_blocks) * BS)
        assert bool((k_full[tokens:] == GUARD).all())
        others = [b for b in range(NB) if b not in dst_blocks]
        assert bool((layout.gather(cache, others, 0, len(others) * BS)[0] == GUARD).all())


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("preset", ["raw", "tq3"])
def test_narrower_decode_tp_assembles_its_heads_from_several_ranks(preset, impl):
    """P TP=2 (2 heads per rank) -> D TP=1 (4 heads): each rank's chunks at their offset,
    through the multi-layer front door too."""
    codec = Codec(preset, D, 2)
    tokens, blocks = 33, [3, 4, 0]
    cache = cpu_style(4, GUARD)
    layout = PagedKVLayout.from_cache(cache)
    expect_k, expect_v = [], []
    for rank in range(2):
        buf, offs = staged(codec, gpu_style(2, seed=10 + rank), [1, 2, 3], tokens)
        k, v = whole(codec, buf, offs, [1, 2, 3], tokens, 2)
        expect_k.append(k)
        expect_v.append(v)
        window = HeadWindow(2, 0, 2, 2 * rank)
        decode_layers_into(codec, [(0, cache, layout, items(blocks, tokens, offs, buf, window))],
                           buf, **kw(impl))
    k, v = layout.gather(cache, blocks, 0, tokens)
    assert torch.equal(k, torch.cat(expect_k, dim=1))
    assert torch.equal(v, torch.cat(expect_v, dim=1))


@pytest.mark.parametrize("impl", IMPLS)
def test_a_chunk_of_other_heads_is_refused_and_nothing_written(impl):
    codec = Codec("tq4", D, 2)
    buf, offs = staged(codec, gpu_style(2, seed=3), [0, 1], 32)
    cache = gpu_style(2, fill=GUARD)
    before = cache.clone()
    with pytest.raises(GeometryError, match="holds 2 KV heads"):
        decode_into(codec, 0, cache, PagedKVLayout.from_cache(cache),
                    items([4, 5], 32, offs, buf, HeadWindow(4, 0, 2, 0)), buf, **kw(impl))
    with pytest.raises(GeometryError, match="outside the cache"):
        decode_into(codec, 0, cache, PagedKVLayout.from_cache(cache),
                    items([4, 5], 32, offs, buf, HeadWindow(2, 0, 2, 1)), buf, **kw(impl))
    assert torch.equal(cache, before)


def test_a_window_must_lie_inside_the_chunk():
    with pytest.raises(ValueError, match="bad head window"):
        HeadWindow(2, 1, 2, 0)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("preset", ["raw", "tq4", "k8v4", "tq3"])
@pytest.mark.parametrize("layout_kind", ["gpu", "cpu"])
def test_a_run_of_heads_encodes_as_those_heads_alone(preset, layout_kind, impl):
    """``EncodeItem.head_count``: a prefill rank staging one chunk per decode rank's heads. Each
    run is the chunk of those heads alone (``codec.heads.split_heads`` of the whole chunk),
    on the reference path and through the Triton kernels."""
    from turbowire.codec.heads import split_heads

    codec = Codec(preset, D, 2)
    cache = gpu_style(4, seed=5) if layout_kind == "gpu" else \
        torch.randn(NB, 4, BS, 2 * D, generator=torch.Generator().manual_seed(5)).bfloat16()
    layout = PagedKVLayout.from_cache(cache)
    blocks, tokens = [3, 1], BS + 9
    whole, offs = staged(codec, cache, blocks, tokens)
    for i in range(len(blocks)):
        n, start = min(BS, tokens - i * BS), i * BS
        size = codec.encoded_nbytes(0, n, 2, start)
        buf = torch.zeros(2 * size, dtype=torch.uint8)
        written = encode_into(codec, 0, cache, layout,
                              [EncodeItem(blocks, start, n, g * size, tag=7 + i, head_start=2 * g,
                                          head_count=2) for g in range(2)], buf, **kw(impl))
        assert written == [size, size]
        end = offs[i + 1] if i + 1 < len(offs) else whole.numel()
        want = split_heads(codec, 0, whole[offs[i]:end], 2)
        assert torch.equal(buf[:size], want[0]) and torch.equal(buf[size:], want[1])
    with pytest.raises(GeometryError, match="outside"):
        encode_into(codec, 0, cache, layout, [EncodeItem(blocks, 0, BS, 0, head_start=3,
                                                         head_count=2)], buf, **kw(impl))


@pytest.mark.parametrize("impl", ["reference", "triton", "triton-by-head"])
def test_a_window_into_an_fp8_cache_writes_what_the_whole_chunk_does(impl):
    """An fp8 cache (vLLM ``--kv-cache-dtype fp8``) with its layer scales: a window writes the
    e4m3 bits the whole chunk's decode writes for those heads, nothing else."""
    codec = Codec("tq4", D, 2)
    tokens, blocks = 40, [5, 1, 6]
    buf, offs = staged(codec, gpu_style(4, seed=2), [0, 2, 3], tokens)
    scales = (0.5, 0.25)
    full = torch.zeros(2, NB, BS, 4, D, dtype=torch.float8_e4m3fn)
    decode_into(codec, 0, full, PagedKVLayout.from_cache(full),
                items(blocks, tokens, offs, buf, None), buf, impl="reference", kv_scales=scales)
    for rank in range(2):
        cache = torch.full((2, NB, BS, 2, D), GUARD, dtype=torch.bfloat16).to(torch.float8_e4m3fn)
        before = cache.clone()
        decode_into(codec, 0, cache, PagedKVLayout.from_cache(cache),
                    items(blocks, tokens, offs, buf, HeadWindow(4, 2 * rank, 2, 0)), buf,
                    kv_scales=scales, **kw(impl))
        want = before.clone()
        flat_w = want.view(2, NB * BS, 2, D)
        flat_f = full.view(2, NB * BS, 4, D)
        slots = torch.tensor([blocks[t // BS] * BS + t % BS for t in range(tokens)])
        flat_w[:, slots] = flat_f[:, slots, 2 * rank:2 * rank + 2]
        assert torch.equal(cache.view(torch.uint8), want.view(torch.uint8)), rank
