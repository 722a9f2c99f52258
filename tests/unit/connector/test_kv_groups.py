"""Several KV cache groups (vLLM's hybrid KV cache manager, ``SupportsHMA``): each layer takes its
blocks from its own group's table. Driven through the worker's own calls, on CPU caches, with
both coders (the per-layer path CPU engines use, and the CUDA coder's Triton plans under
Triton's interpreter), then the decode side's planning of what moves.

A sliding-window group's table holds ``NO_BLOCK`` where vLLM freed a block the window left: the
prefill side stages nothing of those layers there, the decode side reads and writes nothing of
them there, and every other chunk arrives exactly (raw) or as the single-group path decodes it.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # also set by tests/conftest.py

from types import SimpleNamespace  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from support.fakes import load_request, save_request, use_cuda_coder  # noqa: E402
from support.fakes import make_worker as build_worker  # noqa: E402

from turbowire.connector.coder import ChunkOffsets  # noqa: E402
from turbowire.connector.metadata import PeerAddress, TurboWireConnectorMetadata  # noqa: E402
from turbowire.connector.read_plan import (  # noqa: E402
    chunk_sizes,
    held_chunks,
    layer_groups,
    read_rows,
)
from turbowire.kernels import NO_BLOCK, KernelConfig  # noqa: E402

BS, HEADS, DIM, NB = 16, 1, 64, 16
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
SLIDING = (LAYERS[0], LAYERS[2])  # interleaved, as Gemma's
GUARD = 7.0
TOKENS = 4 * BS - 3  # 4 blocks, the last one partial
# the prefill engine's tables: the window already left block 0 (vLLM's null block there)
P_FULL, P_SLIDING = [3, 7, 1, 9], [NO_BLOCK, 5, 2, 8]
# the decode engine's: it allocated null blocks for the sliding layers' first two blocks
D_FULL, D_SLIDING = [4, 11, 6, 0], [NO_BLOCK, NO_BLOCK, 12, 13]


def worker(monkeypatch, preset: str, gpu: bool, caches: dict):
    w = build_worker(monkeypatch, {"preset": preset, "staging_bytes": "1MiB"}, LAYERS,
                     block_size=BS, num_kv_heads=HEADS, head_size=DIM, num_blocks=NB,
                     engine_id=f"e-{preset}-{gpu}", sliding=SLIDING)
    w.register_kv_caches(caches)
    if gpu:
        use_cuda_coder(w, KernelConfig(num_warps=1, tile_rows=16))
    return w


def caches(seed: int | None) -> dict:
    """vLLM's GPU layout [2, blocks, block_size, heads, head_dim] per layer (on the CPU)."""
    g = torch.Generator().manual_seed(seed or 0)
    out = {}
    for n in LAYERS:
        x = (torch.full((2, NB, BS, HEADS, DIM), GUARD) if seed is None
             else torch.randn((2, NB, BS, HEADS, DIM), generator=g))
        out[n] = x.to(torch.bfloat16)
    return out


def group_of(w, layer: int) -> int:
    return w.geometry.layers[layer].group


def roundtrip(monkeypatch, preset: str, gpu: bool):
    """Stage on a prefill worker, land the bytes a decode worker would READ, decode them."""
    src = caches(seed=1)
    p = worker(monkeypatch, preset, gpu, src)
    assert p.geometry.num_groups == 2
    save = save_request("a", P_FULL, TOKENS, BS)
    tables = {group_of(p, 1): P_FULL, group_of(p, 0): P_SLIDING}
    save.group_tables = [tables[0], tables[1]]
    before = p.staging.clone()
    meta = TurboWireConnectorMetadata(saves=[save])
    for name in LAYERS[:2]:  # the rest is left to wait_for_save
        p.save_kv_layer(name, src[name], meta)
    p.wait_for_save(meta)
    staged = {}
    for layer in range(len(LAYERS)):
        for b in save.blocks:
            at = p.layout.chunk_offset(b.slot, layer)
            room = p.layout.full_chunk_bytes[layer]
            touched = not torch.equal(p.staging[at:at + room], before[at:at + room])
            staged[(layer, b.index)] = touched

    dst = caches(None)
    d = worker(monkeypatch, preset, gpu, dst)
    load = load_request("d", save, D_FULL, preset, PeerAddress("p", "h", 1, 1))
    d_tables = {group_of(d, 1): D_FULL, group_of(d, 0): D_SLIDING}
    load.group_tables = [d_tables[0], d_tables[1]]
    sizes = chunk_sizes(load.blocks, len(LAYERS), d.chunk_nbytes)
    sizes *= held_chunks(load.blocks, load.group_tables,
                         [layer.group for layer in d.geometry.layers])
    flat = sizes.reshape(-1)
    ends = flat.cumsum()
    groups = layer_groups(len(LAYERS), 2)
    offsets = ChunkOffsets((ends - flat).reshape(sizes.shape), sizes, groups, [])
    for layer in range(len(LAYERS)):
        for bi, b in enumerate(load.blocks):
            off, size = offsets[(bi, layer)]
            at = p.layout.chunk_offset(b.slot, layer)
            d.recv[off:off + size] = p.staging[at:at + size]
    pending = [d.coder.decode(load, layers, 0, offsets) for layers in groups]
    for handle in pending:
        handle.result()
    return src, dst, staged, sizes, load


@pytest.mark.parametrize("gpu", [False, True], ids=["host", "cuda"])
def test_each_layer_moves_through_its_own_groups_table(monkeypatch, gpu):
    src, dst, staged, sizes, load = roundtrip(monkeypatch, "raw", gpu)
    for layer, name in enumerate(LAYERS):
        sliding = name in SLIDING
        p_table, d_table = (P_SLIDING, D_SLIDING) if sliding else (P_FULL, D_FULL)
        for bi, b in enumerate(load.blocks):
            i, n = b.index, b.num_tokens
            # staged where the prefill side's group held the block, and only there
            assert staged[(layer, i)] == (p_table[i] != NO_BLOCK), (name, i)
            # read where the decode side's group holds it, and only there
            assert (sizes[layer, bi] > 0) == (d_table[i] != NO_BLOCK), (name, i)
            if d_table[i] == NO_BLOCK:
                continue
            got = dst[name][:, d_table[i], :n]
            assert torch.equal(got, src[name][:, p_table[i], :n]), (name, i)
        # nothing written into a block the layer's group does not hold
        held = {t for t in d_table if t != NO_BLOCK}
        for block in range(NB):
            if block not in held:
                assert torch.all(dst[name][:, block] == GUARD), (name, block)


def test_compressed_groups_decode_alike_on_both_coders(monkeypatch):
    _, host_dst, host_staged, _, _ = roundtrip(monkeypatch, "tq4", False)
    _, cuda_dst, cuda_staged, _, _ = roundtrip(monkeypatch, "tq4", True)
    assert host_staged == cuda_staged
    for name in LAYERS:
        assert torch.equal(host_dst[name], cuda_dst[name]), name
    assert not torch.all(host_dst[LAYERS[0]][:, D_SLIDING[2]] == GUARD)  # something decoded


def test_read_rows_skip_the_chunks_a_load_does_not_need():
    """Zero-byte chunks get no READ row; each pipeline group's rows start where its first
    needed chunk is."""
    blocks = [SimpleNamespace(index=i, num_tokens=BS) for i in range(3)]
    tables = [[1, 2, 3], [NO_BLOCK, NO_BLOCK, 5]]
    held = held_chunks(blocks, tables, [1, 0, 1, 1])
    assert held.tolist() == [[False, False, True], [True, True, True],
                             [False, False, True], [False, False, True]]
    sizes = np.full((4, 3), 100, np.int64) * held
    flat = sizes.reshape(-1)
    ends = flat.cumsum()
    groups = layer_groups(4, 2)
    offsets = ChunkOffsets((ends - flat).reshape(sizes.shape), sizes, groups, [])
    rows = read_rows(offsets, [0, 1, 2], 1000, 0, 0, 4096, [0, 1024, 2048, 3072], 0)
    assert len(rows.local) == int(held.sum()) == 6
    assert rows.group_rows == [0, 4, 6]  # layers 0-1: 1 + 3 rows, layers 2-3: 2 rows
    assert (rows.local[:, 1] == 100).all()
    lo, _ = rows.group(1)
    assert lo[:, 0].tolist() == [1000 + 400, 1000 + 500]  # layer 2's and 3's block 2


# ---- the scheduler side: the tables it hands the workers ------------------------------------
def test_scheduler_hands_every_groups_table_to_both_sides():
    """Prefill: the save carries each group's table (vLLM's null block as ``NO_BLOCK``).
    Decode: a block loads while any group holds it, with every group's table."""
    import test_connector_scheduler as base
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )

    from turbowire.connector.scheduler import TurboWireScheduler

    request, step = base.request, base.step
    vcfg, _, cfg = base._configs()
    names = base.LAYERS
    shape = dict(block_size=base.BS, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    kcfg = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(names[1:], FullAttentionSpec(**shape)),
        KVCacheGroupSpec(names[:1], SlidingWindowSpec(sliding_window=2 * base.BS, **shape))])
    null = KVCacheBlock(0)
    null.is_null = True

    def blocks(*groups):
        return SimpleNamespace(blocks=tuple([null if i is None else KVCacheBlock(i) for i in g]
                                            for g in groups))

    prefill = TurboWireScheduler(vcfg, kcfg, cfg, "engine-P")
    try:
        prefill.bind_kv_cache_manager(SimpleNamespace(
            get_blocks=lambda rid: blocks([7, 8, 9], [None, 20, 21])))
        req = request("r1", 3 * base.BS, {"do_remote_decode": True})
        prefill.on_new_request(req)
        (save,) = step(prefill, {"r1": 3 * base.BS}).saves
        assert save.block_ids == [7, 8, 9]
        assert save.group_tables == [[7, 8, 9], [NO_BLOCK, 20, 21]]
        assert save.table(1) == [NO_BLOCK, 20, 21]
    finally:
        prefill.shutdown()

    decode = TurboWireScheduler(vcfg, kcfg, cfg, "engine-D")
    try:
        n = 4 * base.BS - 4
        req = request("d1", n, base._remote_params(n))
        decode.on_new_request(req)
        assert decode.get_num_new_matched_tokens(req, 0) == (n, True)
        decode.update_state_after_alloc(
            req, blocks([40, 41, 42, 43], [None, None, 50, 51]), n)
        (load,) = step(decode, {}).loads
        assert [b.index for b in load.blocks] == [0, 1, 2, 3]  # the full group holds them all
        assert load.group_tables == [[40, 41, 42, 43], [NO_BLOCK, NO_BLOCK, 50, 51]]
        assert load.block_ids == [40, 41, 42, 43]
    finally:
        decode.shutdown()
