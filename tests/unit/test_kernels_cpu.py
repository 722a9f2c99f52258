"""The C codec for CPU paged caches (kernels/cpu/) against the reference codec.

Encoded bytes must be identical; decoded caches identical too (the C decode does the reference's
operations in the reference's order, so the stated tolerance is 0 ulp; the one exception is the
bit pattern of a NaN, which only inf inputs produce and FORMAT.md leaves undefined). Every ISA
variant the CPU runs is checked, on every preset, head_dim, block size and dtype, with randomized
extreme inputs, and every refusal must leave the cache (or the staging buffer) untouched.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from turbowire.codec import (
    ChecksumError,
    Codec,
    FormatError,
    GeometryError,
    IncompatiblePayloadError,
    TruncatedPayloadError,
    UnsupportedVersionError,
    list_presets,
)
from turbowire.codec.presets import FP8, RAW, LayerPolicy, Preset
from turbowire.codec.streams import StreamSpec
from turbowire.codec.wire import wsum32
from turbowire.kernels import (
    BlockIndexError,
    DecodeItem,
    EncodeItem,
    PagedKVLayout,
    cpu_binding,
    decode_into,
    encode_into,
)

GUARD = -3.5
LAYERS = 4
# presets beyond the named ones: every stream kind and flag the C code takes as parameters
CUSTOM = [
    Preset(
        "t-hi",
        100,
        "hi_eighths groups, 1 and 6 bits, 2 sink rows, boundary layers",
        LayerPolicy(
            StreamSpec("lloyd", bits=3, center=True, sink_tokens=2, hi_eighths=3),
            StreamSpec("lloyd", bits=5, hi_eighths=1),
        ),
        boundary=LayerPolicy(
            StreamSpec("lloyd", bits=6, center=True), StreamSpec("lloyd", bits=1, sink_tokens=3)
        ),
        boundary_layers=1,
    ),
    Preset("t-mix", 101, "raw keys, fp8 values", LayerPolicy(RAW, FP8)),
    Preset(
        "t-lo",
        102,
        "2+1/8.. bits",
        LayerPolicy(
            StreamSpec("lloyd", bits=2, hi_eighths=7, center=True),
            StreamSpec("lloyd", bits=4, hi_eighths=4, sink_tokens=1),
        ),
    ),
]
ALL = list_presets() + [p.name for p in CUSTOM]
_BY_NAME = {p.name: p for p in CUSTOM}


def preset_of(name: str) -> str | Preset:
    return _BY_NAME.get(name, name)


@pytest.fixture(scope="module", autouse=True)
def _library() -> Iterator[None]:
    assert cpu_binding.available(), (
        "the C codec is not built: run `pip install --no-build-isolation -e .`"
    )
    yield
    cpu_binding.set_isa(ISAS[-1])


ISAS = cpu_binding.supported_isas() if cpu_binding.available() else ["base"]


def make_cache(
    nb: int, heads: int, bs: int, dim: int, dtype: torch.dtype, seed: int, kind: str = "cpu_packed"
) -> torch.Tensor:
    """Keys with an outlier channel and a big offset, plain values."""
    g = torch.Generator().manual_seed(seed)
    if kind == "cpu_packed":
        x = torch.randn(nb, heads, bs, 2 * dim, generator=g)
        x[..., 5] += 14.0
        x[..., dim + 7] *= 9.0
    elif kind == "LBNHC":
        x = torch.randn(2, nb, bs, heads, dim, generator=g)
    else:  # LBHNC memory behind the logical [2, nb, bs, H, D] shape
        x = torch.randn(2, nb, heads, bs, dim, generator=g).permute(0, 1, 3, 2, 4)
    return x.to(dtype)


SHIFT = 3  # the C path reads and writes chunks at any byte offset; the reference decode needs 4


def shifted(items: list[EncodeItem]) -> list[EncodeItem]:
    return [dataclasses.replace(i, out_offset=i.out_offset + SHIFT) for i in items]


def encode_both(
    codec: Codec, layer: int, cache: torch.Tensor, layout: PagedKVLayout, items: list[EncodeItem]
) -> tuple[torch.Tensor, list[int], dict[str, torch.Tensor]]:
    """Reference staging bytes, sizes, and the C bytes per ISA written SHIFT bytes further
    (staging pre-filled with junk: padding must be written, not assumed)."""
    size = (
        max(
            i.out_offset
            + codec.encoded_nbytes(layer, i.num_tokens, layout.num_heads, i.token_start)
            for i in items
        )
        + 64
    )
    ref = torch.full((size,), 0xA5, dtype=torch.uint8)
    sizes = encode_into(codec, layer, cache, layout, items, ref, impl="reference")
    got = {}
    for isa in ISAS:
        assert cpu_binding.set_isa(isa) == isa
        buf = torch.full((size,), 0xA5, dtype=torch.uint8)
        assert encode_into(codec, layer, cache, layout, shifted(items), buf, impl="cpu") == sizes
        got[isa] = buf
    return ref, sizes, got


def assert_same_chunks(
    ref: torch.Tensor, got: torch.Tensor, items: list[EncodeItem], sizes: list[int]
) -> None:
    for item, n in zip(items, sizes, strict=True):
        a = ref[item.out_offset : item.out_offset + n]
        b = got[item.out_offset + SHIFT : item.out_offset + SHIFT + n]
        if not torch.equal(a, b):
            diff = (a != b).nonzero().flatten()
            raise AssertionError(
                f"{diff.numel()} bytes differ in the chunk at {item.out_offset}, "
                f"first at {diff[:8].tolist()} of {n}"
            )


def decode_both(
    codec: Codec,
    layer: int,
    dst_like: torch.Tensor,
    layout: PagedKVLayout,
    items: list[DecodeItem],
    source: torch.Tensor,
    c_source: torch.Tensor,
) -> None:
    """Decoded caches equal (0 ulp) between the reference and every ISA of the C path (which
    reads the same chunks SHIFT bytes further in c_source)."""
    ref = torch.full_like(dst_like, GUARD)
    decode_into(codec, layer, ref, layout, items, source, impl="reference")
    c_items = [dataclasses.replace(i, in_offset=i.in_offset + SHIFT) for i in items]
    for isa in ISAS:
        cpu_binding.set_isa(isa)
        dst = torch.full_like(dst_like, GUARD)
        decode_into(codec, layer, dst, layout, c_items, c_source, impl="cpu")
        same = (dst.view(torch.int16) == ref.view(torch.int16)) | (dst.isnan() & ref.isnan())
        assert bool(same.all()), f"decode differs ({isa}) at {(~same).nonzero()[:4].tolist()}"


# ---- bit exactness ------------------------------------------------------------------------------
@pytest.mark.parametrize("dim", [64, 128, 256])
@pytest.mark.parametrize("name", ALL)
def test_bytes_and_decode_equal_the_reference(name: str, dim: int) -> None:
    codec = Codec(preset_of(name), dim, LAYERS)
    for bs, dtype, layer in [
        (16, torch.bfloat16, 0),
        (32, torch.float16, 2),
        (128, torch.bfloat16, 3),
    ]:
        nb, heads = max(8, 300 // bs + 2), 2
        cache = make_cache(nb, heads, bs, dim, dtype, seed=dim + bs)
        layout = PagedKVLayout.from_cache(cache)
        ids = torch.randperm(nb, generator=torch.Generator().manual_seed(bs))[
            : 260 // bs + 2
        ].tolist()
        # sequence start with a partial last block, then a later chunk straddling a block edge,
        # then a one-token chunk; one call, chunks at unaligned offsets
        t0 = bs + 7 if bs < 128 else 100
        items, off = [], 16
        for start, count, tag in [(0, t0, 11), (t0, 41, 11), (t0 + 41, 1, 12)]:
            items.append(EncodeItem(ids, start, count, off, tag=tag))
            off += codec.encoded_nbytes(layer, count, heads, start) + 16
        ref, sizes, got = encode_both(codec, layer, cache, layout, items)
        for buf in got.values():
            assert_same_chunks(ref, buf, items, sizes)
        assert sizes == [
            codec.encoded_nbytes(layer, i.num_tokens, heads, i.token_start) for i in items
        ]
        assert sizes == [
            cpu_binding.chunk_nbytes(codec, layer, i.num_tokens, heads, i.token_start)
            for i in items
        ]
        dst_ids = [nb - 1 - i for i in ids]
        dec = [
            DecodeItem(dst_ids, i.token_start, i.num_tokens, i.out_offset, n, i.tag)
            for i, n in zip(items, sizes, strict=True)
        ]
        decode_both(codec, layer, cache, layout, dec, ref, got[ISAS[0]])
        # a chunk decoded into a cache of the other 16-bit dtype (double rounding as the reference)
        other = torch.float16 if dtype == torch.bfloat16 else torch.bfloat16
        decode_both(codec, layer, cache.to(other), layout, dec[:1], ref, got[ISAS[-1]])


@pytest.mark.parametrize("kind", ["LBNHC", "LBHNC"])
def test_gpu_shaped_cpu_caches_go_through_strides(kind: str) -> None:
    codec = Codec("k4v3", 128, LAYERS)
    cache = make_cache(10, 3, 16, 128, torch.bfloat16, seed=5, kind=kind)
    layout = PagedKVLayout.from_cache(cache)
    assert cpu_binding.applies(codec, cache, layout, torch.zeros(8, dtype=torch.uint8))
    items = [EncodeItem([7, 2, 5, 0], 0, 50, 0), EncodeItem([7, 2, 5, 0], 50, 13, 40000)]
    ref, sizes, got = encode_both(codec, 1, cache, layout, items)
    for buf in got.values():
        assert_same_chunks(ref, buf, items, sizes)
    dec = [
        DecodeItem([1, 9, 3, 4], i.token_start, i.num_tokens, i.out_offset, n)
        for i, n in zip(items, sizes, strict=True)
    ]
    decode_both(codec, 1, cache, layout, dec, ref, got[ISAS[-1]])


@pytest.mark.parametrize("name", ["raw", "k8v4", "tq4", "k4v3", "t-hi"])
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("isa", ["vec", "amx"])
def test_cpu_attention_layouts_are_served_in_place(name: str, dim: int, isa: str) -> None:
    """vLLM's CPU attention keeps keys as [D, block_size] per (block, head) (``vec``) or packs K
    and V in VNNI pairs for AMX tiles (``amx``): the C path walks them through the dim stride or
    the slot/dim offset tables (no scratch copy) with the same bytes as the reference, and a
    decode writes only the target tokens. The placement is probed from vLLM's op where this CPU's
    vLLM runs the ISA, else from the map recorded where it does (tests/data/vllm_cpu_attn), so
    amx is checked on every machine."""
    from support.vllm_cpu_attn import layout_for

    codec = Codec(preset_of(name), dim, LAYERS)
    bs, heads = 32, 3
    cache = make_cache(9, heads, bs, dim, torch.bfloat16, seed=dim)
    layout = layout_for(isa, cache, dim)
    if isa == "vec":
        assert layout.path == "strided"
        k_view, _ = layout.views(cache)
        assert k_view.stride(-1) == bs  # really transposed
    else:
        assert layout.path == "tiled"
    assert cpu_binding.applies(codec, cache, layout, torch.zeros(8, dtype=torch.uint8))
    ids = [6, 1, 4, 8]
    second = codec.encoded_nbytes(0, 45, heads, 0) + 40
    items = [EncodeItem(ids, 0, 45, 0, tag=3), EncodeItem(ids, 45, 60, second, tag=3)]
    ref, sizes, got = encode_both(codec, 0, cache, layout, items)
    for buf in got.values():
        assert_same_chunks(ref, buf, items, sizes)
    dec = [
        DecodeItem([2, 7, 0, 5], i.token_start, i.num_tokens, i.out_offset, n, 3)
        for i, n in zip(items, sizes, strict=True)
    ]
    decode_both(codec, 0, cache, layout, dec, ref, got[ISAS[-1]])  # guard elsewhere compared too


# ---- randomized inputs ----------------------------------------------------------------------
def extreme_values(
    style: str, shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator
) -> torch.Tensor:
    x = torch.randn(shape, generator=g)
    big = 1e37 if dtype == torch.bfloat16 else 3e4
    tiny = 1e-39 if dtype == torch.bfloat16 else 3e-7  # subnormal in the dtype
    if style == "outliers":
        x[..., torch.randint(0, shape[-1], (3,), generator=g)] *= 300.0
        x[..., 1] += 1000.0
    elif style == "zeros":
        x = x * (torch.rand(shape, generator=g) < 0.1)
        x[torch.rand(shape, generator=g) < 0.3] = -0.0
    elif style == "tiny":
        x = x * tiny
    elif style == "huge":
        x = (x * big).clamp(-big * 3, big * 3)
    elif style == "scaled":
        x = x * 10.0 ** torch.randint(-6, 6, shape[:-1] + (1,), generator=g).float()
    elif style == "mixed":
        pick = torch.randint(0, 4, shape[:-1] + (1,), generator=g)
        x = torch.where(
            pick == 0, x * tiny, torch.where(pick == 1, x * big, torch.where(pick == 2, x * 0, x))
        )
    elif style == "nonfinite":
        x[torch.rand(shape, generator=g) < 0.01] = float("inf")
        x[torch.rand(shape, generator=g) < 0.01] = -float("inf")
    return x.to(dtype)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**31 - 1),
    name=st.sampled_from(ALL),
    dim=st.sampled_from([64, 128, 256]),
    dtype=st.sampled_from([torch.bfloat16, torch.float16]),
    tokens=st.integers(1, 40),
    start=st.sampled_from([0, 1, 37]),
    style=st.sampled_from(
        ["normal", "outliers", "zeros", "tiny", "huge", "scaled", "mixed", "nonfinite"]
    ),
)
def test_randomized_extremes_are_bit_exact(
    seed: int, name: str, dim: int, dtype: torch.dtype, tokens: int, start: int, style: str
) -> None:
    g = torch.Generator().manual_seed(seed)
    bs, heads = 16, 2
    nb = (start + tokens) // bs + 3
    cache = extreme_values(style, (nb, heads, bs, 2 * dim), dtype, g)
    layout = PagedKVLayout.from_cache(cache)
    codec = Codec(preset_of(name), dim, LAYERS)
    ids = torch.randperm(nb, generator=g).tolist()
    items = [EncodeItem(ids, start, tokens, 16, tag=seed)]
    ref, sizes, got = encode_both(codec, seed % LAYERS, cache, layout, items)
    for buf in got.values():
        assert_same_chunks(ref, buf, items, sizes)
    decode_both(
        codec,
        seed % LAYERS,
        cache,
        layout,
        [DecodeItem(ids[::-1], start, tokens, 16, sizes[0], seed)],
        ref,
        got[ISAS[-1]],
    )


def test_conversions_match_torch_on_random_bit_patterns() -> None:
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-(2**31), 2**31, (1 << 20,), generator=g, dtype=torch.int64).to(
        torch.int32
    )
    x = torch.cat(
        [
            bits.view(torch.float32),
            torch.linspace(-500, 500, 1 << 16),
            torch.tensor([464.0, -464.0, 65504.0, 65520.0, 2.0**-24, 2.0**-25, -0.0]),
        ]
    )
    targets = [
        ("bf16", torch.bfloat16, torch.int16),
        ("fp16", torch.float16, torch.int16),
        ("e4m3", torch.float8_e4m3fn, torch.uint8),
    ]
    for isa in ISAS:
        cpu_binding.set_isa(isa)
        for kind, dtype, view in targets:
            want = x.to(dtype).view(view)
            for scalar in (False, True):
                bad = int((cpu_binding.convert_f32(x, kind, scalar) != want).sum())
                assert bad == 0, f"{kind} ({isa}, scalar={scalar}): {bad} values differ from torch"


def test_checksum_matches_the_reference() -> None:
    data = torch.randint(
        0, 256, (4096 + 48,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1)
    )
    for n in (0, 4, 44, 4096 + 48):
        assert cpu_binding.wsum32(data[:n]) == wsum32(data[:n])


# ---- guards and refusals ----------------------------------------------------------------------
@pytest.fixture()
def setup_tq4() -> tuple[Codec, torch.Tensor, PagedKVLayout, torch.Tensor, list[int]]:
    codec = Codec("tq4", 64, LAYERS)
    cache = make_cache(12, 2, 16, 64, torch.bfloat16, seed=9)
    layout = PagedKVLayout.from_cache(cache)
    staging = torch.zeros(1 << 16, dtype=torch.uint8)
    sizes = encode_into(
        codec,
        1,
        cache,
        layout,
        [EncodeItem([0, 1], 0, 20, 0, tag=4), EncodeItem([0, 1, 2], 20, 16, 32768, tag=4)],
        staging,
    )
    return codec, cache, layout, staging, sizes


def test_decode_touches_only_target_slots(setup_tq4) -> None:
    codec, cache, layout, staging, sizes = setup_tq4
    dst = torch.full_like(cache, GUARD)
    items = [
        DecodeItem([5, 8], 0, 20, 0, sizes[0], 4),
        DecodeItem([5, 8, 3], 20, 16, 32768, sizes[1], 4),
    ]
    decode_into(codec, 1, dst, layout, items, staging, impl="cpu")
    touched = torch.zeros(12, 16, dtype=torch.bool)
    for t in range(36):
        touched[[5, 8, 3][t // 16], t % 16] = True
    k, v = layout.views(dst)
    assert bool((k[~touched] == GUARD).all()) and bool((v[~touched] == GUARD).all())
    assert not bool((k[touched] == GUARD).any())
    ks, _ = layout.gather(cache, [0, 1, 2], 0, 36)
    kd, _ = layout.gather(dst, [5, 8, 3], 0, 36)
    assert torch.equal(kd[0], ks[0])  # the sink row is exact
    assert float((kd.float() - ks.float()).pow(2).sum() / ks.float().pow(2).sum()) < 0.02


def _corrupt(staging: torch.Tensor, how: str, sizes: list[int]) -> tuple[torch.Tensor, list[int]]:
    s = staging.clone()
    n = list(sizes)
    if how == "body":
        s[32768 + 48 + 100] ^= 0x10
    elif how == "header":
        s[32768 + 22] ^= 0x01
    elif how == "magic":
        s[32768] = ord("X")
    elif how == "version":
        s[32768 + 4] = 9
    elif how == "truncated":
        n[1] -= 16
    elif how == "tiny":
        n[1] = 20
    return s, n


@pytest.mark.parametrize(
    "how,exc",
    [
        ("body", ChecksumError),
        ("header", ChecksumError),
        ("magic", FormatError),
        ("version", UnsupportedVersionError),
        ("truncated", TruncatedPayloadError),
        ("tiny", TruncatedPayloadError),
    ],
)
def test_bad_payloads_are_refused_before_any_write(
    setup_tq4, how: str, exc: type[Exception]
) -> None:
    codec, cache, layout, staging, sizes = setup_tq4
    source, n = _corrupt(staging, how, sizes)
    items = [DecodeItem([5, 8], 0, 20, 0, n[0], 4), DecodeItem([5, 8, 3], 20, 16, 32768, n[1], 4)]
    for impl in ("reference", "cpu"):
        dst = torch.full_like(cache, GUARD)
        with pytest.raises(exc):
            decode_into(codec, 1, dst, layout, items, source, impl=impl)
        assert bool((dst == GUARD).all()), f"{impl} wrote into the cache before refusing"


@pytest.mark.parametrize(
    "change,exc,match",
    [
        (dict(expected_tag=5), IncompatiblePayloadError, "tag"),
        (dict(num_tokens=15), IncompatiblePayloadError, "tokens"),
        (dict(token_start=21), IncompatiblePayloadError, "offset"),
        (dict(block_ids=[5, 8, 99]), BlockIndexError, "block ids"),
        (dict(block_ids=[5, 8, 5]), BlockIndexError, "repeated"),
        (dict(block_ids=[5]), BlockIndexError, "need 3 blocks"),
        (dict(in_offset=65530), BlockIndexError, "outside"),
        (dict(nbytes=1 << 20), BlockIndexError, "outside"),
    ],
)
def test_mismatched_items_are_refused_before_any_write(setup_tq4, change, exc, match) -> None:
    codec, cache, layout, staging, sizes = setup_tq4
    second = dict(
        block_ids=[5, 8, 3],
        token_start=20,
        num_tokens=16,
        in_offset=32768,
        nbytes=sizes[1],
        expected_tag=4,
    )
    second.update(change)
    items = [DecodeItem([5, 8], 0, 20, 0, sizes[0], 4), DecodeItem(**second)]
    for impl in ("reference", "cpu"):
        dst = torch.full_like(cache, GUARD)
        with pytest.raises(exc, match=match):
            decode_into(codec, 1, dst, layout, items, staging, impl=impl)
        assert bool((dst == GUARD).all()), f"{impl} wrote into the cache before refusing"


def test_other_codec_layer_or_heads_are_refused(setup_tq4) -> None:
    codec, cache, layout, staging, sizes = setup_tq4
    items = [DecodeItem([5, 8], 0, 20, 0, sizes[0], 4)]
    dst = torch.full_like(cache, GUARD)
    for c, layer in [(Codec("tq3", 64, LAYERS), 1), (codec, 2), (Codec("tq4", 64, LAYERS + 1), 1)]:
        with pytest.raises(IncompatiblePayloadError):
            decode_into(c, layer, dst, layout, items, staging, impl="cpu")
    wide = torch.full((12, 3, 16, 128), GUARD, dtype=torch.bfloat16)  # 3 KV heads, chunk has 2
    with pytest.raises(IncompatiblePayloadError, match="KV heads"):
        decode_into(codec, 1, wide, PagedKVLayout.from_cache(wide), items, staging, impl="cpu")
    assert bool((dst == GUARD).all()) and bool((wide == GUARD).all())


def test_encode_refusals_write_nothing() -> None:
    codec = Codec("k8v4", 64, LAYERS)
    cache = make_cache(6, 2, 16, 64, torch.float16, seed=2)
    layout = PagedKVLayout.from_cache(cache)
    staging = torch.full((4096,), 0x5A, dtype=torch.uint8)
    good = EncodeItem([0, 1], 0, 8, 0)
    for bad, exc, match in [
        (EncodeItem([0, 9], 0, 20, 1024), BlockIndexError, "block ids"),
        (EncodeItem([0], 0, 20, 1024), BlockIndexError, "need 2 blocks"),
        (EncodeItem([3, 3], 0, 20, 1024), BlockIndexError, "repeated"),
        (EncodeItem([2], 0, 0, 1024), BlockIndexError, "bad token range"),
        (EncodeItem([2, 3], 0, 20, 4000), BlockIndexError, "outside"),
        (EncodeItem([2], 0, 8, 1024, tag=1 << 64), GeometryError, "64 unsigned bits"),
    ]:
        with pytest.raises(exc, match=match):
            encode_into(codec, 0, cache, layout, [good, bad], staging, impl="cpu")
        assert bool((staging == 0x5A).all()), "the C encoder wrote before refusing"


# ---- dispatch ------------------------------------------------------------------------------------
def test_auto_dispatch_uses_the_c_codec_for_cpu_caches(monkeypatch, setup_tq4) -> None:
    codec, cache, layout, staging, sizes = setup_tq4
    calls = []
    real_enc, real_dec = cpu_binding.encode_into, cpu_binding.decode_into
    monkeypatch.setattr(cpu_binding, "encode_into", lambda *a: calls.append("enc") or real_enc(*a))
    monkeypatch.setattr(cpu_binding, "decode_into", lambda *a: calls.append("dec") or real_dec(*a))
    buf = torch.zeros(1 << 16, dtype=torch.uint8)
    n = encode_into(codec, 1, cache, layout, [EncodeItem([0, 1], 0, 20, 0, tag=4)], buf)
    decode_into(
        codec, 1, torch.zeros_like(cache), layout, [DecodeItem([2, 3], 0, 20, 0, n[0], 4)], buf
    )
    assert calls == ["enc", "dec"] and torch.equal(buf[: n[0]], staging[: n[0]])
    # the reference stays reachable, and a non-CPU-layout request is not taken by the C path
    assert not cpu_binding.applies(codec, cache, layout, buf.reshape(256, 256))


def test_missing_library_falls_back_with_one_warning(monkeypatch, caplog, setup_tq4) -> None:
    codec, cache, layout, staging, sizes = setup_tq4
    monkeypatch.delenv("TURBOWIRE_CPU_LIB", raising=False)
    monkeypatch.setattr(cpu_binding, "MODULE", "turbowire.kernels._not_built")
    cpu_binding._library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="turbowire.kernels.cpu_binding"):
            buf = torch.zeros(1 << 16, dtype=torch.uint8)
            for _ in range(3):
                n = encode_into(codec, 1, cache, layout, [EncodeItem([0, 1], 0, 20, 0, tag=4)], buf)
        assert torch.equal(buf[: n[0]], staging[: n[0]])  # the reference produced the same bytes
        warnings = [r for r in caplog.records if "not built" in r.getMessage()]
        assert len(warnings) == 1
    finally:
        monkeypatch.undo()
        cpu_binding._library.cache_clear()
    assert cpu_binding.available()
