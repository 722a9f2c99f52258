"""Prefill and decode engines of other TP sizes: which prefill ranks a decode rank reads and
which heads of their chunks it keeps (``tp_plan``), which pairs the compatibility record lets
exchange KV, and a lease freed once every rank of the decode engine released it."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from turbowire.connector.compat import CompatibilityRecord, IncompatiblePeerError
from turbowire.connector.geometry import KVGeometry, LayerSpec
from turbowire.connector.staging import StagingPool
from turbowire.connector.tp_plan import (
    ChunkCut,
    HeadSource,
    TensorParallelError,
    chunk_cut,
    head_sources,
    load_plan,
    model_kv_heads,
    peer_refusal,
    rank_heads,
    staged_head_groups,
    tp_refusal,
)
from turbowire.kernels import HeadWindow


def test_ranks_hold_heads_as_vllm_shards_them():
    assert [rank_heads(8, 2, r) for r in range(2)] == [range(0, 4), range(4, 8)]
    assert [rank_heads(2, 4, r) for r in range(4)] == [range(0, 1)] * 2 + [range(1, 2)] * 2
    assert rank_heads(1, 8, 7) == range(0, 1)
    with pytest.raises(TensorParallelError, match="do not split"):
        rank_heads(6, 4, 0)


SIZES = [1, 2, 4, 8]


@pytest.mark.parametrize("heads", [1, 2, 4, 8])
@pytest.mark.parametrize("prefill_tp,decode_tp", list(itertools.product(SIZES, SIZES)))
def test_every_decode_rank_gets_exactly_its_heads_from_ranks_that_hold_them(heads, prefill_tp,
                                                                             decode_tp):
    for rank in range(decode_tp):
        want = rank_heads(heads, decode_tp, rank)
        got: list[int] = []
        for src in head_sources(heads, prefill_tp, decode_tp, rank):
            have = rank_heads(heads, prefill_tp, src.prefill_rank)
            assert src.src_heads == len(have)
            assert 0 <= src.src_start and src.src_start + src.count <= src.src_heads
            # the global heads it takes are the ones it writes, in place
            taken = list(have)[src.src_start:src.src_start + src.count]
            assert taken == list(want)[src.dst_start:src.dst_start + src.count]
            got += taken
        assert got == list(want)


def test_replicas_spread_the_reads_over_the_prefill_ranks():
    """2 heads on 4 prefill ranks (each head twice), 2 decode ranks of 1 head each: the two
    decode ranks read different prefill ranks."""
    ranks = [head_sources(2, 4, 2, r)[0].prefill_rank for r in range(2)]
    assert len(set(ranks)) == 2
    assert head_sources(4, 1, 2, 1) == [HeadSource(0, 4, 2, 2, 0, 2)]
    assert head_sources(4, 2, 1, 0) == [HeadSource(0, 2, 0, 2, 0, 4), HeadSource(1, 2, 0, 2, 2, 4)]
    assert not any(s.whole for s in head_sources(4, 2, 1, 0))


def test_an_mla_latent_is_read_whole_from_one_rank():
    assert head_sources(4, 2, 4, 3, replicated=True) == [HeadSource(1, 4, 0, 4, 0, 4)]
    assert head_sources(4, 2, 4, 3, replicated=True)[0].whole


def geometry(heads: int, *, draft: bool = False, rope: int = 0, state: bool = False,
             draft_heads: int = 0) -> KVGeometry:
    layers = [LayerSpec(f"model.layers.{i}.self_attn.attn", heads, 64, rope_dim=rope)
              for i in range(2)]
    if draft:
        layers.append(LayerSpec("model.layers.2.self_attn.attn", draft_heads or heads, 64,
                                is_draft=True))
    if state:
        # a state layer holds no KV heads (as connector.geometry builds it)
        layers.append(LayerSpec("model.layers.3.mixer", 0, 0, group=1, state_bytes=4096))
    return KVGeometry(tuple(layers), 32, "bfloat16")


def record(tp: int, total: int = 4, **kind) -> CompatibilityRecord:
    geo = geometry(max(1, total // tp) if not kind.get("rope") else 4, **kind)
    return CompatibilityRecord.build(model="m", geometry=geo, preset="tq4",
                                     codec_format_version=1, tp_size=tp, speculative_config=None,
                                     model_kv_heads=model_kv_heads(geo, tp, total))


def test_records_of_other_tp_sizes_compare_the_models_heads():
    assert record(1).mismatch(record(2)) is None
    assert record(4).mismatch(record(1)) is None
    assert record(2, total=2).mismatch(record(4, total=2)) is None  # replicated heads
    err = record(1).mismatch(record(2, total=8))
    assert isinstance(err, IncompatiblePeerError) and err.field_name == "model_kv_heads"
    assert load_plan(record(2), 1, 1, replicated=False) == [HeadSource(0, 4, 2, 2, 0, 2)]
    assert load_plan(record(2), 2, 1, replicated=False) == [HeadSource.same_rank(1)]


def test_a_drafter_sharded_as_the_target_moves_at_other_tp_sizes():
    """An EAGLE drafter's attention layer: vLLM shards its heads as the target's, so its chunks
    cut and window like the target's; a drafter of other heads is refused, naming it."""
    ours, theirs = record(1, draft=True), record(2, draft=True)
    assert ours.model_kv_heads == (4, 4, 4) and ours.num_draft_layers == 1
    assert tp_refusal(ours, theirs) is None and ours.mismatch(theirs) is None
    assert peer_refusal(ours, 2) is None
    odd = dataclasses.replace(theirs, kv_heads=(2, 2, 1), model_kv_heads=(4, 4, 0))
    why = tp_refusal(ours, odd)
    assert "layer 2 holds 1 KV heads per rank" in why and "drafter" in why
    older = dataclasses.replace(theirs, model_kv_heads=(4, 4, 0))  # maps no drafter's heads
    assert "older one does not" in tp_refusal(ours, older)


@pytest.mark.parametrize("kind,why", [
    ({"state": True}, "Mamba"),
])
def test_what_other_tp_sizes_cannot_exchange_is_refused_by_name(kind, why):
    ours, theirs = record(1, **kind), record(2, **kind)
    assert why in tp_refusal(ours, theirs)
    err = ours.mismatch(theirs)
    assert err is not None and err.field_name == "tp_size" and why in str(err)
    assert ours.mismatch(dataclasses.replace(ours)) is None  # equal TP sizes: as before
    assert why in peer_refusal(ours, 2)


def test_an_older_peer_or_a_bad_split_is_refused():
    old = dataclasses.replace(record(2), model_kv_heads=())
    assert "predates" in tp_refusal(record(1), old)
    assert "do not split" in tp_refusal(record(1), dataclasses.replace(record(1), tp_size=3))
    assert peer_refusal(record(1), 1) is None
    assert "do not split" in peer_refusal(record(1), 3)


def test_a_layer_holding_another_share_of_heads_is_refused_as_such():
    ours = record(1)
    odd = dataclasses.replace(record(2), kv_heads=(2, 3), model_kv_heads=(4, 0))
    why = tp_refusal(ours, odd)
    assert "layer 1 holds 3 KV heads per rank" in why and "Mamba" not in why
    short = dataclasses.replace(odd, kv_heads=(2,))  # a peer's malformed record
    assert "of 2 layers and a rank's heads of 1" in tp_refusal(ours, short)
    assert ours.mismatch(short) is not None


def test_mla_records_exchange_at_any_tp_size():
    ours, theirs = record(1, rope=64), record(3, rope=64)
    assert ours.rope_dim == 64 and ours.kv_heads == theirs.kv_heads
    assert ours.mismatch(theirs) is None
    assert peer_refusal(ours, 3) is None


def test_a_lease_is_freed_once_every_rank_of_the_decode_engine_released_it():
    pool = StagingPool(8, 30.0)
    pool.reserve("r", 2)
    lease = pool.lease("r", consumers=1)  # a prefill engine of TP 1
    tokens = [lease.token]
    # a decode engine of TP 2: its claim says so; rank 0 alone does not free the lease
    assert pool.heartbeat(["r"], tokens, consumers=2).done == ["r"]
    assert pool.release(["r"], 0, tokens, consumers=2).done == ["r"]
    assert pool.has_lease("r")
    assert pool.release(["r"], 1, tokens, consumers=2).done == ["r"]
    assert not pool.has_lease("r")
    # a decode engine of TP 1 reading a TP 2 prefill engine releases once
    pool.reserve("s", 1)
    lease = pool.lease("s", consumers=2)
    assert pool.release(["s"], 0, [lease.token], consumers=1).done == ["s"]
    assert not pool.has_lease("s")
    # a call without the lease's token sets nothing
    pool.reserve("t", 1)
    lease = pool.lease("t", consumers=2)
    assert pool.release(["t"], 0, ["wrong"], consumers=1).refused == ["t"]
    assert pool.release(["t"], 0, [lease.token]).done == ["t"] and pool.has_lease("t")


def test_a_prefill_engine_cuts_its_chunks_for_the_decode_engines_tp_size():
    from turbowire.connector.config import ConnectorConfigError
    from turbowire.connector.spec import head_groups

    assert [staged_head_groups(d, 1, 4) for d in (0, 1, 2, 4, 8)] == [1, 1, 2, 4, 4]
    assert staged_head_groups(4, 2, 2) == 2 and staged_head_groups(2, 2, 2) == 1
    assert head_groups(geometry(4), 2, 1) == 2
    assert head_groups(geometry(4, rope=64), 8, 1) == 1  # an MLA latent moves whole
    with pytest.raises(ConnectorConfigError, match="not a multiple"):
        head_groups(geometry(4), 3, 2)
    with pytest.raises(ConnectorConfigError, match="do not split"):
        head_groups(geometry(3), 2, 1)
    mixed = KVGeometry((LayerSpec("model.layers.0.self_attn.attn", 2, 64),
                        LayerSpec("model.layers.1.self_attn.attn", 4, 64)), 32, "bfloat16")
    with pytest.raises(ConnectorConfigError, match="different KV head counts"):
        head_groups(mixed, 2, 1)


def test_a_decode_rank_reads_the_runs_of_heads_holding_its_own():
    # P TP 1 of 4 heads cut in 2 runs; D TP 2: rank 1 reads the second run, whole
    (src,) = head_sources(4, 1, 2, 1)
    assert chunk_cut(src, 2, 2) == ChunkCut(2, 2, 1, (HeadWindow(2, 0, 2, 0),))
    # cut in 4 (for D TP 4), read by D TP 2: two runs of one head, side by side
    assert chunk_cut(src, 4, 2) == ChunkCut(4, 1, 2, (HeadWindow(1, 0, 1, 0),
                                                      HeadWindow(1, 0, 1, 1)))
    # equal TP sizes: every run, each at its place; uncut: the whole chunk, in place
    assert chunk_cut(HeadSource.same_rank(0), 2, 4).windows == (HeadWindow(2, 0, 2, 0),
                                                                 HeadWindow(2, 0, 2, 2))
    assert chunk_cut(HeadSource.same_rank(0), 1, 4) is None
    # a peer's number of runs that does not divide its chunk's heads is refused
    with pytest.raises(TensorParallelError):
        chunk_cut(src, 3, 2)
