"""The CPU cache mapping is probed against vLLM's own cache-write op, and with it a partial block
round-trips exactly, where the naive per-token K|V reading of the shape does not."""

import torch

from turbowire.codec import Codec
from turbowire.connector.cpu_cache import CANDIDATES, cpu_kv_layout, detect_mapping
from turbowire.kernels import DecodeItem, EncodeItem, PagedKVLayout, decode_into, encode_into

BS, H, D = 32, 3, 64


def _write_tokens(cache: torch.Tensor, key, value, slots):
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    nb = cache.shape[0]
    kc, vc = cache.view(nb, H, 2 * BS, D).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key, value, kc, vc, slots, _get_attn_isa(cache.dtype, BS, D))


def test_probe_finds_a_mapping_that_reads_back_vllm_writes():
    name, isa = detect_mapping(torch.bfloat16, H, BS, D)
    assert name in CANDIDATES and isa
    cache = torch.zeros(4, H, BS, 2 * D, dtype=torch.bfloat16)
    n = 37
    key = torch.randint(-50, 50, (n, H, D)).to(torch.bfloat16)
    value = torch.randint(-50, 50, (n, H, D)).to(torch.bfloat16)
    blocks = [3, 1]
    slots = torch.tensor([blocks[t // BS] * BS + t % BS for t in range(n)])
    _write_tokens(cache, key, value, slots)
    layout = cpu_kv_layout(cache, D)
    k, v = layout.gather(cache, blocks, 0, n)
    assert torch.equal(k, key) and torch.equal(v, value)
    # what the shape suggests (K|V per token in the last dim) reads something else
    naive_k, _ = PagedKVLayout.from_cache(cache, head_dim=D).gather(cache, blocks, 0, n)
    assert not torch.equal(naive_k, key)


def test_partial_block_roundtrip_through_the_codec():
    src = torch.zeros(4, H, BS, 2 * D, dtype=torch.bfloat16)
    n = 40  # one full block + 8 tokens
    key = torch.randint(-50, 50, (n, H, D)).to(torch.bfloat16)
    value = torch.randint(-50, 50, (n, H, D)).to(torch.bfloat16)
    _write_tokens(src, key, value, torch.tensor([t + BS for t in range(n)]))  # blocks 1, 2
    layout = cpu_kv_layout(src, D)
    codec = Codec("raw", D, 1)
    staging = torch.zeros(1 << 20, dtype=torch.uint8)
    sizes = encode_into(codec, 0, src, layout, [EncodeItem([1, 2], BS, 8, 0, tag=7)], staging)
    dst = torch.full_like(src, 3.0)  # stale content elsewhere in the block must not matter
    decode_into(codec, 0, dst, layout, [DecodeItem([0, 2], BS, 8, 0, sizes[0], 7)], staging)
    k, v = layout.gather(dst, [0, 2], BS, 8)
    assert torch.equal(k, key[BS:]) and torch.equal(v, value[BS:])


def test_packed_detour_matches_direct_and_touches_only_decoded_tokens():
    from turbowire.connector.cpu_cache import decode_via_packed, encode_via_packed

    src = torch.zeros(6, H, BS, 2 * D, dtype=torch.bfloat16)
    n = 75
    key = torch.randint(-50, 50, (n, H, D)).to(torch.bfloat16)
    value = torch.randint(-50, 50, (n, H, D)).to(torch.bfloat16)
    table = [4, 1, 5]
    _write_tokens(src, key, value, torch.tensor([table[t // BS] * BS + t % BS for t in range(n)]))
    layout = cpu_kv_layout(src, D)
    codec = Codec("tq4", D, 2)
    a = torch.zeros(1 << 20, dtype=torch.uint8)
    b = torch.zeros(1 << 20, dtype=torch.uint8)
    items = [EncodeItem(table, 32, 32, 0, tag=1), EncodeItem(table, 64, 11, 40000, tag=2)]
    direct = encode_into(codec, 1, src, layout, items, a)
    detour = encode_via_packed(codec, 1, src, layout, items, b)
    assert direct == detour and torch.equal(a, b)  # same bytes either way
    dst = torch.full_like(src, 7.0)
    dtable = [0, 2, 3]
    decode_via_packed(codec, 1, dst, layout, [
        DecodeItem(dtable, 32, 32, 0, detour[0], 1), DecodeItem(dtable, 64, 11, 40000, detour[1], 2)
    ], b)
    k, v = layout.gather(dst, dtable, 32, 43)
    ref_k, ref_v = layout.gather(src, table, 32, 43)
    assert (k.float() - ref_k.float()).norm() / ref_k.float().norm() < 0.2
    # block 0 of the destination (a "local prefix" block) and unused slots are untouched
    assert torch.all(dst[0] == 7.0)
    k_tail, _ = layout.views(dst)
    assert torch.all(k_tail[3, 11:] == 7.0)
