"""Prefill and decode workers of other TP sizes through the workers' own calls (CPU caches, the
host coder): a prefill rank stages chunks of its own heads; a decode rank decodes the window of
them that is its own (``HeadWindow``) at its heads' place. Every chunk codes each head on its
own, so the decode ranks end up with exactly the KV an equal-TP load writes, bit for bit, for
each preset tested; and nothing else of their caches changes."""

from __future__ import annotations

import pytest
import torch
from support.fakes import load_request, save_request
from support.fakes import make_worker as build_worker

from turbowire.connector.coder import ChunkOffsets
from turbowire.connector.metadata import PeerAddress, TurboWireConnectorMetadata
from turbowire.connector.read_plan import chunk_sizes, layer_groups
from turbowire.connector.tp_plan import head_sources
from turbowire.kernels import HeadWindow

BS, DIM, NB, HEADS = 16, 64, 10, 4
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
TOKENS = 3 * BS - 7
P_IDS, D_IDS = [2, 8, 5], [7, 1, 9]
GUARD = 5.0


def worker(monkeypatch, preset: str, engine_id: str, heads: int, caches: dict):
    w = build_worker(monkeypatch, {"preset": preset, "staging_bytes": "1MiB"}, LAYERS,
                     block_size=BS, num_kv_heads=heads, head_size=DIM, num_blocks=NB,
                     engine_id=engine_id)
    w.register_kv_caches(caches)
    return w


def model_caches(seed: int) -> dict:
    """The whole model's KV: [2, blocks, bs, all heads, dim] per layer."""
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn((2, NB, BS, HEADS, DIM), generator=g).to(torch.bfloat16)
            for n in LAYERS}


def shard(caches: dict, tp: int, rank: int) -> dict:
    per = HEADS // tp
    return {n: t[:, :, :, rank * per:(rank + 1) * per].contiguous() for n, t in caches.items()}


def guards(heads: int) -> dict:
    return {n: torch.full((2, NB, BS, heads, DIM), GUARD, dtype=torch.bfloat16) for n in LAYERS}


def stage(monkeypatch, preset: str, tp: int, src: dict) -> list:
    """The prefill ranks of a ``tp`` engine, each with its heads' chunks staged."""
    ranks = []
    for rank in range(tp):
        p = worker(monkeypatch, preset, f"p{rank}", HEADS // tp, shard(src, tp, rank))
        p.wait_for_save(TurboWireConnectorMetadata(saves=[save_request("a", P_IDS, TOKENS, BS)]))
        ranks.append(p)
    return ranks


def load_into(d, prefill: list, preset: str, prefill_tp: int, decode_tp: int, rank: int) -> None:
    """What the loader does for decode rank ``rank``: each source's chunks landed in the receive
    buffer one after the other, each decoded through its head window."""
    save = save_request("a", P_IDS, TOKENS, BS)
    load = load_request("d", save, D_IDS, preset, PeerAddress("p", "h", 1, prefill_tp))
    base = 0
    for src in head_sources(HEADS, prefill_tp, decode_tp, rank):
        heads = None if prefill_tp == decode_tp else src.src_heads
        sizes = chunk_sizes(load.blocks, len(LAYERS),
                            lambda layer, t, i: d.chunk_nbytes(layer, t, i, heads))
        flat = sizes.reshape(-1)
        offsets = ChunkOffsets((flat.cumsum() - flat).reshape(sizes.shape), sizes,
                               layer_groups(len(LAYERS), 2), [])
        p = prefill[src.prefill_rank]
        for layer in range(len(LAYERS)):
            for bi, b in enumerate(load.blocks):
                off, size = offsets[(bi, layer)]
                at = p.layout.chunk_offset(b.slot, layer)
                d.recv[base + off:base + off + size] = p.staging[at:at + size]
        window = None if src.whole else HeadWindow(src.src_heads, src.src_start, src.count,
                                                   src.dst_start)
        for layers in offsets.groups:
            d.coder.decode(load, layers, base, offsets, heads=window).result()
        base += int(flat.sum())


@pytest.mark.parametrize("preset", ["raw", "tq4", "k8v4", "tq3"])
@pytest.mark.parametrize("prefill_tp,decode_tp", [(1, 2), (2, 1), (1, 4), (4, 2)])
def test_other_tp_sizes_load_what_an_equal_tp_load_writes(monkeypatch, preset, prefill_tp,
                                                           decode_tp):
    src = model_caches(3)
    # the reference: prefill and decode at TP 1, every head in one chunk
    ref = guards(HEADS)
    one = worker(monkeypatch, preset, "ref", HEADS, ref)
    load_into(one, stage(monkeypatch, preset, 1, src), preset, 1, 1, 0)

    prefill = stage(monkeypatch, preset, prefill_tp, src)
    per = HEADS // decode_tp
    for rank in range(decode_tp):
        dst = guards(per)
        d = worker(monkeypatch, preset, f"d{rank}", per, dst)
        load_into(d, prefill, preset, prefill_tp, decode_tp, rank)
        for n in LAYERS:
            want = ref[n][:, :, :, rank * per:(rank + 1) * per]
            assert torch.equal(dst[n], want), (n, rank)
            if preset == "raw":  # and raw is the prefill engine's KV itself
                got = dst[n][:, D_IDS].reshape(2, -1, per, DIM)[:, :TOKENS]
                kv = src[n][:, P_IDS, :, rank * per:(rank + 1) * per].reshape(2, -1, per, DIM)
                assert torch.equal(got, kv[:, :TOKENS]), (n, rank)
