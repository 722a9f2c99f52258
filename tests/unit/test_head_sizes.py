"""Head sizes other than 64, 128 and 256 (Phi-3's 96, Pythia's 80, a tiny model's 32): the
presets without a rotation (``raw``, ``k8v8``) move them, through the reference codec, on every
vLLM CPU attention ISA's placement; the rotated presets refuse them at construction, naming the
presets that serve them; head sizes no preset codes are refused by all."""

from __future__ import annotations

import itertools

import pytest
import torch
from support import vllm_cpu_attn as vca

from turbowire.codec import Codec, GeometryError, get_preset, list_presets
from turbowire.integrations.lmcache_serde import SerdeConfigError, SerdeOptions
from turbowire.kernels import DecodeItem, EncodeItem, cpu_binding, decode_into, encode_into

UNROTATED = [p for p in list_presets() if not get_preset(p).rotates]
ROTATED = [p for p in list_presets() if get_preset(p).rotates]
H = 2
STALE = 7.0


def test_the_presets_without_a_rotation_are_raw_and_fp8():
    assert UNROTATED == ["raw", "k8v8"], UNROTATED
    assert "tq4" in ROTATED and "k8v4" in ROTATED  # fp8 keys, but Lloyd-Max values


@pytest.mark.parametrize("d", [32, 80, 96, 112, 512])
@pytest.mark.parametrize("preset", UNROTATED)
def test_unrotated_presets_round_trip_any_head_size(preset, d):
    codec = Codec(preset, d, 3)
    g = torch.Generator().manual_seed(d)
    k = torch.randn(37, H, d, generator=g).to(torch.bfloat16)
    v = torch.randn(37, H, d, generator=g).to(torch.bfloat16)
    chunk = codec.encode(1, k, v)
    assert chunk.nbytes == codec.encoded_nbytes(1, 37, H)
    k2, v2 = codec.decode(1, chunk.data)
    if preset == "raw":
        assert torch.equal(k2, k) and torch.equal(v2, v)
    else:  # e4m3 with a per-vector scale: 3 mantissa bits
        for x, y in ((k, k2), (v, v2)):
            err = (y.float() - x.float()).pow(2).sum() / x.float().pow(2).sum()
            assert err < 5e-3, err


@pytest.mark.parametrize("preset", ROTATED)
def test_rotated_presets_refuse_other_head_sizes_naming_the_ones_that_serve(preset):
    for d in (32, 96):
        with pytest.raises(GeometryError, match=rf"head_dim {d}: preset '{preset}'.*raw, k8v8"):
            Codec(preset, d, 4)
    for d in (64, 128, 256):
        Codec(preset, d, 4)


@pytest.mark.parametrize("d", [0, 4, 100, 1032, 2048])
def test_head_sizes_no_preset_codes_are_refused(d):
    for preset in list_presets():
        with pytest.raises(GeometryError, match=f"head_dim {d} is not supported"):
            Codec(preset, d, 4)


@pytest.mark.parametrize("d", [96, 80])
@pytest.mark.parametrize("preset", UNROTATED)
def test_chunks_of_other_head_sizes_move_between_every_pair_of_isas(preset, d):
    """What the engine does (``impl="auto"``): the C codec declines the head size, the
    reference codes it, and the decode lands where vLLM's own op puts the chunk's KV."""
    bs = 32
    isas = vca.isas_for(torch.bfloat16, H, bs, d)
    assert len(isas) >= 2, isas
    n = bs + bs // 2 + 3  # a full block, then a partial one
    g = torch.Generator().manual_seed(d)
    key = torch.randn(n, H, d, generator=g).to(torch.bfloat16)
    value = torch.randn(n, H, d, generator=g).to(torch.bfloat16)
    table, dtable = [4, 1, 5], [0, 3, 2]
    codec = Codec(preset, d, 2)
    for src_isa, dst_isa in itertools.product(isas, repeat=2):
        src = torch.zeros(6, H, bs, 2 * d, dtype=torch.bfloat16)
        vca.write_tokens(src_isa, src, key, value, table)
        src_layout = vca.layout_for(src_isa, src, d)
        buf = torch.zeros(1 << 20, dtype=torch.uint8)
        assert not cpu_binding.applies(codec, src, src_layout, buf)
        assert "reference codec" in cpu_binding.served_by(src_layout)
        items = [EncodeItem(table, 0, bs, 0, tag=1), EncodeItem(table, bs, n - bs, 1 << 19, tag=2)]
        sizes = encode_into(codec, 1, src, src_layout, items, buf)
        assert sizes == [codec.encoded_nbytes(1, bs, H, 0), codec.encoded_nbytes(1, n - bs, H, bs)]
        dst = torch.full((6, H, bs, 2 * d), STALE, dtype=torch.bfloat16)
        decode_into(codec, 1, dst, vca.layout_for(dst_isa, dst, d),
                    [DecodeItem(dtable, 0, bs, 0, sizes[0], 1),
                     DecodeItem(dtable, bs, n - bs, 1 << 19, sizes[1], 2)], buf)
        want_k, want_v = key, value
        if preset != "raw":
            k0, v0 = codec.decode(1, buf[: sizes[0]])
            k1, v1 = codec.decode(1, buf[1 << 19 : (1 << 19) + sizes[1]])
            want_k, want_v = torch.cat([k0, k1]), torch.cat([v0, v1])
        expect = torch.full((6, H, bs, 2 * d), STALE, dtype=torch.bfloat16)
        vca.write_tokens(dst_isa, expect, want_k, want_v, dtable)
        same = dst.view(torch.int16) == expect.view(torch.int16)
        assert bool(same.all()), f"{src_isa} -> {dst_isa}: {(~same).nonzero()[:3].tolist()}"


def test_the_lmcache_serde_takes_the_head_sizes_its_preset_codes():
    assert SerdeOptions.from_kwargs({"head_dim": 96, "preset": "raw"}).head_dim == 96
    with pytest.raises(SerdeConfigError, match="raw, k8v8"):
        SerdeOptions.from_kwargs({"head_dim": 96, "preset": "tq4"})
    with pytest.raises(SerdeConfigError, match="head_dim 100 is not supported"):
        SerdeOptions.from_kwargs({"head_dim": 100, "preset": "raw"})
