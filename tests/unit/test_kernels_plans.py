"""The array-built layer plans (kernels/triton_plans.py) under Triton's interpreter on CPU.

They must write exactly what the item plans (``EncodePlan`` / ``DecodePlan``) and the reference
codec write, per layer and batched, with one or two layer policies, bf16 and fp8 caches; refuse
what the item plans refuse; and never write a refused chunk (the valid chunks of its range are
written), raising the reference's exception for the first refused chunk.
"""

from __future__ import annotations

import os
from dataclasses import replace

os.environ["TRITON_INTERPRET"] = "1"  # also set by tests/conftest.py

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from turbowire.codec import ChecksumError, Codec, IncompatiblePayloadError  # noqa: E402
from turbowire.codec.presets import LayerPolicy, Preset, get_preset  # noqa: E402
from turbowire.kernels import (  # noqa: E402
    BlockIndexError,
    DecodeItem,
    EncodeItem,
    KVScales,
    PagedKVLayout,
    decode_into,
    encode_into,
)
from turbowire.kernels.triton_launch import (  # noqa: E402
    DecodePlan,
    EncodePlan,
    KernelConfig,
    StagingAlignmentError,
)
from turbowire.kernels.triton_plans import ChunkSet, DecodeLayersPlan, EncodeLayersPlan  # noqa: E402

SMALL = KernelConfig(num_warps=1, tile_rows=16)
BS, HEADS, DIM, NB, LAYERS = 16, 1, 64, 12, 3
GUARD = 7.0
FP8 = (0.05, 0.08)
# two policies: layer 0 and the last layer keep 4-bit keys + raw values, the body tq4
TWO = Preset("two-policies", 120, "test preset", get_preset("tq4").body,
             LayerPolicy(get_preset("tq4").body.k, get_preset("raw").body.v), boundary_layers=1)


def caches(kind: str, dtype: torch.dtype, seed: int, fill: float | None = None):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(LAYERS):
        shape = (2, NB, BS, HEADS, DIM) if kind == "LBNHC" else (2, NB, HEADS, BS, DIM)
        if fill is None:
            x = torch.randn(shape, generator=g) * 2 + torch.linspace(-3, 3, DIM)
            if dtype == torch.float8_e4m3fn:
                x = (x / FP8[0]).clamp(-448, 448)
        else:
            x = torch.full(shape, fill)
        x = x.to(dtype)
        out.append(x if kind == "LBNHC" else x.permute(0, 1, 3, 2, 4))
    return out


# two requests, block-granular chunks (one ends in a partial block, one starts mid-sequence)
REQS = [[7, 2, 9], [0, 4, 5, 11]]
CHUNKS = [(0, 0, 16), (0, 16, 5), (1, 16, 16), (1, 48, 9)]


def chunk_set(tags=True) -> ChunkSet:
    return ChunkSet(REQS, [c[0] for c in CHUNKS], [c[1] for c in CHUNKS],
                    [c[2] for c in CHUNKS],
                    [(i + 1) * 0x1_0000_0001 + (1 << 63) for i in range(len(CHUNKS))]
                    if tags else None)


def offsets(codec: Codec, stride: int = 8192) -> np.ndarray:
    """[layers, chunks] staging offsets: a fixed stride per (layer, chunk)."""
    return np.arange(LAYERS * len(CHUNKS), dtype=np.int64).reshape(LAYERS, len(CHUNKS)) * stride


def items(codec: Codec, out: np.ndarray, cs: ChunkSet):
    return [[EncodeItem(REQS[r], s, t, int(out[layer, n]), int(cs.tags[n]))
             for n, (r, s, t) in enumerate(CHUNKS)] for layer in range(LAYERS)]


def assert_chunks_equal(buf: torch.Tensor, ref: torch.Tensor, out: np.ndarray,
                        written: np.ndarray, *context) -> None:
    """Every (layer, chunk) of ``buf`` equal to the reference's bytes at its offset."""
    for layer in range(LAYERS):
        for n in range(len(CHUNKS)):
            o, w = int(out[layer, n]), int(written[layer, n])
            assert torch.equal(buf[o:o + w], ref[o:o + w]), (*context, layer, n)


@pytest.mark.parametrize("stream_major,mode", [(False, "layer"), (False, "batched"),
                                               (True, "layer"), (True, "batched")])
def test_either_program_order_writes_the_reference_bytes(stream_major, mode):
    """``KernelConfig.encode_stream_major``: every K program launched before every V program
    (the default), or a chunk's K and V programs side by side; per layer and batched (where a
    stream's programs span several layers)."""
    codec = Codec("tq4", DIM, LAYERS)
    src = caches("LBNHC", torch.bfloat16, seed=3)
    layout = PagedKVLayout.from_cache(src[0])
    cs = chunk_set()
    out = offsets(codec)
    size = LAYERS * len(CHUNKS) * 8192
    ref = torch.zeros(size, dtype=torch.uint8)
    enc = items(codec, out, cs)
    for layer in range(LAYERS):
        encode_into(codec, layer, src[layer], layout, enc[layer], ref, impl="reference")
    cfg = KernelConfig(num_warps=1, tile_rows=16, encode_stream_major=stream_major)
    buf = torch.full((size,), 0x5A, dtype=torch.uint8)
    plan = EncodeLayersPlan(codec, range(LAYERS), src, layout, cs, out, buf, cfg)
    if mode == "layer":
        for i in range(LAYERS):
            plan.launch_layer(i)
    else:
        plan.launch()
    assert_chunks_equal(buf, ref, out, plan.written)
    ends = (out + plan.written).reshape(-1)
    assert bool((buf[torch.from_numpy(ends)] == 0x5A).all())  # nothing past a chunk
    item_buf = torch.full((size,), 0x5A, dtype=torch.uint8)
    EncodePlan(codec, [(i, src[i], layout, enc[i]) for i in range(LAYERS)], item_buf,
               cfg).launch()
    assert torch.equal(item_buf, buf)


@pytest.mark.parametrize("preset,kind,dtype,mode,ranges", [
    ("tq4", "LBNHC", torch.bfloat16, "layer", [(0, 1), (1, LAYERS)]),
    (TWO, "LBHNC", torch.bfloat16, "batched", [(0, LAYERS)]),
    ("k4v3", "LBNHC", torch.float8_e4m3fn, "layer", [(0, 2), (2, LAYERS)]),
])
def test_layer_plans_write_what_the_item_plans_and_the_reference_write(preset, kind, dtype, mode,
                                                                      ranges):
    """Per-layer launches (in any order) or one batched launch per policy; the decode of one
    range of layers or several."""
    codec = Codec(preset, DIM, LAYERS)
    src = caches(kind, dtype, seed=1)
    layout = PagedKVLayout.from_cache(src[0])
    cs = chunk_set()
    out = offsets(codec)
    enc = items(codec, out, cs)
    fp8 = dtype == torch.float8_e4m3fn
    scales = [KVScales(*FP8)] * LAYERS if fp8 else None
    size = LAYERS * len(CHUNKS) * 8192
    ref = torch.zeros(size, dtype=torch.uint8)
    for layer in range(LAYERS):
        encode_into(codec, layer, src[layer], layout, enc[layer], ref, impl="reference",
                    kv_scales=FP8 if fp8 else None)
    iplan = EncodePlan(codec, [(i, src[i], layout, enc[i]) for i in range(LAYERS)],
                       torch.zeros(size, dtype=torch.uint8), SMALL, scales)
    plan = EncodeLayersPlan(codec, range(LAYERS), src, layout, cs, out,
                            torch.zeros(size, dtype=torch.uint8), SMALL, scales)
    assert plan.written.tolist() == iplan.written  # the item plan's sizes, without a launch
    buf = torch.full((size,), 0x5A, dtype=torch.uint8)
    plan = EncodeLayersPlan(codec, range(LAYERS), src, layout, cs, out, buf, SMALL, scales)
    if mode == "layer":
        for i in reversed(range(LAYERS)):  # any order: each launch owns its rows
            plan.launch_layer(i)
    else:
        plan.launch()
    assert_chunks_equal(buf, ref, out, plan.written, mode)
    assert plan.total_bytes == int(plan.written.sum())

    # decode: one range for all layers, and the layers split in two ranges
    dcs = ChunkSet([[3, 1, 8], [10, 6, 0, 2]], cs.req, cs.start, cs.tokens, cs.tags)
    dst_ref = caches(kind, dtype, 0, fill=GUARD)
    for layer in range(LAYERS):
        ditems = [DecodeItem(dcs.block_ids[dcs.offsets[r]:dcs.offsets[r + 1]].tolist(), s, t,
                             int(out[layer, n]), int(plan.written[layer, n]), int(cs.tags[n]))
                  for n, (r, s, t) in enumerate(CHUNKS)]
        decode_into(codec, layer, dst_ref[layer], layout, ditems, ref, impl="reference",
                    kv_scales=FP8 if fp8 else None)
    dst = caches(kind, dtype, 0, fill=GUARD)
    dplan = DecodeLayersPlan(codec, range(LAYERS), dst, layout, dcs, out, plan.written, ref,
                             SMALL, scales)
    for lo, hi in ranges:
        dplan.launch(lo, hi)
        dplan.check(lo, hi)
    for a, b in zip(dst, dst_ref):
        assert torch.equal(a.view(torch.uint8) if fp8 else a, b.view(torch.uint8) if fp8 else b)


# the verify pass then the per-head decode, on short chunks: checksums of 16 words, so a
# chunk's body is summed by several programs
BY_HEAD = replace(SMALL, decode_heads_from=1, verify_warps=1, verify_words=16)


@pytest.mark.parametrize("cfg", [SMALL, BY_HEAD], ids=["fused", "by-head"])
def test_a_refused_chunk_fails_its_range_only_and_raises_like_the_reference(cfg):
    codec = Codec("tq4", DIM, LAYERS)
    src = caches("LBNHC", torch.bfloat16, seed=2)
    layout = PagedKVLayout.from_cache(src[0])
    cs = chunk_set()
    out = offsets(codec)
    buf = torch.zeros(LAYERS * len(CHUNKS) * 8192, dtype=torch.uint8)
    plan = EncodeLayersPlan(codec, range(LAYERS), src, layout, cs, out, buf, SMALL)
    plan.launch()
    buf[int(out[2, 2]) + 100] ^= 0x20  # a body byte of layer 2, chunk 2
    dst = caches("LBNHC", torch.bfloat16, 0, fill=GUARD)
    dplan = DecodeLayersPlan(codec, range(LAYERS), dst, layout, cs, out, plan.written, buf, cfg)
    dplan.launch(0, 2)
    dplan.check(0, 2)  # layers 0 and 1 are fine
    dplan.launch(2, 3)
    assert int(dplan.flag(0)) == 0 and int(dplan.flag(2)) != 0  # the verdicts, per range
    dplan.check(0, 2, flag=0)  # a verdict read back already: no readback, no exception
    with pytest.raises(ChecksumError, match="body checksum"):
        dplan.check(2, 3, flag=int(dplan.flag(2)))
    with pytest.raises(ChecksumError, match="body checksum"):
        dplan.check(2, 3)
    # what selects the compiled kernels: the range's layer policies (verification is fused in)
    assert len(dplan.kernel_keys(0, 1)) == 1 and dplan.kernel_keys(0, 1) <= dplan.kernel_keys()
    # the refused chunk is not written (its rows keep the guard); the other chunks of its range
    # are, exactly as the reference decodes them
    want = caches("LBNHC", torch.bfloat16, 0, fill=GUARD)[2]
    good = [DecodeItem(REQS[r], st, t, int(out[2, c]), int(plan.written[2, c]), int(cs.tags[c]))
            for c, (r, st, t) in enumerate(CHUNKS) if c != 2]
    decode_into(codec, 2, want, layout, good, buf, impl="reference")
    assert torch.equal(dst[2], want)
    dplan.launch(0, 2)  # again: the verify pass left its sums at zero for the next launch
    dplan.check(0, 2)
    k, v = layout.views(dst[2])
    assert bool((k[REQS[1][1]] == GUARD).all()) and bool((v[REQS[1][1]] == GUARD).all())
    assert not bool((dst[0] == GUARD).all()) and not bool((dst[1] == GUARD).all())
    # a wrong expected tag: the reference's exception too
    bad = ChunkSet(REQS, cs.req, cs.start, cs.tokens, [1] * len(CHUNKS))
    dst2 = caches("LBNHC", torch.bfloat16, 0, fill=GUARD)
    p2 = DecodeLayersPlan(codec, range(LAYERS), dst2, layout, bad, out, plan.written, buf, cfg)
    p2.launch(0, 1)
    with pytest.raises(IncompatiblePayloadError, match="tag"):
        p2.check(0, 1)
    assert all(bool((d == GUARD).all()) for d in dst2)
    # no expected tags: none checked
    p3 = DecodeLayersPlan(codec, [0], dst2[:1], layout, chunk_set(tags=False), out[:1],
                          plan.written[:1], buf, cfg)
    p3.launch()
    p3.check()
    assert not bool((dst2[0] == GUARD).all())


def test_refusals_match_the_item_plans():
    codec = Codec("tq4", DIM, LAYERS)
    src = caches("LBNHC", torch.bfloat16, seed=3)
    layout = PagedKVLayout.from_cache(src[0])
    buf = torch.zeros(1 << 20, dtype=torch.uint8)
    out = np.zeros((1, 1), np.int64)

    def enc(lists, start, tokens, off=out):
        return EncodeLayersPlan(codec, [0], src[:1], layout,
                                ChunkSet(lists, [0], [start], [tokens], [1]), off, buf, SMALL)

    with pytest.raises(BlockIndexError, match="repeated"):
        enc([[3, 3]], 0, 20)
    with pytest.raises(BlockIndexError, match="block ids"):
        enc([[3, NB]], 0, 20)
    with pytest.raises(BlockIndexError, match="need 2 blocks"):
        enc([[3]], 0, 20)
    with pytest.raises(BlockIndexError, match="bad token range"):
        enc([[3]], 0, 0)
    with pytest.raises(StagingAlignmentError):
        enc([[3, 1]], 0, 20, np.full((1, 1), 8))
    with pytest.raises(BlockIndexError, match="outside"):
        enc([[3, 1]], 0, 20, np.full((1, 1), (1 << 20) - 64))
    with pytest.raises(BlockIndexError, match="same staging bytes"):
        EncodeLayersPlan(codec, [0, 1], src[:2], layout, ChunkSet([[3, 1]], [0], [0], [20], [1]),
                         np.zeros((2, 1), np.int64), buf, SMALL)
    # the same refusal from the item plan, for comparison
    with pytest.raises(BlockIndexError, match="same staging bytes"):
        EncodePlan(codec, [(0, src[0], layout, [EncodeItem([3, 1], 0, 20, 0)]),
                           (1, src[1], layout, [EncodeItem([3, 1], 0, 20, 0)])], buf, SMALL)
    # decode: two chunks writing the same slots, a truncated size
    two = ChunkSet([[3, 1], [1, 5]], [0, 1], [16, 0], [16, 16], [1, 2])
    with pytest.raises(BlockIndexError, match="same cache slots"):
        DecodeLayersPlan(codec, [0], src[:1], layout, two, np.array([[0, 4096]]),
                         np.array([[512, 512]]), buf, SMALL)
    from turbowire.codec import TruncatedPayloadError

    with pytest.raises(TruncatedPayloadError):
        DecodeLayersPlan(codec, [0], src[:1], layout, ChunkSet([[3]], [0], [0], [8], [1]),
                         out, np.array([[16]]), buf, SMALL)
    with pytest.raises(BlockIndexError):
        DecodePlan(codec, [(0, src[0], layout, [DecodeItem([3, 1], 16, 16, 0, 512, 1),
                                               DecodeItem([1, 5], 0, 16, 4096, 512, 2)])],
                   buf, SMALL)
