"""The load state machine when the prefill engine runs at another TP size (fake transport and
side channel): one handshake and one set of READs per prefill rank a decode rank reads, each
sized by that rank's chunks (its heads) and decoded through its head window; the load finishes
once every part has, and is released once; one part failing fails the load once and gives back
what the other parts hold. A prefill engine that cuts its chunks into runs of heads
(``decode_tp_size``) is read only where this rank's heads are."""

from __future__ import annotations

from types import SimpleNamespace

from support.fakes import FakeClient, FakeTransport, InlineExecutor

from turbowire.codec import Codec
from turbowire.connector.codecs import staged_nbytes
from turbowire.connector.coder.base import DoneDecode
from turbowire.connector.compat import CompatibilityRecord
from turbowire.connector.config import TurboWireConfig
from turbowire.connector.geometry import KVGeometry, LayerSpec, StagingLayout
from turbowire.connector.loader import KVLoader, LocalEnd
from turbowire.connector.metadata import LoadBlock, LoadRequest, PeerAddress
from turbowire.connector.staging import ByteRanges
from turbowire.connector.stats import TurboWireConnectorStats, iter_counters
from turbowire.connector.tp_plan import ChunkCut, model_kv_heads
from turbowire.connector.transports.base import TransferState
from turbowire.kernels import HeadWindow

BS, LAYERS, HEADS, DIM = 16, 2, 2, 64  # the decode engine: TP 1, both heads
PEER = PeerAddress("prefill-engine", "127.0.0.1", 5700, 2)  # a prefill engine of TP 2


class RankedClient(FakeClient):
    """Records which prefill rank each handshake asked for, and each lease call's TP size."""

    def __init__(self, layout) -> None:
        super().__init__(layout, None)
        self.ranks: list[int] = []
        self.tp_sizes: list[int] = []

    def handshake(self, record, engine_id, tp_rank):
        self.ranks.append(tp_rank)
        return super().handshake(record, engine_id, tp_rank)

    def heartbeat(self, ids, engine_id="", lease_tokens=None, tp_size=0, **claim):
        self.tp_sizes.append(tp_size)
        return super().heartbeat(ids, engine_id, lease_tokens, **claim)

    def release(self, ids, engine_id="", tp_rank=0, lease_tokens=None, tp_size=0):
        self.tp_sizes.append(tp_size)
        return super().release(ids, engine_id, tp_rank, lease_tokens)


def rig(decode_tp: int = 1, rank: int = 0, cut_for: int = 0):
    """A decode rank ``rank`` of a TP ``decode_tp`` engine reading ``PEER`` (TP 2 prefill ranks
    of one head each at ``decode_tp`` 1, else a TP 1 prefill engine of both heads, which cuts
    its chunks for decode engines of TP ``cut_for``)."""
    config = TurboWireConfig.from_extra_config({"preset": "raw", "decode_pipeline_groups": 2},
                                               environ={})
    heads = HEADS // decode_tp
    geo = KVGeometry(tuple(LayerSpec(f"l.{i}", heads, DIM) for i in range(LAYERS)), BS,
                     "bfloat16")
    codec = Codec("raw", DIM, LAYERS)
    record = CompatibilityRecord.build(model="m", geometry=geo, preset="raw",
                                       codec_format_version=1, tp_size=decode_tp,
                                       speculative_config=None,
                                       model_kv_heads=model_kv_heads(geo, decode_tp, HEADS))
    prefill_tp = 2 if decode_tp == 1 else 1
    p_geo = KVGeometry(tuple(LayerSpec(f"l.{i}", HEADS // prefill_tp, DIM)
                             for i in range(LAYERS)), BS, "bfloat16")
    groups = 2 if cut_for == 2 and prefill_tp == 1 else 1
    layout = StagingLayout.build(
        p_geo, lambda layer, t, _h: staged_nbytes(codec, p_geo, layer, t, 0, groups), 1 << 20,
        groups)
    client = RankedClient(layout)
    transport = FakeTransport()
    ranges = ByteRanges(1 << 20)
    decoded: list[tuple[str, tuple[int, ...], ChunkCut | None]] = []

    def decode(load, layers, recv_offset, chunk_offsets, cut=None):
        decoded.append((load.request_id, tuple(layers), cut))
        return DoneDecode(layers)

    def nbytes(layer: int, tokens: int, index: int, h: int | None = None) -> int:
        return codec.encoded_nbytes(layer, tokens, h or heads, index * BS)

    stats = TurboWireConnectorStats()
    local = LocalEnd("decode-engine", rank, record, "DRAM", 1 << 30, 0, 64,
                     2 * heads * DIM * 2 * LAYERS, decode_tp)
    loader = KVLoader(config, geo, layout, nbytes, local, transport,
                      SimpleNamespace(get=lambda host, port: client), ranges, decode,
                      InlineExecutor(), stats)
    return SimpleNamespace(loader=loader, client=client, transport=transport, ranges=ranges,
                           decoded=decoded, stats=stats, nbytes=nbytes, layout=layout)


def request(rid: str = "r1", blocks: int = 3, peer: PeerAddress = PEER) -> LoadRequest:
    return LoadRequest(rid, "remote-" + rid, peer,
                       [LoadBlock(i, 10 + i, BS if i < blocks - 1 else 5, i, 100 + i)
                        for i in range(blocks)],
                       "raw", [10 + i for i in range(blocks)], lease_token="5e" * 16)


def drive(r, steps: int = 20, fail_first: bool = False):
    finished, failed = set(), set()
    for _ in range(steps):
        for i, x in enumerate(r.transport.reads):
            if x.current is TransferState.PENDING:
                x.current = TransferState.FAILED if fail_first and i == 0 else TransferState.DONE
        f, bad = r.loader.results()
        finished |= f
        failed |= bad
        if not r.loader.pending:
            break
    f, bad = r.loader.results()
    return finished | f, failed | bad


def test_each_prefill_rank_is_read_and_decoded_at_its_heads_and_released_once():
    r = rig()
    load = request()
    r.loader.start([load])
    finished, failed = drive(r)
    assert finished == {"r1"} and not failed
    assert sorted(r.client.ranks) == [0, 1]  # a handshake with each prefill rank
    windows = sorted({c.windows[0].dst_start for _, _, c in r.decoded})
    assert windows == [0, 1] and all(c.windows == (HeadWindow(1, 0, 1, c.windows[0].dst_start),)
                                     for _, _, c in r.decoded)
    # every layer decoded once per rank
    assert sorted(layer for _, layers, _ in r.decoded for layer in layers) == [0, 0, 1, 1]
    one_head = sum(r.nbytes(layer, b.num_tokens, b.index, 1) for layer in range(LAYERS)
                   for b in load.blocks)
    report = r.loader.take_reports()["r1"]
    assert report.wire_bytes == 2 * one_head and report.tokens == 2 * BS + 5
    assert r.client.released == ["remote-r1"]  # one release: one decode rank
    assert set(r.client.tp_sizes) == {1}
    assert r.ranges.free_bytes == r.ranges.capacity


def test_one_rank_failing_fails_the_load_once_and_frees_the_other():
    r = rig()
    r.loader.start([request()])
    finished, failed = drive(r, fail_first=True)
    assert failed == {"r1"} and finished == {"r1"}
    failures = {lbl["reason"]: v for n, lbl, v in iter_counters(r.stats.data)
                if n == "failures"}
    assert failures == {"transport": 1}
    assert r.loader.take_reports()["r1"].failed == "transport"
    assert r.client.released == ["remote-r1"]
    assert not r.loader.pending
    assert r.ranges.free_bytes == r.ranges.capacity


def test_a_prefill_engine_that_cuts_its_chunks_is_read_only_where_this_ranks_heads_are():
    """P TP 1 (both heads) staging runs of one head; decode rank 1 of a TP 2 engine reads the
    second run of every chunk: one-head chunks' bytes, from one run into each staged chunk."""
    wide = PeerAddress("prefill-engine", "127.0.0.1", 5700, 1)
    sizes = {}
    for cut_for in (0, 2):
        r = rig(decode_tp=2, rank=1, cut_for=cut_for)
        load = request(peer=wide)
        r.loader.start([load])
        finished, failed = drive(r)
        assert finished == {"r1"} and not failed
        sizes[cut_for] = r.loader.take_reports()["r1"].wire_bytes
        (cut,) = {c for _, _, c in r.decoded}
        if cut_for:
            assert cut == ChunkCut(2, 1, 1, (HeadWindow(1, 0, 1, 0),))
            # each READ row starts one run (a one-head chunk) into its staged chunk
            rows = [row for x in r.transport.reads for row in x.remote.tolist()]
            starts = {(1 << 20) + b.slot * r.layout.slot_bytes + r.layout.layer_offsets[layer]
                      + r.nbytes(layer, b.num_tokens, b.index, 1)
                      for layer in range(LAYERS) for b in load.blocks}
            assert len(rows) == len(starts) and {addr for addr, _n, _d in rows} == starts
        else:
            assert cut == ChunkCut(1, 2, 0, (HeadWindow(2, 1, 1, 0),))
    one_head = sum(r.nbytes(layer, b.num_tokens, b.index, 1) for layer in range(LAYERS)
                   for b in load.blocks)
    assert sizes == {2: one_head, 0: sum(r.nbytes(layer, b.num_tokens, b.index, 2)
                                         for layer in range(LAYERS) for b in load.blocks)}
