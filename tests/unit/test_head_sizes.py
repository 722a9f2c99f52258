"""Head sizes other than 64, 128 and 256 (Phi-3's 96, Pythia's 80, a tiny model's 32): every
preset codes them (a Lloyd-Max stream rotates each vector zero-padded to the next power of two,
``streams.rotated_dim``), the reference codec serves them on every vLLM CPU attention ISA's
placement (the C codec and the Triton kernels decline them by name), and head sizes no preset
codes are refused."""

from __future__ import annotations

import itertools

import pytest
import torch
from support import vllm_cpu_attn as vca

from turbowire.codec import Codec, GeometryError, list_presets
from turbowire.codec.streams import rotated_dim
from turbowire.integrations.lmcache_serde import SerdeConfigError, SerdeOptions
from turbowire.kernels import DecodeItem, EncodeItem, cpu_binding, decode_into, encode_into

H = 2
STALE = 7.0


def kv(tokens: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(tokens, H, d, generator=g).to(torch.bfloat16),
            torch.randn(tokens, H, d, generator=g).to(torch.bfloat16))


def relative_error(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((y.float() - x.float()).pow(2).sum() / x.float().pow(2).sum())


def test_a_vector_rotates_in_the_next_power_of_two():
    assert [rotated_dim(d) for d in (32, 64, 80, 96, 112, 128, 192, 256, 512)] == \
        [32, 64, 128, 128, 128, 128, 256, 256, 512]


@pytest.mark.parametrize("d", [32, 80, 96, 112, 192, 512])
@pytest.mark.parametrize("preset", list_presets())
def test_every_preset_codes_other_head_sizes(preset, d):
    """Each chunk has its announced size and decodes; the error is no worse than the same
    preset's at the next power of two (the padding's share of the error is dropped), and raw
    is exact."""
    codec, wider = Codec(preset, d, 3), Codec(preset, rotated_dim(d), 3)
    k, v = kv(37, d, d)
    chunk = codec.encode(1, k, v)
    assert chunk.nbytes == codec.encoded_nbytes(1, 37, H)
    k2, v2 = codec.decode(1, chunk.data)
    assert k2.shape == k.shape and v2.shape == v.shape
    if preset == "raw":
        assert torch.equal(k2, k) and torch.equal(v2, v)
        return
    kw, vw = kv(37, rotated_dim(d), d)
    kw2, vw2 = wider.decode(1, wider.encode(1, kw, vw).data)
    for got, ref in ((relative_error(k, k2), relative_error(kw, kw2)),
                     (relative_error(v, v2), relative_error(vw, vw2))):
        assert got <= 1.25 * ref + 1e-4, (got, ref)


@pytest.mark.parametrize("d", [0, 4, 100, 1032, 2048])
def test_head_sizes_no_preset_codes_are_refused(d):
    for preset in list_presets():
        with pytest.raises(GeometryError, match=f"head_dim {d} is not supported"):
            Codec(preset, d, 4)


@pytest.mark.parametrize("d", [96, 80])
@pytest.mark.parametrize("preset", ["raw", "tq4", "k8v8"])
def test_chunks_of_other_head_sizes_move_between_every_pair_of_isas(preset, d):
    """What the engine does (``impl="auto"``): the C codec declines the head size, the
    reference codes it, and the decode lands where vLLM's own op puts the chunk's KV."""
    bs = 32
    isas = vca.isas_for(torch.bfloat16, H, bs, d)
    assert len(isas) >= 2, isas
    n = bs + bs // 2 + 3  # a full block, then a partial one
    key, value = kv(n, d, d)
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


def test_the_lmcache_serde_takes_every_head_size_the_codec_codes():
    assert SerdeOptions.from_kwargs({"head_dim": 96, "preset": "tq4"}).head_dim == 96
    with pytest.raises(SerdeConfigError, match="head_dim 100 is not supported"):
        SerdeOptions.from_kwargs({"head_dim": 100, "preset": "raw"})
