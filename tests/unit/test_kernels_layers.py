"""The multi-layer front door (``encode_layers_into`` / ``decode_layers_into``) on CPU: the same
bytes and caches as one ``encode_into`` / ``decode_into`` per layer, on every CPU implementation;
Triton is picked in dispatch and gets all layers in one call (checked without running it here,
test_kernels_triton.py runs the batched kernels)."""

from __future__ import annotations

import pytest
import torch

from turbowire.codec import ChecksumError, Codec, StreamSpec
from turbowire.codec.presets import LayerPolicy, Preset
from turbowire.kernels import (
    DecodeItem,
    EncodeItem,
    KVScales,
    PagedKVLayout,
    cpu_binding,
    decode_into,
    decode_layers_into,
    dispatch,
    encode_into,
    encode_layers_into,
)

LAYERS = 3
GUARD = 7.0
# a boundary policy on the first/last layer: the layers of one call differ in policy
PRESET = Preset("t-layers", 104, "boundary layers raw", LayerPolicy(StreamSpec("fp8", bits=8),
                StreamSpec("lloyd", bits=3)), boundary=LayerPolicy(StreamSpec("raw"),
                StreamSpec("raw")), boundary_layers=1)
IMPLS = ["auto", "reference"] + (["cpu"] if cpu_binding.available() else [])


def _caches(dtype: torch.dtype = torch.bfloat16, fill: float | None = None) -> list[torch.Tensor]:
    out = []
    for layer in range(LAYERS):
        g = torch.Generator().manual_seed(20 + layer)
        x = torch.randn(8, 2, 16, 128, generator=g) if fill is None else torch.full(
            (8, 2, 16, 128), fill)
        out.append(x.to(dtype))
    return out


def _enc_items(layer: int) -> list[EncodeItem]:
    base = layer << 17
    return [EncodeItem([3, 1, 6], 0, 32, base, tag=layer),
            EncodeItem([3, 1, 6], 32, 9, base + (1 << 16), tag=layer)]


def _dec_items(layer: int, written: list[int]) -> list[DecodeItem]:
    return [DecodeItem([0, 5, 2], e.token_start, e.num_tokens, e.out_offset, n, e.tag)
            for e, n in zip(_enc_items(layer), written)]


@pytest.mark.parametrize("preset", ["tq4", "raw", PRESET])
@pytest.mark.parametrize("impl", IMPLS)
def test_layers_give_the_per_layer_bytes(preset, impl: str) -> None:
    codec = Codec(preset, 64, LAYERS)
    src = _caches()
    layout = PagedKVLayout.from_cache(src[0])
    ref = torch.zeros(LAYERS << 17, dtype=torch.uint8)
    ref_written = [encode_into(codec, i, src[i], layout, _enc_items(i), ref, impl=impl)
                   for i in range(LAYERS)]
    out = torch.zeros_like(ref)
    written = encode_layers_into(codec, [(i, src[i], layout, _enc_items(i)) for i in range(LAYERS)],
                                 out, impl=impl)
    assert written == ref_written
    assert torch.equal(out, ref)

    dst_ref, dst = _caches(fill=GUARD), _caches(fill=GUARD)
    for i in range(LAYERS):
        decode_into(codec, i, dst_ref[i], layout, _dec_items(i, written[i]), ref, impl=impl)
    decode_layers_into(codec, [(i, dst[i], layout, _dec_items(i, written[i]))
                               for i in range(LAYERS)], out, impl=impl)
    for a, b in zip(dst, dst_ref):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_fp8_layers_take_one_scale_pair_per_layer() -> None:
    codec = Codec("tq4", 64, LAYERS)
    src = _caches(torch.float8_e4m3fn)
    layout = PagedKVLayout.from_cache(src[0])
    scales = [KVScales(0.05 * (i + 1), 0.07) for i in range(LAYERS)]
    ref = torch.zeros(LAYERS << 17, dtype=torch.uint8)
    ref_written = [encode_into(codec, i, src[i], layout, _enc_items(i), ref, kv_scales=scales[i])
                   for i in range(LAYERS)]
    out = torch.zeros_like(ref)
    jobs = [(i, src[i], layout, _enc_items(i)) for i in range(LAYERS)]
    assert (encode_layers_into(codec, jobs, out, kv_scales=[(s.k, s.v) for s in scales])
            == ref_written)
    assert torch.equal(out, ref)
    dst_ref = _caches(torch.float8_e4m3fn, fill=0.0)
    dst = _caches(torch.float8_e4m3fn, fill=0.0)
    for i in range(LAYERS):
        decode_into(codec, i, dst_ref[i], layout, _dec_items(i, ref_written[i]), ref,
                    kv_scales=scales[i])
    decode_layers_into(codec, [(i, dst[i], layout, _dec_items(i, ref_written[i]))
                               for i in range(LAYERS)], out, kv_scales=scales)
    for a, b in zip(dst, dst_ref):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    with pytest.raises(ValueError, match="2 entries for 3 layers"):
        encode_layers_into(codec, jobs, out, kv_scales=scales[:2])


def test_no_jobs_and_bad_chunks() -> None:
    codec = Codec("tq4", 64, LAYERS)
    buf = torch.zeros(LAYERS << 17, dtype=torch.uint8)
    assert encode_layers_into(codec, [], buf) == []
    decode_layers_into(codec, [], buf)
    src = _caches()
    layout = PagedKVLayout.from_cache(src[0])
    written = encode_layers_into(codec, [(i, src[i], layout, _enc_items(i)) for i in range(LAYERS)],
                                 buf)
    buf[(1 << 17) + 100] ^= 0xFF  # a body byte of layer 1's first chunk
    dst = _caches(fill=GUARD)
    with pytest.raises(ChecksumError):
        decode_layers_into(codec, [(i, dst[i], layout, _dec_items(i, written[i]))
                                   for i in range(LAYERS)], buf)
    # per-layer path: the layer before the failing one is decoded, the failing one and those
    # after it are untouched
    assert not bool((dst[0] == GUARD).all())
    assert all(bool((d == GUARD).all()) for d in dst[1:]), "a failing layer wrote"


def test_triton_gets_all_layers_in_one_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """impl="triton" (and "auto" on CUDA caches) hands the whole job list to the batched
    implementation, with the fp8 scales resolved per job; no per-layer loop."""
    calls = []
    monkeypatch.setattr(dispatch.triton_launch, "encode_layers_into",
                        lambda codec, jobs, buf, cfg, kv_scales: calls.append(
                            ("enc", len(jobs), kv_scales)) or [[1]] * len(jobs))
    monkeypatch.setattr(dispatch.triton_launch, "decode_layers_into",
                        lambda codec, jobs, buf, cfg, kv_scales: calls.append(
                            ("dec", len(jobs), kv_scales)))
    codec = Codec("tq4", 64, LAYERS)
    src = _caches(torch.float8_e4m3fn)
    layout = PagedKVLayout.from_cache(src[0])
    buf = torch.zeros(16, dtype=torch.uint8)
    jobs = [(i, src[i], layout, []) for i in range(LAYERS)]
    pairs = [(0.5, 0.25)] * LAYERS
    assert encode_layers_into(codec, jobs, buf, impl="triton", kv_scales=pairs) == [[1]] * LAYERS
    decode_layers_into(codec, jobs, buf, impl="triton", kv_scales=pairs)
    assert [c[:2] for c in calls] == [("enc", LAYERS), ("dec", LAYERS)]
    assert all(sc == [KVScales(0.5, 0.25)] * LAYERS for _, _, sc in calls)
