"""A hybrid model's Mamba / gated-delta-net layers through the worker's own calls (CPU caches,
the host coder): the prefill side stages each state layer's chunk only from the block its group's
table keeps (the state at the prompt's end), the decode side writes it, byte for byte, into its
own block and nowhere else, and the attention layers move as before, a partial block's slots past
the loaded tokens cleared (vLLM zeroes such a model's new blocks, but not those a connector
loads). The CUDA coder's plans code K/V only: such a model gets the host coder."""

from __future__ import annotations

import pytest
import torch
from support.fakes import load_request, save_request
from support.fakes import make_worker as build_worker

from bench.gpu_path.fakes import STATE_BYTES
from turbowire.connector.coder import ChunkOffsets
from turbowire.connector.geometry import keep_state_blocks
from turbowire.connector.metadata import PeerAddress, TurboWireConnectorMetadata
from turbowire.connector.read_plan import chunk_sizes, held_chunks, layer_groups
from turbowire.kernels import NO_BLOCK

BS, HEADS, DIM, NB = 16, 1, 64, 12
ATTN = [f"model.layers.{i}.self_attn.attn" for i in (1, 3)]
GDN = tuple(f"model.layers.{i}.linear_attn" for i in (0, 2))
PAGE = 4096  # vLLM pads a state page to an attention page
TOKENS = 3 * BS - 5  # 3 blocks, the last one partial
P_ATTN, P_STATE = [3, 7, 1], [NO_BLOCK, 5, 2]  # prefill: the state in block 2 (position 2)
D_ATTN, D_STATE = [4, 11, 6], [NO_BLOCK, NO_BLOCK, 9]


def worker(monkeypatch, preset: str, engine_id: str, caches: dict):
    w = build_worker(monkeypatch, {"preset": preset, "staging_bytes": "1MiB"}, ATTN + list(GDN),
                     block_size=BS, num_kv_heads=HEADS, head_size=DIM, num_blocks=NB,
                     engine_id=engine_id, state=GDN)
    w.register_kv_caches(caches)
    return w


def caches(seed: int) -> dict:
    """Attention in vLLM's GPU layout; each state layer as vLLM hands it to a connector: an int8
    view of every block's state bytes inside a padded page."""
    g = torch.Generator().manual_seed(seed)
    out = {n: torch.randn((2, NB, BS, HEADS, DIM), generator=g).to(torch.bfloat16)
           for n in ATTN}
    for n in GDN:
        pages = torch.randint(-128, 127, (NB, PAGE), dtype=torch.int8, generator=g)
        out[n] = pages[:, :STATE_BYTES].view(NB, 1, 1, STATE_BYTES)
    return out


def test_the_state_at_the_prompts_end_moves_into_the_decode_engines_block(monkeypatch):
    src = caches(1)
    p = worker(monkeypatch, "tq4", "p", src)
    assert p.coder.__class__.__name__ == "HostCoder"
    assert [layer.is_state for layer in p.geometry.layers] == [False, False, True, True]
    state_group = p.geometry.layers[2].group
    save = save_request("a", P_ATTN, TOKENS, BS)
    tables = {p.geometry.layers[0].group: P_ATTN, state_group: P_STATE}
    # the scheduler's reduction: only the state block of the prompt's last position is kept
    save.group_tables = keep_state_blocks([tables[0], tables[1]], frozenset({state_group}), 3)
    assert save.group_tables[state_group] == [NO_BLOCK, NO_BLOCK, 2]
    before = p.staging.clone()
    p.wait_for_save(TurboWireConnectorMetadata(saves=[save]))
    for layer in (2, 3):
        for b in save.blocks:
            at, room = p.layout.chunk_offset(b.slot, layer), p.layout.full_chunk_bytes[layer]
            touched = not torch.equal(p.staging[at:at + room], before[at:at + room])
            assert touched == (b.index == 2), (layer, b.index)

    dst = caches(2)
    d = worker(monkeypatch, "tq4", "d", dst)
    untouched = {n: dst[n].clone() for n in GDN}
    load = load_request("d", save, D_ATTN, "tq4", PeerAddress("p", "h", 1, 1))
    d_tables = {d.geometry.layers[0].group: D_ATTN, state_group: D_STATE}
    load.group_tables = [d_tables[0], d_tables[1]]
    sizes = chunk_sizes(load.blocks, 4, d.chunk_nbytes)
    sizes *= held_chunks(load.blocks, load.group_tables, [x.group for x in d.geometry.layers])
    flat = sizes.reshape(-1)
    offsets = ChunkOffsets((flat.cumsum() - flat).reshape(sizes.shape), sizes,
                           layer_groups(4, 2), [])
    for layer in range(4):
        for bi, b in enumerate(load.blocks):
            off, size = offsets[(bi, layer)]
            at = p.layout.chunk_offset(b.slot, layer)
            d.recv[off:off + size] = p.staging[at:at + size]
    for layers in offsets.groups:
        d.coder.decode(load, layers, 0, offsets).result()
    for n in GDN:
        assert torch.equal(dst[n][9], src[n][2]), n  # byte for byte
        others = [b for b in range(NB) if b != 9]
        assert torch.equal(dst[n][others], untouched[n][others]), n
    for n in ATTN:  # the partial block's slots past the loaded tokens are cleared
        assert not dst[n][:, D_ATTN[2], TOKENS - 2 * BS:].any(), n
        assert dst[n][:, D_ATTN[2], :TOKENS - 2 * BS].any(), n


def test_a_corrupted_state_chunk_fails_the_load_and_writes_nothing(monkeypatch):
    from turbowire.codec.errors import ChecksumError

    src = caches(1)
    p = worker(monkeypatch, "raw", "p", src)
    state_group = p.geometry.layers[2].group
    save = save_request("a", P_ATTN, TOKENS, BS)
    save.group_tables = keep_state_blocks([P_ATTN, P_STATE] if state_group else
                                          [P_STATE, P_ATTN], frozenset({state_group}), 3)
    p.wait_for_save(TurboWireConnectorMetadata(saves=[save]))
    dst = caches(2)
    d = worker(monkeypatch, "raw", "d", dst)
    kept = dst[GDN[0]].clone()
    load = load_request("d", save, D_ATTN, "raw", PeerAddress("p", "h", 1, 1))
    load.group_tables = [D_ATTN, D_STATE] if state_group else [D_STATE, D_ATTN]
    size = d.chunk_nbytes(2, BS, 2)
    last = load.blocks[-1]
    at = p.layout.chunk_offset(last.slot, 2)
    d.recv[:size] = p.staging[at:at + size]
    d.recv[100] ^= 1
    sizes = torch.zeros((4, len(load.blocks)), dtype=torch.int64).numpy()
    sizes[2, -1] = size
    offsets = ChunkOffsets(sizes * 0, sizes, [range(2, 3)], [])
    with pytest.raises(ChecksumError):
        d.coder.decode(load, range(2, 3), 0, offsets).result()
    assert torch.equal(dst[GDN[0]], kept)


def test_the_cuda_coder_is_not_chosen_for_state_layers(monkeypatch):
    w = worker(monkeypatch, "tq4", "w", caches(1))
    with pytest.raises(ValueError, match="state layers"):
        w.make_coder("cuda")
