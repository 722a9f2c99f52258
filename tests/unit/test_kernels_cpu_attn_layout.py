"""vLLM CPU attention layouts: the placement is probed from vLLM's own cache-write op for every
ISA this CPU's vLLM accepts, and from a replay of the map vLLM's op writes, recorded where it runs
(tests/data/vllm_cpu_attn), for the ones it refuses here (``amx`` outside vLLM's ``_C`` build);
a chunk encoded from one ISA's cache decodes into another ISA's cache exactly where vLLM's op puts
the same KV, and placements nobody planned for are served (generic) or refused, never misread."""

from __future__ import annotations

import itertools

import pytest
import torch
from support import vllm_cpu_attn as vca

from turbowire.codec import Codec
from turbowire.kernels import (
    DecodeItem,
    EncodeItem,
    PagedKVLayout,
    cpu_binding,
    decode_into,
    encode_into,
)
from turbowire.kernels.cpu_attn_layout import CpuCacheLayoutError, probe_layout
from turbowire.kernels.cpu_binding import CpuKernelError

H = 3
STALE = 7.0  # what the destination holds before a decode: slots not decoded must keep it
PATHS = {"vec": "strided", "vec16": "strided", "amx": "tiled"}  # how turbowire serves each ISA


def test_vllm_accepts_exactly_the_isas_this_cpu_can_run():
    """Guards the matrix below against testing fewer ISAs live than this CPU runs: vLLM's cache
    write takes vec and vec16 on every x86 CPU and amx exactly where vLLM loads its ``_C`` build
    (AVX-512 with bf16; tests/support/vllm_cpu_attn.py says where that rule comes from). A CPU
    whose vLLM unexpectedly runs or refuses amx fails here."""
    expected = vca.expected_live_isas()
    if expected is None:
        pytest.skip("the rule for which ISAs vLLM accepts is written down for x86 only")
    accepted = vca.live_isas(torch.bfloat16, H, 32, 64)
    refusals = {
        isa: vca.live_refusal(isa, torch.bfloat16, H, 32, 64) for isa in expected - set(accepted)
    }
    assert set(accepted) == expected, (accepted, refusals)
    assert vca.layout("vec", torch.bfloat16, H, 32, 64).path == "strided"
    assert vca.layout("amx", torch.bfloat16, H, 128, 128).path == "tiled"


def test_the_live_op_places_kv_exactly_as_recorded():
    """Every recorded map whose ISA vLLM's op runs here is what the op writes today (a vLLM that
    moved its placement fails here; re-record with record.py); every ISA this CPU must run is
    compared, so the recorded vec and vec16 maps are checked live on every x86 machine, and amx
    wherever vLLM accepts it."""
    expected = vca.expected_live_isas()
    if expected is None:
        pytest.skip("the rule for which ISAs vLLM accepts is written down for x86 only")
    compared = set()
    for entry in vca.recorded_maps().values():
        geometry = (entry.isa, entry.dtype, entry.heads, entry.block_size, entry.head_dim)
        live = vca.live_layout(*geometry)
        if live is None:
            assert entry.isa not in expected, (
                f"vLLM's op refuses {entry.name} here: {vca.live_refusal(*geometry)}"
            )
            continue
        k, v = live.maps
        assert torch.equal(k.offsets, entry.k_offsets), f"{entry.name}: keys differ from the record"
        assert torch.equal(v.offsets, entry.v_offsets), f"{entry.name}: values differ"
        compared.add(entry.isa)
    assert compared == expected


@pytest.mark.parametrize("name", sorted(vca.recorded_maps()))
def test_the_probe_reads_back_every_recorded_placement(name):
    """Fed a write that places K/V exactly where the recorded map says, the probe reconstructs
    that map and picks the path turbowire serves the ISA with (vec, vec16 strided; amx tiled, the
    C codec reading it through slot/dim offset tables)."""
    entry = vca.recorded_maps()[name]
    layout = probe_layout(entry.dtype, entry.heads, entry.block_size, entry.head_dim, entry.isa,
                          write=vca.replay_write(entry))
    k, v = layout.maps
    assert torch.equal(k.offsets, entry.k_offsets) and torch.equal(v.offsets, entry.v_offsets)
    assert layout.path == PATHS[entry.isa]
    # K and V fill their block, every element once
    per_block = entry.heads * entry.block_size * 2 * entry.head_dim
    both = torch.cat([entry.k_offsets.flatten(), entry.v_offsets.flatten()])
    assert torch.equal(both.sort().values, torch.arange(per_block))
    for _, _, slot_table, dim_table in layout.c_tables():  # what the C codec gets
        tables = slot_table is not None and dim_table is not None
        assert tables == (layout.path == "tiled"), (slot_table, dim_table)


GEOMETRIES = [
    (torch.bfloat16, 32, 64), (torch.bfloat16, 128, 128), (torch.float16, 128, 64),
    (torch.bfloat16, 16, 64),  # vec16 (amx refuses block size 16)
]


@pytest.mark.parametrize("dtype,bs,d", GEOMETRIES)
@pytest.mark.parametrize("preset", ["raw", "tq4"])
def test_chunks_move_between_every_pair_of_isas(dtype, bs, d, preset):
    """Every ISA vLLM's op runs here or that is recorded, so amx on every machine (bf16 with a
    block size amx takes), as a source and as a destination."""
    isas = vca.isas_for(dtype, H, bs, d)
    assert len(isas) >= 2
    if dtype == torch.bfloat16 and bs % 32 == 0:
        assert "amx" in isas
    n = bs + bs // 2 + 3  # a full block, then a partial one
    g = torch.Generator().manual_seed(bs + d)
    key = torch.randn(n, H, d, generator=g).to(dtype)
    value = torch.randn(n, H, d, generator=g).to(dtype)
    table, dtable = [4, 1, 5], [0, 3, 2]
    codec = Codec(preset, d, 2)
    for src_isa, dst_isa in itertools.product(isas, repeat=2):
        src = torch.zeros(6, H, bs, 2 * d, dtype=dtype)
        vca.write_tokens(src_isa, src, key, value, table)
        src_layout = vca.layout_for(src_isa, src, d)
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
            decode_into(codec, 1, dst, vca.layout_for(dst_isa, dst, d), decs, buf, impl=impl)
            decoded[impl] = dst
        assert torch.equal(decoded["cpu"].view(torch.int16), decoded["reference"].view(torch.int16))
        # what vLLM's op (live or recorded) writes for the KV the chunk carries, into a cache of
        # the same staleness
        want_k, want_v = key, value
        if preset != "raw":
            k0, v0 = codec.decode(1, buf[: sizes[0]])
            k1, v1 = codec.decode(1, buf[1 << 19 : (1 << 19) + sizes[1]])
            want_k, want_v = torch.cat([k0, k1]).to(dtype), torch.cat([v0, v1]).to(dtype)
        expect = torch.full((6, H, bs, 2 * d), STALE, dtype=dtype)
        vca.write_tokens(dst_isa, expect, want_k, want_v, dtable)
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
        vca.write_tokens(isa, cache, key, value, [3, 1])
        k, v = vca.layout_for(isa, cache, d).gather(cache, [3, 1], 0, n)
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
    assert not cpu_binding.applies(codec, cache, layout, buf)  # no C form: the reference serves
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
    layout = vca.layout("amx", torch.bfloat16, H, 32, 64)
    with pytest.raises(Exception, match="geometry"):
        layout.for_cache(torch.zeros(2, H + 1, 32, 128, dtype=torch.bfloat16))


@pytest.mark.parametrize("preset", ["raw", "tq4"])
def test_runs_and_windows_of_heads_through_every_isa(preset):
    """Different TP sizes on vLLM CPU engines: the C codec codes a run of heads and writes a
    window of a chunk's every head through a view that starts at that head, on every ISA's
    placement (amx's slot/dim tables too), byte for byte what the reference does."""
    from turbowire.kernels import HeadWindow

    dtype, bs, d = torch.bfloat16, 32, 64
    n = bs + 5
    g = torch.Generator().manual_seed(17)
    key = torch.randn(n, H, d, generator=g).to(dtype)
    value = torch.randn(n, H, d, generator=g).to(dtype)
    table = [4, 1]
    codec = Codec(preset, d, 2)
    for isa in vca.isas_for(dtype, H, bs, d):
        src = torch.zeros(6, H, bs, 2 * d, dtype=dtype)
        vca.write_tokens(isa, src, key, value, table)
        layout = vca.layout_for(isa, src, d)
        # heads 0 and 1..2: runs of one and of two heads, each of both blocks' tokens
        runs = [(0, 1), (1, 2)]
        items = [EncodeItem(table, t0, tn, (i * 2 + j) << 16, tag=9, head_start=a, head_count=c)
                 for i, (a, c) in enumerate(runs) for j, (t0, tn) in enumerate([(0, bs),
                                                                                (bs, n - bs)])]
        staged = {}
        for impl in ("cpu", "reference"):
            buf = torch.zeros(1 << 20, dtype=torch.uint8)
            staged[impl] = (buf, encode_into(codec, 1, src, layout, items, buf, impl=impl))
        assert staged["cpu"][1] == staged["reference"][1], isa
        assert torch.equal(staged["cpu"][0], staged["reference"][0]), (isa, "C != reference")
        buf, sizes = staged["cpu"]
        # the two-head run's chunks written whole at the cache's heads 1..2 (a window)
        decs = [DecodeItem(table, t0, tn, (2 + j) << 16, sizes[2 + j], 9,
                           heads=HeadWindow(2, 0, 2, 1))
                for j, (t0, tn) in enumerate([(0, bs), (bs, n - bs)])]
        decoded = {}
        for impl in ("cpu", "reference"):
            dst = torch.full((6, H, bs, 2 * d), STALE, dtype=dtype)
            decode_into(codec, 1, dst, vca.layout_for(isa, dst, d), decs, buf, impl=impl)
            decoded[impl] = dst
        assert torch.equal(decoded["cpu"].view(torch.int16), decoded["reference"].view(torch.int16))
        assert bool((decoded["cpu"] != STALE).any()), isa
