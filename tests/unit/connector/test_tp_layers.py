"""Prefill and decode workers of other TP sizes through the workers' own calls (CPU caches, the
host coder): a prefill rank stages chunks of its own heads, cut into runs of heads when it is
told the decode engines' TP size (``decode_tp_size``); a decode rank reads the runs holding its
heads (all of the chunk when it is not cut) and decodes its window of them at its heads' place
(``tp_plan.ChunkCut``). Every chunk codes each head on its own, so the decode ranks end up with
exactly the KV an equal-TP load writes, bit for bit, for each preset tested; nothing else of
their caches changes; and with the chunks cut, a decode rank reads exactly its heads' chunks."""

from __future__ import annotations

import pytest
import torch
from support.fakes import load_request, save_request
from support.fakes import make_worker as build_worker

from turbowire.connector.coder import ChunkOffsets
from turbowire.connector.metadata import PeerAddress, TurboWireConnectorMetadata
from turbowire.connector.read_plan import chunk_sizes, cut_chunk_sizes, layer_groups
from turbowire.connector.tp_plan import chunk_cut, head_sources, staged_head_groups

BS, DIM, NB, HEADS = 16, 64, 10, 4
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
TOKENS = 3 * BS - 7
P_IDS, D_IDS = [2, 8, 5], [7, 1, 9]
GUARD = 5.0


def worker(monkeypatch, preset: str, engine_id: str, heads: int, caches: dict,
           tp: int = 1, decode_tp: int = 0):
    w = build_worker(monkeypatch, {"preset": preset, "staging_bytes": "1MiB",
                                   "decode_tp_size": decode_tp}, LAYERS,
                     block_size=BS, num_kv_heads=heads, head_size=DIM, num_blocks=NB,
                     engine_id=engine_id, tp_size=tp)
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


def stage(monkeypatch, preset: str, tp: int, src: dict, decode_tp: int = 0) -> list:
    """The prefill ranks of a ``tp`` engine, each with its heads' chunks staged (cut for
    decode engines of TP ``decode_tp`` when larger)."""
    ranks = []
    for rank in range(tp):
        p = worker(monkeypatch, preset, f"p{rank}", HEADS // tp, shard(src, tp, rank), tp,
                   decode_tp)
        p.wait_for_save(TurboWireConnectorMetadata(saves=[save_request("a", P_IDS, TOKENS, BS)]))
        ranks.append(p)
    return ranks


def load_into(d, prefill: list, preset: str, prefill_tp: int, decode_tp: int, rank: int,
              prepare: bool = False) -> int:
    """What the loader does for decode rank ``rank``: of each source, the staged bytes its cut
    names landed in the receive buffer one source after the other, each decoded through its
    cut. The bytes read."""
    save = save_request("a", P_IDS, TOKENS, BS)
    load = load_request("d", save, D_IDS, preset, PeerAddress("p", "h", 1, prefill_tp))
    base = 0
    for src in head_sources(HEADS, prefill_tp, decode_tp, rank):
        p = prefill[src.prefill_rank]
        cut = chunk_cut(src, p.layout.head_groups, d.geometry.max_kv_heads)
        heads = None if prefill_tp == decode_tp else src.src_heads
        if cut is None:
            sizes = chunk_sizes(load.blocks, len(LAYERS),
                                lambda layer, t, i: d.chunk_nbytes(layer, t, i, heads))
            skip = sizes * 0
        else:
            sizes, skip = cut_chunk_sizes(
                load.blocks, lambda layer, t, i: d.chunk_nbytes(layer, t, i, heads),
                lambda layer, t, i: d.chunk_nbytes(layer, t, i, cut.sub_heads),
                [True] * len(LAYERS), cut.first, cut.parts)
        flat = sizes.reshape(-1)
        offsets = ChunkOffsets((flat.cumsum() - flat).reshape(sizes.shape), sizes,
                               layer_groups(len(LAYERS), 2), [])
        for layer in range(len(LAYERS)):
            for bi, b in enumerate(load.blocks):
                off, size = offsets[(bi, layer)]
                at = p.layout.chunk_offset(b.slot, layer) + int(skip[layer, bi])
                d.recv[base + off:base + off + size] = p.staging[at:at + size]
        if prepare:  # the loader's hook once the READs are posted
            d.coder.prepare_load(load, base, offsets, cut=cut)
        for layers in offsets.groups:
            d.coder.decode(load, layers, base, offsets, cut=cut).result()
        base += int(flat.sum())
    return base


def its_heads_bytes(d, per: int) -> int:
    """The bytes of this rank's heads' chunks: one per layer and block."""
    return sum(d.chunk_nbytes(layer, min(BS, TOKENS - i * BS), i, per)
               for layer in range(len(LAYERS)) for i in range(len(P_IDS)))


@pytest.mark.parametrize("preset", ["raw", "tq4", "k8v4", "tq3"])
@pytest.mark.parametrize("prefill_tp,decode_tp,cut_for", [
    (1, 2, 0), (2, 1, 0), (1, 4, 0), (4, 2, 0),
    # the prefill engine told the decode engines' TP size: its chunks cut per their heads
    (1, 2, 2), (1, 4, 4), (2, 4, 4), (1, 1, 2), (2, 1, 4), (1, 4, 2)])
def test_other_tp_sizes_load_what_an_equal_tp_load_writes(monkeypatch, preset, prefill_tp,
                                                           decode_tp, cut_for):
    src = model_caches(3)
    # the reference: prefill and decode at TP 1, every head in one chunk
    ref = guards(HEADS)
    one = worker(monkeypatch, preset, "ref", HEADS, ref)
    load_into(one, stage(monkeypatch, preset, 1, src), preset, 1, 1, 0)

    prefill = stage(monkeypatch, preset, prefill_tp, src, cut_for)
    per = HEADS // decode_tp
    for rank in range(decode_tp):
        dst = guards(per)
        d = worker(monkeypatch, preset, f"d{rank}", per, dst, decode_tp)
        read = load_into(d, prefill, preset, prefill_tp, decode_tp, rank)
        for n in LAYERS:
            want = ref[n][:, :, :, rank * per:(rank + 1) * per]
            assert torch.equal(dst[n], want), (n, rank)
            if preset == "raw":  # and raw is the prefill engine's KV itself
                got = dst[n][:, D_IDS].reshape(2, -1, per, DIM)[:, :TOKENS]
                kv = src[n][:, P_IDS, :, rank * per:(rank + 1) * per].reshape(2, -1, per, DIM)
                assert torch.equal(got, kv[:, :TOKENS]), (n, rank)
        if decode_tp > prefill_tp:  # the runs of heads holding this rank's (whole chunks
            # when not cut): exactly its heads' chunks when cut for this decode TP size
            run = HEADS // prefill_tp // staged_head_groups(cut_for, prefill_tp,
                                                            HEADS // prefill_tp)
            assert read == max(1, per // run) * its_heads_bytes(d, run)
            if cut_for == decode_tp:
                assert read == its_heads_bytes(d, per)


@pytest.mark.parametrize("preset", ["raw", "tq4"])
@pytest.mark.parametrize("prefill_tp,decode_tp,cut_for", [
    (1, 2, 0), (2, 1, 0), (4, 2, 0), (1, 2, 2), (1, 4, 4), (2, 4, 4)])
def test_the_cuda_coder_loads_other_tp_sizes_through_its_prepared_plans(
        monkeypatch, preset, prefill_tp, decode_tp, cut_for):
    """A decode rank on a GPU reading a prefill rank of another TP size: the CUDA coder's
    decode plans, one per head window, prepared while the bytes move (Triton's interpreter
    here; the per-item host path is not taken), write what the host coder writes."""
    from support.fakes import use_cuda_coder

    from turbowire.connector.coder import host

    def no_item_path(*args, **kwargs):
        raise AssertionError("the CUDA coder took the per-item decode")

    src = model_caches(5)
    prefill = stage(monkeypatch, preset, prefill_tp, src, cut_for)
    per = HEADS // decode_tp
    wants = []
    for rank in range(decode_tp):  # the host coder's loads
        wants.append(guards(per))
        load_into(worker(monkeypatch, preset, f"h{rank}", per, wants[-1], decode_tp), prefill,
                  preset, prefill_tp, decode_tp, rank)
    monkeypatch.setattr(host, "decode_landed", no_item_path)
    for rank, want in enumerate(wants):
        got = guards(per)
        d = worker(monkeypatch, preset, f"g{rank}", per, got, decode_tp)
        use_cuda_coder(d)
        load_into(d, prefill, preset, prefill_tp, decode_tp, rank, prepare=True)
        for n in LAYERS:
            assert torch.equal(got[n], want[n]), (n, rank)


def test_a_corrupt_chunk_through_a_head_window_is_refused_as_the_reference_refuses(
        monkeypatch):
    """The windowed plans verify each chunk before writing it, like the item path: a flipped
    body byte of a prefill rank's chunk fails the load with the reference's exception."""
    from support.fakes import use_cuda_coder

    from turbowire.codec import ChecksumError

    prefill = stage(monkeypatch, "tq4", 1, model_caches(6))
    p = prefill[0]
    save = save_request("a", P_IDS, TOKENS, BS)
    p.staging[p.layout.chunk_offset(save.blocks[1].slot, 1) + 80] ^= 0x11
    d = worker(monkeypatch, "tq4", "g", HEADS // 2, guards(HEADS // 2), 2)
    use_cuda_coder(d)
    with pytest.raises(ChecksumError):
        load_into(d, prefill, "tq4", 1, 2, 1, prepare=True)


@pytest.mark.parametrize("preset", ["raw", "tq4", "k8v4"])
@pytest.mark.parametrize("prefill_tp,cut_for", [(1, 2), (1, 4), (2, 4)])
def test_the_cuda_coder_stages_the_runs_the_host_coder_stages(monkeypatch, preset, prefill_tp,
                                                               cut_for):
    """A prefill engine with ``decode_tp_size`` on a GPU: the CUDA coder's Triton plans stage
    each chunk as runs of heads (``EncodeLayersPlan(head_groups=)``; Triton's interpreter here),
    byte for byte what the host coder stages, and report the same wire bytes."""
    from support.fakes import use_cuda_coder

    from turbowire.connector.metadata import TurboWireConnectorMetadata as Meta

    src = model_caches(4)
    host = stage(monkeypatch, preset, prefill_tp, src, cut_for)
    for rank in range(prefill_tp):
        p = worker(monkeypatch, preset, f"c{rank}", HEADS // prefill_tp,
                   shard(src, prefill_tp, rank), prefill_tp, cut_for)
        use_cuda_coder(p)
        save = save_request("a", P_IDS, TOKENS, BS)
        meta = Meta(saves=[save])
        for layer in range(len(LAYERS)):
            p.coder.save_layer(layer, meta)
        tokens, wire = p.coder.finish_save(meta)
        assert p.layout.head_groups > 1
        h = host[rank]
        assert tokens == TOKENS
        assert wire == sum(h.chunk_nbytes(layer, min(BS, TOKENS - i * BS), i, run)
                           for layer in range(len(LAYERS)) for i in range(len(P_IDS))
                           for run in [HEADS // prefill_tp // p.layout.head_groups]
                           ) * p.layout.head_groups
        for b in save.blocks:
            for layer in range(len(LAYERS)):
                at = p.layout.chunk_offset(b.slot, layer)
                size = p.layout.full_chunk_bytes[layer]
                assert torch.equal(p.staging[at:at + size], h.staging[at:at + size]), (b, layer)


@pytest.mark.parametrize("preset", ["raw", "tq4"])
def test_a_decode_engine_unaware_of_the_cut_is_refused_with_nothing_written(monkeypatch, preset):
    """A decode engine that does not know the prefill engine cut its chunks (as an older
    turbowire, which ignores the handshake's ``head_groups``) reads whole-chunk sizes: the
    first run's header names fewer heads than its cache holds, so the decode refuses the chunk
    and writes nothing (the load fails and vLLM recomputes those blocks)."""
    from turbowire.errors import TurboWireError

    src = model_caches(5)
    (p,) = stage(monkeypatch, preset, 1, src, decode_tp=2)
    assert p.layout.head_groups == 2
    dst = guards(HEADS)
    before = {n: t.clone() for n, t in dst.items()}
    d = worker(monkeypatch, preset, "old", HEADS, dst)
    save = save_request("a", P_IDS, TOKENS, BS)
    load = load_request("d", save, D_IDS, preset, PeerAddress("p", "h", 1, 1))
    sizes = chunk_sizes(load.blocks, len(LAYERS), d.chunk_nbytes)  # whole chunks, uncut
    flat = sizes.reshape(-1)
    offsets = ChunkOffsets((flat.cumsum() - flat).reshape(sizes.shape), sizes,
                           layer_groups(len(LAYERS), 1), [])
    for layer in range(len(LAYERS)):
        for bi, b in enumerate(load.blocks):
            off, size = offsets[(bi, layer)]
            at = p.layout.chunk_offset(b.slot, layer)
            d.recv[off:off + size] = p.staging[at:at + size]
    with pytest.raises(TurboWireError, match="heads"):
        for layers in offsets.groups:
            d.coder.decode(load, layers, 0, offsets).result()
    for n in LAYERS:
        assert torch.equal(dst[n], before[n]), n
