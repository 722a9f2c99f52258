"""The load state machine when the prefill engine runs at another TP size (fake transport and
side channel): one handshake and one set of READs per prefill rank a decode rank reads, each
sized by that rank's chunks (its heads) and decoded through its head window; the load finishes
once every part has, and is released once; one part failing fails the load once and gives back
what the other parts hold."""

from __future__ import annotations

from types import SimpleNamespace

from support.fakes import FakeClient, FakeTransport, InlineExecutor

from turbowire.codec import Codec
from turbowire.connector.coder.base import DoneDecode
from turbowire.connector.compat import CompatibilityRecord
from turbowire.connector.config import TurboWireConfig
from turbowire.connector.geometry import KVGeometry, LayerSpec, StagingLayout
from turbowire.connector.loader import KVLoader, LocalEnd
from turbowire.connector.metadata import LoadBlock, LoadRequest, PeerAddress
from turbowire.connector.staging import ByteRanges
from turbowire.connector.stats import TurboWireConnectorStats, iter_counters
from turbowire.connector.tp_plan import model_kv_heads
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


def rig():
    config = TurboWireConfig.from_extra_config({"preset": "raw", "decode_pipeline_groups": 2},
                                               environ={})
    geo = KVGeometry(tuple(LayerSpec(f"l.{i}", HEADS, DIM) for i in range(LAYERS)), BS, "bfloat16")
    codec = Codec("raw", DIM, LAYERS)
    record = CompatibilityRecord.build(model="m", geometry=geo, preset="raw",
                                       codec_format_version=1, tp_size=1,
                                       speculative_config=None,
                                       model_kv_heads=model_kv_heads(geo, 1, HEADS))
    layout = StagingLayout.build(geo, codec.encoded_nbytes, 1 << 20)
    client = RankedClient(layout)
    transport = FakeTransport()
    ranges = ByteRanges(1 << 20)
    decoded: list[tuple[str, tuple[int, ...], HeadWindow | None]] = []

    def decode(load, layers, recv_offset, chunk_offsets, heads=None):
        decoded.append((load.request_id, tuple(layers), heads))
        return DoneDecode(layers)

    def nbytes(layer: int, tokens: int, index: int, heads: int | None = None) -> int:
        return codec.encoded_nbytes(layer, tokens, heads or HEADS, index * BS)

    stats = TurboWireConnectorStats()
    local = LocalEnd("decode-engine", 0, record, "DRAM", 1 << 30, 0, 64,
                     2 * HEADS * DIM * 2 * LAYERS, 1)
    loader = KVLoader(config, geo, layout, nbytes, local, transport,
                      SimpleNamespace(get=lambda host, port: client), ranges, decode,
                      InlineExecutor(), stats)
    return SimpleNamespace(loader=loader, client=client, transport=transport, ranges=ranges,
                           decoded=decoded, stats=stats, nbytes=nbytes)


def request(rid: str = "r1", blocks: int = 3) -> LoadRequest:
    return LoadRequest(rid, "remote-" + rid, PEER,
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
    windows = sorted({w.dst_start for _, _, w in r.decoded})
    assert windows == [0, 1] and all(w == HeadWindow(1, 0, 1, w.dst_start)
                                     for _, _, w in r.decoded)
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
