"""Triton codec kernels run by Triton's interpreter on CPU (TRITON_INTERPRET=1).

Encoded chunks must be byte-identical to the reference codec's (header and checksums included)
for every stream kind, bit width, head_dim, cache layout and block size; decoded caches must
equal the reference path's (the kernels follow its fp32 operation order, so the values are
bit-identical, not just close); slots outside the target tokens keep a guard pattern; a corrupt
or unexpected chunk is never written (the valid chunks of the same call are); remote indices are
refused before any launch.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # also set by tests/conftest.py, before vllm imports triton

import sys  # noqa: E402
from dataclasses import dataclass, replace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import triton.language.standard  # noqa: E402

if type(triton.language.standard.cdiv).__name__ != "InterpretedFunction":
    sys.exit("triton was imported before TRITON_INTERPRET=1 was set (see tests/conftest.py)")

from turbowire.codec import (  # noqa: E402
    ChecksumError,
    Codec,
    IncompatiblePayloadError,
    StreamSpec,
    TruncatedPayloadError,
)
from turbowire.codec.presets import LayerPolicy, Preset  # noqa: E402
from turbowire.kernels import (  # noqa: E402
    BlockIndexError,
    CacheLayoutError,
    DecodeItem,
    EncodeItem,
    PagedKVLayout,
    decode_into,
    encode_into,
)
from turbowire.kernels.triton_launch import (  # noqa: E402
    KernelConfig,
    StagingAlignmentError,
    decode_layers_into,
    encode_layers_into,
)

GUARD = 7.0
NUM_BLOCKS = 10


def make_cache(kind: str, bs: int, heads: int, dim: int, dtype: torch.dtype, seed: int, fill=None):
    g = torch.Generator().manual_seed(seed)
    if kind == "cpu_packed":
        shape, perm = (NUM_BLOCKS, heads, bs, 2 * dim), None
    elif kind == "LBNHC":
        shape, perm = (2, NUM_BLOCKS, bs, heads, dim), None
    else:  # LBHNC memory seen through the logical LBNHC shape, as vLLM hands it over
        shape, perm = (2, NUM_BLOCKS, heads, bs, dim), (0, 1, 3, 2, 4)
    if fill is None:
        # a per-channel offset (what the chunk mean removes) plus an outlier channel
        x = torch.randn(shape, generator=g) * 2 + torch.linspace(-3, 3, shape[-1])
        x[..., 5] *= 8
    else:
        x = torch.full(shape, fill)
    x = x.to(dtype)
    return x.permute(*perm) if perm else x


def custom(k: StreamSpec, v: StreamSpec, pid: int) -> Preset:
    return Preset(f"custom{pid}", pid, "test preset", LayerPolicy(k, v))


@dataclass(frozen=True)
class Case:
    preset: str | Preset
    dim: int
    kind: str
    block_size: int
    dtype: torch.dtype
    chunks: tuple[tuple[int, int], ...]  # (token_start, tokens) per chunk
    config: KernelConfig
    heads: int = 2


SMALL = KernelConfig(num_warps=1, tile_rows=16)
LUT = KernelConfig(num_warps=1, tile_rows=16, qmode=2)  # the bucketed-table quantizer
CASES = {
    "raw-d64-LBNHC-bs16": Case("raw", 64, "LBNHC", 16, torch.bfloat16, ((0, 40), (40, 9)), SMALL),
    "k8v4-d128-LBHNC-bs32-fp16": Case("k8v4", 128, "LBHNC", 32, torch.float16, ((0, 33),),
                                      KernelConfig(num_warps=1, tile_rows=16, qmode=0)),
    # T = 70 in tiles of 16: the chunk mean folds 8 tiles through the binary counter
    "tq4-d64-cpu-bs64-multitile": Case("tq4", 64, "cpu_packed", 64, torch.bfloat16, ((0, 70),), LUT,
                                       heads=1),
    "k4v3-d256-LBNHC-bs128-lanes2": Case("k4v3", 256, "LBNHC", 128, torch.bfloat16, ((0, 20),),
                                         SMALL, heads=1),
    "k3v2-d128-offset-lanes2": Case("k3v2", 128, "LBNHC", 16, torch.bfloat16, ((5, 30),),
                                    KernelConfig(num_warps=1, tile_rows=16, lanes=2), heads=1),
    # one 16-byte piece per lane (head_dim/8 lanes): 4 butterfly stages across lanes, 2- and 1-bit
    # planes narrower than a word per lane (byte stores), rows loaded as [rows, head_dim]
    "tq3-d128-lanes16": Case("tq3", 128, "LBHNC", 16, torch.bfloat16, ((3, 21),),
                             KernelConfig(num_warps=1, tile_rows=4, lanes=16, decode_lanes=16,
                                          qmode=1),
                             heads=1),
    # a whole row per thread
    "tq3-d64-lanes1": Case("tq3", 64, "LBHNC", 16, torch.bfloat16, ((0, 21),),
                           KernelConfig(num_warps=1, tile_rows=16, lanes=1, decode_lanes=1),
                           heads=1),
    # a whole row per thread (the lloyd default): in-register butterfly, carried-threshold
    # quantizer for 1-4 bits, the select tree above, row-major gathers, word and byte planes
    "tq4-d128-lanes1": Case("tq4", 128, "LBNHC", 16, torch.bfloat16, ((0, 40), (40, 9)),
                            KernelConfig(num_warps=1, tile_rows=16, lanes=1, decode_lanes=1,
                                         qmode=1)),
    # a block size that is no power of two (rows found by division, not shift and mask) and the
    # select-tree quantizer (qmode 1) over 4 lanes
    "tq4-d128-bs24-select-tree": Case("tq4", 128, "LBNHC", 24, torch.bfloat16, ((0, 40), (40, 9)),
                                      KernelConfig(num_warps=1, tile_rows=16, qmode=1), heads=1),
    "k8v4-d256-lanes1-fp16": Case("k8v4", 256, "LBHNC", 32, torch.float16, ((0, 19),),
                                  KernelConfig(num_warps=1, tile_rows=8, lanes=1, decode_lanes=1),
                                  heads=1),
    "k5v4-raw-d64-lanes1": Case("k5v4", 64, "LBNHC", 16, torch.bfloat16, ((0, 18),),
                                KernelConfig(num_warps=2, tile_rows=32, lanes=1, decode_lanes=1)),
    # raw keys next to a Lloyd-Max value stream, and fp8 in both streams (k16v*, k8v8)
    "k16v4-d128-LBNHC-bs16": Case("k16v4", 128, "LBNHC", 16, torch.bfloat16, ((0, 40), (40, 9)),
                                  SMALL),
    "k16v3-d64-LBHNC-lanes1-fp16": Case("k16v3", 64, "LBHNC", 32, torch.float16, ((3, 30),),
                                        KernelConfig(num_warps=1, tile_rows=16, lanes=1,
                                                     decode_lanes=1), heads=1),
    "k8v8-d64-cpu-bs16": Case("k8v8", 64, "cpu_packed", 16, torch.bfloat16, ((0, 21), (21, 9)),
                              SMALL),
    "raw-d128-lanes1": Case("raw", 128, "LBHNC", 16, torch.bfloat16, ((7, 20),),
                            KernelConfig(num_warps=1, tile_rows=16, lanes=1, decode_lanes=1),
                            heads=1),
    "bits1-bits2-d64-lanes1": Case(
        custom(StreamSpec("lloyd", bits=1, center=True, sink_tokens=1),
               StreamSpec("lloyd", bits=2), 103),
        64, "LBHNC", 16, torch.bfloat16, ((0, 24), (24, 17)),
        KernelConfig(num_warps=1, tile_rows=16, lanes=1, decode_lanes=1, qmode=2),
    ),
    "hi-eighths-d64-lanes1": Case(
        custom(StreamSpec("lloyd", bits=3, center=True, hi_eighths=2),
               StreamSpec("lloyd", bits=5, sink_tokens=1, hi_eighths=1), 104),
        64, "LBNHC", 32, torch.bfloat16, ((0, 12),),
        KernelConfig(num_warps=1, tile_rows=16, lanes=1, decode_lanes=1),
    ),
    "bits1-bits6-d64": Case(
        custom(StreamSpec("lloyd", bits=1, center=True, sink_tokens=1),
               StreamSpec("lloyd", bits=6), 101),
        64, "LBHNC", 16, torch.bfloat16, ((0, 24), (24, 17)),
        KernelConfig(num_warps=1, tile_rows=16, qmode=0),
    ),
    "hi-eighths-d64-fp16": Case(
        custom(StreamSpec("lloyd", bits=2, center=True, hi_eighths=2),
               StreamSpec("lloyd", bits=5, sink_tokens=1, hi_eighths=1), 102),
        64, "LBNHC", 32, torch.float16, ((0, 12),), LUT,
    ),
}


def test_default_lanes_and_refusals() -> None:
    cfg = KernelConfig()
    assert [cfg.lanes_for(d, True, False) for d in (64, 128, 256)] == [8, 16, 32]  # raw / fp8
    assert [cfg.lanes_for(d, False, True) for d in (64, 128, 256)] == [4, 4, 32]  # lloyd
    assert cfg.sum_rows_for(128) >= 32
    with pytest.raises(ValueError, match="head_dim/8"):
        KernelConfig(lanes=16).lanes_for(64)
    with pytest.raises(ValueError, match="max_registers"):
        KernelConfig(max_registers=8)
    with pytest.raises(ValueError, match="qmode"):
        KernelConfig(qmode=3)
    with pytest.raises(ValueError, match="sum_rows"):
        KernelConfig(sum_rows=24)
    with pytest.raises(ValueError, match="encode_max_registers"):
        KernelConfig(encode_max_registers="max")
    # encoder register caps: measured per stock preset at hd128 and the default shape only;
    # an explicit max_registers (both kernels) wins, None switches them off
    tq3, tq4 = Codec("tq3", 128, 4).policy(1), Codec("tq4", 128, 4).policy(1)
    assert cfg.encode_registers_for(tq3.k, tq3.v, 128) == 128
    assert cfg.encode_registers_for(tq4.k, tq4.v, 128) is None
    assert cfg.encode_registers_for(tq3.k, tq3.v, 64) is None
    assert KernelConfig(tile_rows=16).encode_registers_for(tq3.k, tq3.v, 128) is None
    assert KernelConfig(max_registers=96).encode_registers_for(tq4.k, tq4.v, 128) == 96
    assert KernelConfig(encode_max_registers=None).encode_registers_for(tq3.k, tq3.v, 128) is None
    assert KernelConfig(encode_max_registers=200).encode_registers_for(tq4.k, tq4.v, 64) == 200
    # the chunk-mean tile spans the lanes of one warp not spent on channel pieces
    assert [cfg.sum_rows_for(d) for d in (64, 128, 256)] == [32, 32, 32]
    # 8 warps at hd64: one channel piece and 32 rows per warp
    assert KernelConfig(num_warps=8, tile_rows=8).sum_rows_for(64) == 32
    assert KernelConfig(num_warps=1, tile_rows=4).sum_rows_for(128) == 8


def _items(case: Case, src_blocks: list[int], dst_blocks: list[int], written=None, tags=(11, 22)):
    enc, dec = [], []
    off = 0
    for i, (start, tokens) in enumerate(case.chunks):
        enc.append(EncodeItem(src_blocks, start, tokens, off, tag=tags[i]))
        if written is not None:
            dec.append(DecodeItem(dst_blocks, start, tokens, off, written[i], tags[i]))
        off += 1 << 16
    return enc, dec


@pytest.mark.parametrize("name", list(CASES))
def test_bytes_and_values_match_the_reference(name: str) -> None:
    _check_against_reference(CASES[name])


# the decode of long chunks: a verify pass, then one program per (chunk, stream, head); forced
# on short chunks here (decode_heads_from=1) over every stream kind, dtype and layout family
BY_HEAD_CASES = ["raw-d64-LBNHC-bs16", "k8v4-d128-LBHNC-bs32-fp16", "tq4-d64-cpu-bs64-multitile",
                 "k3v2-d128-offset-lanes2", "tq4-d128-lanes1", "bits1-bits6-d64",
                 "hi-eighths-d64-fp16", "k16v4-d128-LBNHC-bs16", "k8v8-d64-cpu-bs16"]


@pytest.mark.parametrize("name", BY_HEAD_CASES)
def test_decode_by_head_matches_the_reference(name: str) -> None:
    case = CASES[name]
    cfg = replace(case.config, decode_heads_from=1, verify_warps=1, verify_words=16)
    assert cfg.decodes_by_head(1) and not case.config.decodes_by_head(max(
        t for _, t in case.chunks))
    _check_against_reference(replace(case, config=cfg))


def test_decode_variant_and_program_order_defaults() -> None:
    """Long chunks decode by head, one-block chunks in the fused kernel; an encode launches
    every K program first when K and V are of one kind."""
    cfg = KernelConfig()
    assert cfg.decodes_by_head(256) and cfg.decodes_by_head(128)
    assert not cfg.decodes_by_head(64) and not cfg.decodes_by_head(16)
    assert not KernelConfig(decode_heads_from=None).decodes_by_head(1 << 16)
    tq4, k8v4 = Codec("tq4", 128, 2).policy(0), Codec("k8v4", 128, 2).policy(0)
    assert cfg.stream_major_for(tq4.k, tq4.v) and not cfg.stream_major_for(k8v4.k, k8v4.v)
    assert KernelConfig(encode_stream_major=True).stream_major_for(k8v4.k, k8v4.v)
    for bad in (dict(decode_heads_from=0), dict(verify_warps=3)):
        with pytest.raises(ValueError):
            KernelConfig(**bad)


def _check_against_reference(case: Case) -> None:
    src = make_cache(case.kind, case.block_size, case.heads, case.dim, case.dtype, seed=1)
    layout = PagedKVLayout.from_cache(src)
    codec = Codec(case.preset, case.dim, 3)
    src_blocks, dst_blocks = [7, 2, 9, 0, 4, 5], [1, 8, 3, 6, 0, 5]
    enc_items, _ = _items(case, src_blocks, dst_blocks)
    ref = torch.zeros(len(case.chunks) << 16, dtype=torch.uint8)
    out = torch.full_like(ref, 0xA5)  # stale bytes: padding must be written as zeros
    w_ref = encode_into(codec, 2, src, layout, enc_items, ref, impl="reference")
    w_tri = encode_into(codec, 2, src, layout, enc_items, out, impl="triton",
                        kernel_config=case.config)
    assert w_tri == w_ref
    for item, n in zip(enc_items, w_ref):
        a = ref[item.out_offset : item.out_offset + n]
        b = out[item.out_offset : item.out_offset + n]
        assert torch.equal(a, b), f"first differing byte {int((a != b).nonzero()[0])} of {n}"
    _, dec_items = _items(case, src_blocks, dst_blocks, w_ref)
    dst_ref = make_cache(case.kind, case.block_size, case.heads, case.dim, case.dtype, 0,
                         fill=GUARD)
    dst_tri = make_cache(case.kind, case.block_size, case.heads, case.dim, case.dtype, 0,
                         fill=GUARD)
    decode_into(codec, 2, dst_ref, layout, dec_items, ref, impl="reference")
    decode_into(codec, 2, dst_tri, layout, dec_items, out, impl="triton", kernel_config=case.config)
    assert torch.equal(dst_tri, dst_ref)
    # and only the chunks' token slots changed
    kd, vd = layout.views(dst_tri)
    touched = torch.zeros(NUM_BLOCKS, case.block_size, dtype=torch.bool)
    for start, tokens in case.chunks:
        for t in range(start, start + tokens):
            touched[dst_blocks[t // case.block_size], t % case.block_size] = True
    assert bool((kd[~touched] == GUARD).all()) and bool((vd[~touched] == GUARD).all())
    assert not bool((kd[touched] == GUARD).all())


@pytest.mark.parametrize("src_dtype,dst_dtype", [(torch.float16, torch.bfloat16),
                                                   (torch.bfloat16, torch.float16)])
def test_chunks_decode_into_a_cache_of_the_other_dtype(src_dtype, dst_dtype) -> None:
    """The decoder picks its tile loop by the chunk's source dtype (a header field): an fp16
    chunk into a bf16 cache rounds through fp16 first, as the reference does."""
    case = Case("tq4", 64, "LBNHC", 16, src_dtype, ((0, 21),), SMALL, heads=1)
    src = make_cache(case.kind, 16, 1, 64, src_dtype, seed=4)
    layout = PagedKVLayout.from_cache(src)
    codec = Codec("tq4", 64, 3)
    src_blocks, dst_blocks = [7, 2, 9], [1, 8, 3]
    enc_items, _ = _items(case, src_blocks, dst_blocks)
    buf = torch.zeros(1 << 16, dtype=torch.uint8)
    written = encode_into(codec, 1, src, layout, enc_items, buf, impl="triton", kernel_config=SMALL)
    _, dec_items = _items(case, src_blocks, dst_blocks, written)
    dst_ref = make_cache(case.kind, 16, 1, 64, dst_dtype, 0, fill=GUARD)
    dst_tri = make_cache(case.kind, 16, 1, 64, dst_dtype, 0, fill=GUARD)
    decode_into(codec, 1, dst_ref, layout, dec_items, buf, impl="reference")
    decode_into(codec, 1, dst_tri, layout, dec_items, buf, impl="triton", kernel_config=SMALL)
    assert torch.equal(dst_tri, dst_ref)
    assert not torch.equal(dst_tri, make_cache(case.kind, 16, 1, 64, dst_dtype, 0, fill=GUARD))


# the pointer shapes of the other Triton generation (3.6 vs 3.8+, kernels._rows_first): the same
# bytes must come out of either, so CI checks the family its own Triton does not pick
OTHER_ORDER_CASES = ["tq4-d128-lanes1", "k3v2-d128-offset-lanes2", "tq4-d64-cpu-bs64-multitile",
                     "hi-eighths-d64-fp16", "k8v4-d128-LBHNC-bs32-fp16", "bits1-bits2-d64-lanes1"]


@pytest.mark.parametrize("name", OTHER_ORDER_CASES)
def test_both_pointer_orders_give_the_same_bytes(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import triton.language as tl

    from turbowire.kernels import triton_codec

    monkeypatch.setattr(triton_codec, "ROWS_FIRST", tl.constexpr(not triton_codec.ROWS_FIRST.value))
    test_bytes_and_values_match_the_reference(name)


def _raw_setup(chunks=((0, 20), (20, 12))):
    case = Case("raw", 64, "LBNHC", 16, torch.bfloat16, chunks, SMALL)
    src = make_cache(case.kind, 16, 2, 64, torch.bfloat16, seed=3)
    layout = PagedKVLayout.from_cache(src)
    codec = Codec("raw", 64, 2)
    staging = torch.zeros(len(chunks) << 16, dtype=torch.uint8)
    enc, _ = _items(case, [3, 1, 4], [5, 9, 2])
    written = encode_into(codec, 1, src, layout, enc, staging, impl="triton", kernel_config=SMALL)
    _, dec = _items(case, [3, 1, 4], [5, 9, 2], written)
    dst = make_cache(case.kind, 16, 2, 64, torch.bfloat16, 0, fill=GUARD)
    return codec, layout, staging, dec, dst


# the verify pass then the per-head decode, on short chunks: checksums of 16 words, so a
# chunk's body is summed by several programs
BY_HEAD = replace(SMALL, decode_heads_from=1, verify_warps=1, verify_words=16)


@pytest.mark.parametrize("config", [SMALL, BY_HEAD], ids=["fused", "by-head"])
def test_a_corrupt_or_unexpected_chunk_is_never_written(config: KernelConfig) -> None:
    """Each chunk is verified before it is decoded (in the decoding program, or by the verify
    pass before the per-head decode): a refused chunk writes nothing (its slots keep the
    guard), the valid chunks of the same call are decoded as the reference decodes them, and
    the call raises the reference's exception for the refused one."""
    codec, layout, staging, dec, _ = _raw_setup()

    def after(layer: int, items) -> torch.Tensor:  # the reference's cache after ``items``
        want = make_cache("LBNHC", 16, 2, 64, torch.bfloat16, 0, fill=GUARD)
        if items:
            decode_into(codec, layer, want, layout, items, staging, impl="reference")
        return want

    def refused(layer: int, items, exc, match: str | None, good) -> None:
        dst = make_cache("LBNHC", 16, 2, 64, torch.bfloat16, 0, fill=GUARD)
        with pytest.raises(exc, match=match):
            decode_into(codec, layer, dst, layout, items, staging, impl="triton",
                        kernel_config=config)
        assert torch.equal(dst, after(layer, good)), match

    body_byte = dec[1].in_offset + 100
    staging[body_byte] ^= 0x10
    refused(1, dec, ChecksumError, "body checksum", [dec[0]])
    staging[body_byte] ^= 0x10
    staging[dec[0].in_offset + 9] ^= 0x01  # header (layer field)
    refused(1, dec, ChecksumError, "header checksum", [dec[1]])
    staging[dec[0].in_offset + 9] ^= 0x01
    wrong_tag = [dec[0], DecodeItem(dec[1].block_ids, dec[1].token_start, dec[1].num_tokens,
                                    dec[1].in_offset, dec[1].nbytes, expected_tag=99)]
    refused(1, wrong_tag, IncompatiblePayloadError, "tag", [dec[0]])
    short = [DecodeItem(dec[0].block_ids, 0, 20, dec[0].in_offset, dec[0].nbytes - 16, 11)]
    refused(1, short, TruncatedPayloadError, None, [])
    refused(0, dec, IncompatiblePayloadError, "layer", [])
    dst = make_cache("LBNHC", 16, 2, 64, torch.bfloat16, 0, fill=GUARD)
    decode_into(codec, 1, dst, layout, dec, staging, impl="triton", kernel_config=config)
    assert torch.equal(dst, after(1, dec)) and not bool((dst == GUARD).all())


def test_remote_indices_and_offsets_are_refused_before_any_launch() -> None:
    codec, layout, staging, dec, dst = _raw_setup(((0, 20),))
    src = make_cache("LBNHC", 16, 2, 64, torch.bfloat16, seed=3)
    out = torch.zeros(1 << 16, dtype=torch.uint8)
    kw = dict(impl="triton", kernel_config=SMALL)
    with pytest.raises(BlockIndexError, match="repeated"):
        encode_into(codec, 1, src, layout, [EncodeItem([3, 3], 0, 20, 0)], out, **kw)
    with pytest.raises(BlockIndexError, match="block ids"):
        encode_into(codec, 1, src, layout, [EncodeItem([3, NUM_BLOCKS], 0, 20, 0)], out, **kw)
    with pytest.raises(BlockIndexError, match="need 2 blocks"):
        encode_into(codec, 1, src, layout, [EncodeItem([3], 0, 20, 0)], out, **kw)
    with pytest.raises(StagingAlignmentError):
        encode_into(codec, 1, src, layout, [EncodeItem([3, 1], 0, 20, 8)], out, **kw)
    with pytest.raises(BlockIndexError, match="outside"):
        encode_into(codec, 1, src, layout, [EncodeItem([3, 1], 0, 20, 65520)], out, **kw)
    with pytest.raises(BlockIndexError, match="same staging bytes"):
        encode_into(codec, 1, src, layout,
                    [EncodeItem([3, 1], 0, 20, 0), EncodeItem([4], 0, 8, 64)], out, **kw)
    item = dec[0]
    overlapping = [item, DecodeItem([8, 9], 10, 10, item.in_offset, item.nbytes, 11)]
    with pytest.raises(BlockIndexError, match="same cache slots"):
        decode_into(codec, 1, dst, layout, overlapping, staging, **kw)
    with pytest.raises(BlockIndexError, match="block ids"):
        decode_into(codec, 1, dst, layout, [DecodeItem([-2, 2], 0, 20, 0, item.nbytes, 11)],
                    staging, **kw)  # -1 is NO_BLOCK: tests/unit/test_kernels_no_block.py
    assert bool((dst == GUARD).all())


def test_several_layers_and_policies_in_one_call() -> None:
    """Boundary layers use another policy: one launch per policy, layers in separate tensors."""
    fp8 = StreamSpec("fp8", bits=8)
    preset = Preset("custom103", 103, "boundary test",
                    LayerPolicy(fp8, StreamSpec("lloyd", bits=2)),
                    boundary=LayerPolicy(StreamSpec("raw"), StreamSpec("raw")), boundary_layers=1)
    codec = Codec(preset, 64, 3)
    caches = [make_cache("LBHNC", 16, 1, 64, torch.bfloat16, seed=10 + i) for i in range(3)]
    layout = PagedKVLayout.from_cache(caches[0])
    items = [[EncodeItem([2, 6], 0, 25, i << 14, tag=i)] for i in range(3)]
    ref = torch.zeros(1 << 16, dtype=torch.uint8)
    for i in range(3):
        encode_into(codec, i, caches[i], layout, items[i], ref, impl="reference")
    out = torch.zeros_like(ref)
    jobs = [(i, caches[i], layout, items[i]) for i in range(3)]
    written = encode_layers_into(codec, jobs, out, SMALL)
    assert torch.equal(out, ref)
    dst = [make_cache("LBHNC", 16, 1, 64, torch.bfloat16, 0, fill=GUARD) for _ in range(3)]
    dst_ref = [make_cache("LBHNC", 16, 1, 64, torch.bfloat16, 0, fill=GUARD) for _ in range(3)]
    dec = [[DecodeItem([7, 1], 0, 25, i << 14, written[i][0], i)] for i in range(3)]
    for i in range(3):
        decode_into(codec, i, dst_ref[i], layout, dec[i], ref, impl="reference")
    decode_layers_into(codec, [(i, dst[i], layout, dec[i]) for i in range(3)], out, SMALL)
    for a, b in zip(dst, dst_ref):
        assert torch.equal(a, b)


# fp8 e4m3 caches (vLLM --kv-cache-dtype fp8): values enter as bf16(fp32(q) * scale) and leave as
# e4m3(x / scale); the Triton kernels must give the reference's bytes and cache bits
FP8_SCALES = (0.0625, 0.11)
FP8_CASES = {
    "tq4-d64-LBNHC-f8": ("tq4", 64, "LBNHC", torch.float8_e4m3fn, SMALL),
    "k8v4-d128-LBHNC-u8": ("k8v4", 128, "LBHNC", torch.uint8,
                           KernelConfig(num_warps=1, tile_rows=16, qmode=0)),
    "raw-d64-u8-lanes1": ("raw", 64, "LBNHC", torch.uint8,
                          KernelConfig(num_warps=1, tile_rows=16, lanes=1, decode_lanes=1)),
    "tq3-d128-f8-lanes1": ("tq3", 128, "LBHNC", torch.float8_e4m3fn,
                           KernelConfig(num_warps=1, tile_rows=16, lanes=1, decode_lanes=1)),
}


def make_fp8_cache(kind: str, dim: int, storage: torch.dtype, seed: int, fill=None) -> torch.Tensor:
    x = make_cache(kind, 16, 2, dim, torch.float32, seed, fill=fill)
    scale = torch.tensor([FP8_SCALES[0], FP8_SCALES[1]]).reshape(2, 1, 1, 1, 1)
    q = (x / (1.0 if fill is not None else scale)).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q.view(torch.uint8) if storage == torch.uint8 else q


@pytest.mark.parametrize("name", list(FP8_CASES))
def test_fp8_caches_match_the_reference(name: str) -> None:
    preset, dim, kind, storage, cfg = FP8_CASES[name]
    case = Case(preset, dim, kind, 16, torch.bfloat16, ((0, 37), (37, 9)), cfg)
    src = make_fp8_cache(kind, dim, storage, seed=5)
    layout = PagedKVLayout.from_cache(src)
    codec = Codec(preset, dim, 3)
    src_blocks, dst_blocks = [7, 2, 9, 0, 4, 5], [1, 8, 3, 6, 0, 5]
    enc_items, _ = _items(case, src_blocks, dst_blocks)
    ref = torch.zeros(len(case.chunks) << 16, dtype=torch.uint8)
    out = torch.full_like(ref, 0xA5)
    w_ref = encode_into(codec, 1, src, layout, enc_items, ref, impl="reference",
                        kv_scales=FP8_SCALES)
    w_tri = encode_into(codec, 1, src, layout, enc_items, out, impl="triton", kernel_config=cfg,
                        kv_scales=FP8_SCALES)
    assert w_tri == w_ref
    for item, n in zip(enc_items, w_ref):
        assert torch.equal(ref[item.out_offset : item.out_offset + n],
                           out[item.out_offset : item.out_offset + n])
    _, dec_items = _items(case, src_blocks, dst_blocks, w_ref)
    dst_ref = make_fp8_cache(kind, dim, storage, 0, fill=GUARD)
    dst_tri = make_fp8_cache(kind, dim, storage, 0, fill=GUARD)
    decode_into(codec, 1, dst_ref, layout, dec_items, ref, impl="reference", kv_scales=FP8_SCALES)
    decode_into(codec, 1, dst_tri, layout, dec_items, out, impl="triton", kernel_config=cfg,
                kv_scales=FP8_SCALES)
    bits_ref, bits_tri = dst_ref.view(torch.uint8), dst_tri.view(torch.uint8)
    assert torch.equal(bits_tri, bits_ref)
    guard = make_fp8_cache(kind, dim, storage, 0, fill=GUARD).view(torch.uint8)
    kd, vd = layout.views(bits_tri)
    kg, _ = layout.views(guard)
    touched = torch.zeros(NUM_BLOCKS, 16, dtype=torch.bool)
    for start, tokens in case.chunks:
        for t in range(start, start + tokens):
            touched[dst_blocks[t // 16], t % 16] = True
    assert torch.equal(kd[~touched], kg[~touched]) and torch.equal(vd[~touched], kg[~touched])
    if preset == "raw":  # e4m3 -> bf16 -> e4m3 with the same scale gives the cache's bits back
        ks, _ = layout.views(src.view(torch.uint8))
        for start, tokens in case.chunks:
            for t in range(start, start + tokens):
                s_b, d_b = src_blocks[t // 16], dst_blocks[t // 16]
                assert torch.equal(kd[d_b, t % 16], ks[s_b, t % 16])


def test_fp8_caches_need_their_scales() -> None:
    src = make_fp8_cache("LBNHC", 64, torch.uint8, seed=1)
    layout = PagedKVLayout.from_cache(src)
    codec = Codec("tq4", 64, 3)
    staging = torch.zeros(1 << 16, dtype=torch.uint8)
    item = [EncodeItem([0, 1], 0, 20, 0)]
    for impl in ("reference", "triton"):
        with pytest.raises(CacheLayoutError, match="needs the layer's K/V scales"):
            encode_into(codec, 1, src, layout, item, staging, impl=impl)
        with pytest.raises(CacheLayoutError, match="finite number > 0"):
            encode_into(codec, 1, src, layout, item, staging, impl=impl, kv_scales=(0.5, 0.0))
    bf16 = make_cache("LBNHC", 16, 2, 64, torch.bfloat16, seed=1)
    with pytest.raises(CacheLayoutError, match="only apply to fp8 caches"):
        encode_into(codec, 1, bf16, PagedKVLayout.from_cache(bf16), item, staging,
                    kv_scales=(1.0, 1.0))
