"""The decode side's load state machine with a fake transport and fake side-channel clients:
the order of handshake, claim, READs and decode; timeouts; a refused claim; a failed group; a
receive range quarantined while a READ may still write; late completions; failure reasons."""

from __future__ import annotations

import dataclasses
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
from support.fakes import FakeClient, FakeTransfer, FakeTransport, InlineExecutor

from turbowire.codec import Codec
from turbowire.connector.coder.base import DoneDecode
from turbowire.connector.config import TurboWireConfig
from turbowire.connector.geometry import KVGeometry, LayerSpec, StagingLayout
from turbowire.connector.loader import KVLoader, LocalEnd
from turbowire.connector.metadata import LoadBlock, LoadRequest, PeerAddress
from turbowire.connector.sidechannel.client import PeerTimeoutError
from turbowire.connector.staging import ByteRanges
from turbowire.connector.stats import TurboWireConnectorStats, iter_counters
from turbowire.connector.transports.base import TransferState
from turbowire.kernels import BlockIndexError

BS, LAYERS, HEADS, DIM = 16, 4, 2, 64
PEER = PeerAddress("prefill-engine", "127.0.0.1", 5700, 1)


@dataclass
class Rig:
    loader: KVLoader
    transport: FakeTransport
    client: FakeClient
    ranges: ByteRanges
    decoded: list[tuple[str, tuple[int, ...]]]
    stats: TurboWireConnectorStats

    def failures(self) -> dict[str, float]:
        return {lbl["reason"]: v for n, lbl, v in iter_counters(self.stats.data) if n == "failures"}


def rig(decode_error: BaseException | None = None, recv_bytes: int = 1 << 20, **cfg) -> Rig:
    config = TurboWireConfig.from_extra_config(
        {"preset": "raw", "decode_pipeline_groups": 4, **cfg}, environ={}
    )
    geo = KVGeometry(tuple(LayerSpec(f"l.{i}", HEADS, DIM) for i in range(LAYERS)), BS, "bfloat16")
    codec = Codec("raw", DIM, LAYERS)
    layout = StagingLayout.build(geo, codec.encoded_nbytes, 1 << 20)
    client = FakeClient(layout, None)
    transport = FakeTransport()
    ranges = ByteRanges(recv_bytes)
    decoded: list[tuple[str, tuple[int, ...]]] = []

    def decode(load, layers, recv_offset, chunk_offsets):
        if decode_error is not None:
            raise decode_error
        decoded.append((load.request_id, tuple(layers)))
        return DoneDecode(layers)

    def nbytes(layer: int, tokens: int, index: int) -> int:
        return codec.encoded_nbytes(layer, tokens, HEADS, index * BS)

    stats = TurboWireConnectorStats()
    local = LocalEnd("decode-engine", 0, None, "DRAM", 1 << 30, 0, 64, 2 * HEADS * DIM * 2 * LAYERS)
    clients = SimpleNamespace(get=lambda host, port: client)
    loader = KVLoader(config, geo, layout, nbytes, local, transport, clients, ranges, decode,
                      InlineExecutor(), stats)
    return Rig(loader, transport, client, ranges, decoded, stats)


LEASE_TOKEN = "5e" * 16


def request(rid: str = "r1", blocks: int = 3) -> LoadRequest:
    return LoadRequest(
        rid, "remote-" + rid, PEER,
        [LoadBlock(i, 10 + i, BS if i < blocks - 1 else 5, i, 100 + i) for i in range(blocks)],
        "raw", [10 + i for i in range(blocks)], lease_token=LEASE_TOKEN,
    )


def drive(r: Rig, steps: int = 20, land: bool = True) -> tuple[set[str], set[str]]:
    """Poll like vLLM does each step; every posted READ lands by the next poll if ``land``."""
    finished: set[str] = set()
    failed: set[str] = set()
    for _ in range(steps):
        if land:
            for x in r.transport.reads:
                if x.current is TransferState.PENDING:
                    x.current = TransferState.DONE
        f, bad = r.loader.results()
        finished |= f
        failed |= bad
        if not r.loader.pending:
            break
    # the next step (vLLM keeps stepping the loaded request): completed loads' releases and
    # metrics go out there
    f, bad = r.loader.results()
    return finished | f, failed | bad


def test_a_load_handshakes_claims_reads_in_groups_decodes_in_order_and_releases():
    r = rig()
    r.loader.start([request()])
    assert r.client.calls[:1] == ["handshake"]
    finished, failed = drive(r)
    assert finished == {"r1"} and not failed
    # the two READs in flight land by the next poll: decoded in one call; that poll found the
    # link idle, so groups 2-3 went out in one READ
    assert [layers for _, layers in r.decoded] == [(0, 1), (2, 3)]
    assert len(r.transport.reads) == 3 and all(x.released for x in r.transport.reads)
    assert r.client.calls.index("heartbeat") < r.client.calls.index("release")
    assert r.client.released == ["remote-r1"]
    assert r.ranges.free_bytes == r.ranges.capacity  # receive range given back
    report = r.loader.take_reports()["r1"]
    assert report.failed is None and report.tokens == 2 * BS + 5
    assert report.wire_bytes == sum(x.nbytes for x in r.transport.reads)




def test_landed_read_handles_are_released_after_their_decode_is_launched():
    r = rig()
    seen: list[list[bool]] = []
    decode = r.loader.decode

    def watching(load, layers, recv_offset, chunk_offsets):
        seen.append([x.released for x in r.transport.reads])
        return decode(load, layers, recv_offset, chunk_offsets)

    r.loader.decode = watching
    r.loader.start([request()])
    assert drive(r) == ({"r1"}, set())
    # the handles of the run being decoded are still held during the call, then released
    assert seen[0][:2] == [False, False]
    assert all(x.released for x in r.transport.reads)


def test_landed_read_handles_are_released_when_their_decode_raises():
    r = rig(decode_error=BlockIndexError("block 9 out of range"))
    r.loader.start([request()])
    _, failed = drive(r)
    assert failed == {"r1"}
    ended = [x for x in r.transport.reads if x.current is not TransferState.PENDING]
    assert ended and all(x.released for x in ended)


def test_a_poll_that_finds_the_link_idle_posts_every_group_left_in_one_read():
    r = rig()
    r.loader.start([request()])
    r.loader.results()  # the handshake's answer: the first two READs go out
    first, second = r.transport.reads
    first.current = TransferState.DONE
    r.loader.results()  # group 1 still on the wire: the pipeline goes on, two in flight
    assert len(r.transport.reads) == 3 and [lay for _, lay in r.decoded] == [(0,)]
    second.current = TransferState.DONE
    r.transport.reads[2].current = TransferState.DONE
    r.loader.results()  # nothing left on the wire: group 3 goes out alone (all that is left)
    assert len(r.transport.reads) == 4 and r.transport.reads[3].nbytes > 0
    assert drive(r) == ({"r1"}, set())
    assert sorted(sum((lay for _, lay in r.decoded), ())) == [0, 1, 2, 3]


def rest_in_one_read(r: Rig) -> tuple[FakeTransfer, list[int]]:
    """Start a load, land its first two READs and poll: the READ of groups 2-3 posted then, and
    a list that counts its releases."""
    r.loader.start([request()])
    r.loader.results()  # the handshake's answer: the first two READs go out
    for x in r.transport.reads:
        x.current = TransferState.DONE
    r.loader.results()  # both landed by this poll: groups 2-3 in one READ, 0-1 decoded
    assert len(r.transport.reads) == 3
    rest = r.transport.reads[2]
    released: list[int] = []
    real = rest.release
    rest.release = lambda: (released.append(1), real())
    return rest, released


def test_the_rest_goes_out_in_one_read_carrying_every_group_left_released_once():
    r = rig()
    rest, released = rest_in_one_read(r)
    rows = r.loader._jobs[0].rows
    sizes = [rows.group(g) for g in range(len(rows.group_rows) - 1)]
    assert rest.nbytes == int(sizes[2][0][:, 1].sum() + sizes[3][0][:, 1].sum())
    assert drive(r) == ({"r1"}, set())
    assert [lay for _, lay in r.decoded] == [(0, 1), (2, 3)] and released == [1]
    assert r.ranges.free_bytes == r.ranges.capacity




def test_a_failed_read_carrying_several_groups_fails_the_load_and_is_released_once():
    r = rig()
    rest, released = rest_in_one_read(r)
    rest.current = TransferState.FAILED
    _, failed = drive(r)
    assert failed == {"r1"} and r.failures() == {"transport": 1} and released == [1]
    assert r.ranges.free_bytes == r.ranges.capacity


def test_a_pending_read_carrying_several_groups_is_quarantined_once():
    r = rig(decode_error=BlockIndexError("block 9 out of range"))
    r.loader.start([request()])
    r.loader.results()  # the handshake's answer: the first two READs go out
    for x in r.transport.reads:
        x.current = TransferState.DONE
    _, failed = r.loader.results()  # the rest posted (pending), then group 0-1's decode raises
    assert failed == {"r1"} and len(r.transport.reads) == 3
    (q,) = r.loader._quarantine
    assert q.xfers == [r.transport.reads[2]]
    r.transport.reads[2].current = TransferState.DONE
    r.loader.results()
    assert not r.loader._quarantine and r.ranges.free_bytes == r.ranges.capacity




def test_no_more_than_two_reads_are_on_the_wire():
    r = rig()
    r.loader.start([request()])
    r.loader.results()
    r.loader.results()
    pending = [x for x in r.transport.reads if x.current is TransferState.PENDING]
    assert len(r.transport.reads) == 2 and len(pending) == 2 and not r.decoded


def poll_until_finished(r: Rig) -> set[str]:
    """Poll (every READ landing by the next poll) until a poll reports a finished load; that
    poll's finished set, with nothing polled after it."""
    finished: set[str] = set()
    for _ in range(20):
        for x in r.transport.reads:
            x.current = TransferState.DONE
        finished, _ = r.loader.results()
        if finished:
            break
    return finished


def test_a_completed_load_is_reported_before_its_release_and_metrics_which_follow_next_call():
    r = rig()
    r.loader.start([request()])
    finished = poll_until_finished(r)
    assert finished == {"r1"}
    def recorded() -> set[str]:
        return {key.split("|")[0] for key in r.stats.data["histograms"]}

    assert "release" not in r.client.calls and "transfer_seconds" not in recorded()
    r.loader.results()
    assert r.client.released == ["remote-r1"]
    assert {"transfer_seconds", "decode_seconds"} <= recorded()
    # close() sends what is still owed
    r2 = rig()
    r2.loader.start([request()])
    while not r2.loader.take_reports():
        for x in r2.transport.reads:
            x.current = TransferState.DONE
        r2.loader.results()
    # the worker shuts its pool down before it closes the loader (engine exit)
    pool = ThreadPoolExecutor(1)
    pool.shutdown()
    r2.loader._executor = pool
    r2.loader.close()
    assert r2.client.released == ["remote-r1"]


def test_a_finished_load_and_its_decode_handles_are_freed_at_the_next_call_not_before_its_report():
    """Freeing a load's decode plan (the handles hold it) and its buffers is host time between
    its verdict and its report: it happens at the next ``results()`` (vLLM's next step)."""
    import gc
    import weakref

    class Handle:
        def done(self) -> bool:
            return True

        def result(self) -> None:
            return None

        def abandon(self) -> None:
            return None

    r = rig()
    handles: list[weakref.ref] = []

    def decode(load, layers, recv_offset, chunk_offsets):
        h = Handle()
        handles.append(weakref.ref(h))
        return h

    r.loader.decode = decode
    r.loader.start([request()])
    job = weakref.ref(r.loader._jobs[0])
    finished = poll_until_finished(r)
    gc.collect()
    assert finished == {"r1"} and handles
    # the load and the handle settled by the poll that finished it are not freed yet (one
    # settled by an earlier poll was freed at the next one)
    assert job() is not None and handles[-1]() is not None
    r.loader.results()
    gc.collect()
    assert job() is None and all(h() is None for h in handles)  # freed at the next call


def test_the_claim_and_the_release_present_the_lease_token_of_the_load():
    r = rig()
    r.loader.start([request()])
    assert drive(r) == ({"r1"}, set())
    assert r.client.tokens == [("heartbeat", [LEASE_TOKEN]), ("release", [LEASE_TOKEN])]


def test_nothing_is_decoded_when_the_lease_is_gone(caplog):
    r = rig()
    r.client.expired.add("remote-r1")
    r.loader.start([request()])
    finished, failed = drive(r)
    assert failed == {"r1"} and finished == {"r1"}
    assert not r.decoded
    assert r.failures() == {"lease_expired": 1}
    assert r.loader.take_reports()["r1"].failed == "lease_expired"
    assert "raise lease_seconds" in caplog.text  # an expiry: a longer lease is the fix


def test_a_refused_claim_is_lease_refused_not_an_expiry(caplog):
    """The prefill engine holds the lease but the claim named it with a token that is not its
    (altered params, or params naming another request's lease): nothing is decoded, and the
    failure says so, without the lease_seconds hint of an expiry and without the token."""
    r = rig()
    r.client.refused.add("remote-r1")
    r.loader.start([request()])
    finished, failed = drive(r)
    assert failed == {"r1"} and finished == {"r1"}
    assert not r.decoded
    assert r.failures() == {"lease_refused": 1}
    assert r.loader.take_reports()["r1"].failed == "lease_refused"
    assert "turbowire_lease_token" in caplog.text and "another request" in caplog.text
    assert "raise lease_seconds" not in caplog.text
    assert LEASE_TOKEN not in caplog.text and LEASE_TOKEN not in repr(request())


def test_a_failed_group_fails_the_load_and_later_groups_are_not_decoded():
    r = rig()
    r.loader.start([request()])
    r.loader.results()
    r.transport.reads[0].current = TransferState.DONE
    r.transport.reads[1].current = TransferState.FAILED
    finished, failed = drive(r, land=False)
    assert failed == {"r1"}
    # group 0 landed in the same run as the failed group 1: the load fails before the run is
    # decoded (KV of a load that is recomputed is never written)
    assert r.decoded == []
    assert r.failures() == {"transport": 1}
    # group 2 went out when group 0 landed and is still on the wire: its range stays quarantined
    assert len(r.transport.reads) == 3 and r.transport.reads[2].current is TransferState.PENDING
    assert r.loader.quarantined_bytes == r.ranges.capacity - r.ranges.free_bytes > 0


def test_a_range_a_read_may_still_write_is_quarantined_and_late_completions_change_nothing():
    r = rig()
    r.loader.start([request()])
    r.loader.results()
    r.transport.reads[0].current = TransferState.FAILED  # reads[1] still PENDING
    _, failed = drive(r, steps=1, land=False)
    assert failed == {"r1"}
    nbytes = r.loader.quarantined_bytes
    assert nbytes > 0 and r.ranges.free_bytes == r.ranges.capacity - nbytes
    r.transport.reads[1].current = TransferState.DONE  # the late READ lands
    assert r.loader.results() == (set(), set()) and not r.decoded
    # ... and only then is the range given back (issue 17: it used to stay lost for good)
    assert r.loader.quarantined_bytes == 0 and r.ranges.free_bytes == r.ranges.capacity


def test_a_load_past_its_deadline_times_out():
    r = rig(transfer_timeout_seconds=0.5)
    r.loader.start([request()])
    r.loader._jobs[0].created -= 10.0
    _, failed = drive(r, steps=1, land=False)
    assert failed == {"r1"} and r.failures() == {"timeout": 1}


def test_a_request_larger_than_the_receive_buffer_fails_at_once():
    r = rig(recv_bytes=4096)
    r.loader.start([request(blocks=4)])
    _, failed = drive(r, steps=3)
    assert failed == {"r1"} and r.failures() == {"recv_buffer_too_small": 1}
    assert not r.transport.reads


def test_a_transport_that_cannot_post_frees_the_range():
    r = rig()
    r.transport.fail_read = True
    r.loader.start([request()])
    _, failed = drive(r, steps=3)
    assert failed == {"r1"} and r.failures() == {"transport": 1}
    assert r.ranges.free_bytes == r.ranges.capacity


@pytest.mark.parametrize("error,reason", [
    (BlockIndexError("block 9 out of range"), "bounds"),
    (IndexError("a bug in turbowire, not a peer"), "internal"),
])
def test_decode_errors_are_counted_by_their_own_reason(error, reason):
    r = rig(decode_error=error)
    r.loader.start([request()])
    _, failed = drive(r)
    assert failed == {"r1"} and r.failures() == {reason: 1}


def test_remote_slots_outside_the_peer_pool_are_refused_before_any_read():
    r = rig()
    bad = request()
    bad.blocks[1].slot = 10**6
    r.loader.start([bad])
    _, failed = drive(r, steps=3)
    assert failed == {"r1"} and r.failures() == {"bounds": 1} and not r.transport.reads


# -- faults (issue 17): READs of a dead peer, the receive-buffer quarantine, stale handshakes ----
#
# Why an in-flight READ of a dead peer can never write into blocks vLLM gave to another request:
# a READ only ever targets this engine's receive buffer (``_post`` builds its local descriptors
# from ``recv_base + range``), never the paged cache; the paged cache is written only by
# ``_decode_group``, called from ``_advance`` for a live job once its claim held and its READ is
# DONE. A failed job leaves ``_jobs`` in ``_fail`` (so it is never decoded again), and a range
# whose READs are still PENDING is quarantined, not freed, so no other load decodes from bytes a
# late READ may still write. The tests below hold each link of that chain.


def _fail_first_group_keep_second_pending(r: Rig, rid: str = "r1") -> int:
    r.loader.start([request(rid)])
    r.loader.results()
    first, second = r.transport.reads[-2:]
    first.current = TransferState.FAILED
    second.current = TransferState.PENDING
    _, failed = drive(r, steps=1, land=False)
    assert failed == {rid}
    return r.loader.quarantined_bytes


def test_a_quarantined_range_is_not_reused_while_a_read_may_still_write():
    r = rig()
    quarantined = _fail_first_group_keep_second_pending(r)
    offsets: list[tuple[str, int]] = []
    original = r.loader.decode

    def spy(load, layers, recv_offset, chunk_offsets):
        offsets.append((load.request_id, recv_offset))
        return original(load, layers, recv_offset, chunk_offsets)

    r.loader.decode = spy
    # a second load while the stale READ is on the wire: it lands in a disjoint range
    r.loader.start([request("r2")])
    stale = r.transport.reads[1]
    finished, failed = set(), set()
    for _ in range(20):
        for x in r.transport.reads[2:]:
            x.current = TransferState.DONE
        f, bad = r.loader.results()
        finished |= f
        failed |= bad
    assert finished == {"r2"} and not failed
    assert {rid for rid, _ in offsets} == {"r2"}, "the failed load is never decoded"
    r2_offset = offsets[0][1]
    assert r2_offset >= quarantined, "r2 must not get the quarantined range [0, quarantined)"
    assert stale.current is TransferState.PENDING and not stale.released


def test_a_quarantined_range_is_given_back_once_its_reads_ended():
    """The dead peer's READ finally fails (UCX notices the peer is gone): the range comes back,
    the handle is released, and nothing of the failed load is decoded."""
    r = rig()
    nbytes = _fail_first_group_keep_second_pending(r)
    assert nbytes > 0 and r.ranges.free_bytes == r.ranges.capacity - nbytes
    stale = r.transport.reads[1]
    stale.current = TransferState.FAILED
    assert r.loader.results() == (set(), set())
    assert r.loader.quarantined_bytes == 0 and r.ranges.free_bytes == r.ranges.capacity
    assert stale.released and not r.decoded


def test_a_load_waiting_for_a_quarantined_buffer_goes_ahead_once_it_is_reclaimed():
    """A receive buffer that fits one load: the failed load's range is quarantined, the next load
    waits (no READ, no decode) instead of failing, and runs as soon as the stale READ ended."""
    r0 = rig()
    r0.loader.start([request("probe")])
    drive(r0)
    one_load = r0.loader.take_reports()["probe"].wire_bytes
    r = rig(recv_bytes=one_load + 64)
    _fail_first_group_keep_second_pending(r)
    r.loader.start([request("r2")])
    for _ in range(3):
        assert r.loader.results() == (set(), set())
    assert len(r.transport.reads) == 2, "r2 waits for the buffer, it posts nothing"
    r.transport.reads[1].current = TransferState.DONE  # the stale READ landed after all
    finished, failed = drive(r)
    assert finished == {"r2"} and not failed
    assert {rid for rid, _ in r.decoded} == {"r2"}
    assert [layer for _, layers in r.decoded for layer in layers] == list(range(LAYERS))
    assert r.loader.quarantined_bytes == 0 and r.ranges.free_bytes == r.ranges.capacity


class RestartingPeer:
    """Fake transport + client of a prefill engine that restarts under the same engine_id at the
    same address: each incarnation has its own NIXL agent; READs of a gone agent fail."""

    def __init__(self, layout, record) -> None:
        self.incarnation = 0
        self.client = FakeClient(layout, record)
        self.transport = FakeTransport()
        self.removed: list[str] = []
        self.handshakes = 0
        peer = self

        def handshake(record, engine_id, tp_rank):
            peer.handshakes += 1
            info = FakeClient.handshake(self.client, record, engine_id, tp_rank)
            staging = dataclasses.replace(info.staging,
                                          agent_metadata=f"md-{peer.incarnation}".encode())
            return dataclasses.replace(info, staging=staging)

        def add_peer(metadata: bytes) -> str:
            return "agent-" + metadata.decode()

        def read(agent, local, remote, mem_type, notif=b""):
            x = FakeTransfer(int(local[:, 1].sum()))
            if agent != f"agent-md-{peer.incarnation}":
                x.current = TransferState.FAILED  # NIXL: remote agent disconnected
            self.transport.reads.append(x)
            return x

        self.client.handshake = handshake
        self.transport.add_peer = add_peer
        self.transport.read = read
        self.transport.remove_peer = self.removed.append


def _restarting_rig() -> tuple[Rig, RestartingPeer]:
    r = rig()
    peer = RestartingPeer(r.client.layout, r.client.record)
    r.loader._transport = peer.transport
    r.loader._clients = SimpleNamespace(get=lambda host, port: peer.client)
    r.transport, r.client = peer.transport, peer.client
    return r, peer


def test_a_prefill_engine_restarted_under_the_same_id_is_handshaken_again():
    r, peer = _restarting_rig()
    r.loader.start([request("before")])
    assert drive(r) == ({"before"}, set())
    peer.incarnation = 1  # SIGKILL + restart: same engine_id, host, port; a new NIXL agent
    r.loader.start([request("first-after")])
    finished, failed = drive(r)
    assert failed == {"first-after"}, "the cached handshake points at the dead agent"
    assert r.failures() == {"transport": 1}
    r.loader.start([request("second-after")])
    finished, failed = drive(r)
    assert finished == {"second-after"} and not failed, "a fresh handshake, a good load"
    assert peer.handshakes == 2
    assert peer.removed == ["agent-md-0"], "the dead agent is dropped from NIXL"


def test_a_lease_that_expired_keeps_the_handshake():
    r = rig()
    r.client.expired.add("remote-r1")
    r.loader.start([request("r1")])
    drive(r)
    r.loader.start([request("r2")])
    assert drive(r) == ({"r2"}, set())
    assert r.client.calls.count("handshake") == 1


def test_a_failed_load_whose_release_cannot_get_through_is_counted_once():
    """A dead prefill engine: the READ fails and so does the lease release after it. One failed
    load, one count (its own reason), not a second ``peer_unreachable`` for the release."""
    from turbowire.connector.sidechannel.client import PeerUnreachableError

    r = rig()

    def release(ids, engine_id="", tp_rank=0, lease_tokens=None, tp_size=0):
        raise PeerUnreachableError("side channel 127.0.0.1:5700 unreachable")

    r.client.release = release
    r.loader.start([request()])
    r.loader.results()
    r.transport.reads[0].current = TransferState.FAILED
    r.transport.reads[1].current = TransferState.FAILED
    _, failed = drive(r, land=False)
    assert failed == {"r1"} and r.failures() == {"transport": 1}


def test_a_successful_load_whose_release_cannot_get_through_is_counted():
    from turbowire.connector.sidechannel.client import PeerUnreachableError

    r = rig()

    def release(ids, engine_id="", tp_rank=0, lease_tokens=None, tp_size=0):
        raise PeerUnreachableError("side channel 127.0.0.1:5700 unreachable")

    r.client.release = release
    r.loader.start([request()])
    finished, failed = drive(r)
    assert finished == {"r1"} and not failed
    assert r.failures() == {"peer_unreachable": 1}  # the lease then expires on the prefill side


def _times_out(times: int, call):
    """``call`` raising the client's timeout the first ``times`` calls, then answering."""
    left = [times]

    def wrapped(*a, **k):
        if left[0] > 0:
            left[0] -= 1
            raise PeerTimeoutError("heartbeat: side channel did not answer within 0.2s")
        return call(*a, **k)

    return wrapped


def test_a_claim_or_handshake_that_times_out_is_sent_again_while_the_lease_may_hold(caplog):
    """A prefill engine starved of CPU answers late (bench/RESULTS.md "Starved CPUs"): one
    timed-out handshake and one timed-out claim cost a retry each, not the load."""
    r = rig(handshake_timeout_seconds=0.2, lease_seconds=30)
    r.client.handshake = _times_out(1, r.client.handshake)
    r.client.heartbeat = _times_out(1, r.client.heartbeat)
    r.loader.start([request()])
    with caplog.at_level(logging.WARNING, logger="turbowire.connector.loader"):
        finished, failed = drive(r)
    assert finished == {"r1"} and not failed
    assert r.client.calls.count("handshake") == 1 and r.client.calls.count("heartbeat") == 1
    assert "handshake for request r1 timed out" in caplog.text
    assert "claim for request r1 timed out" in caplog.text
    assert r.failures() == {}


def test_a_claim_that_keeps_timing_out_fails_the_load_once_the_lease_window_has_passed():
    r = rig(handshake_timeout_seconds=0.2, lease_seconds=1)
    r.client.heartbeat = _times_out(10**6, r.client.heartbeat)
    # the retry window is the prefill's lease, carried on the load (its params)
    r.loader.start([dataclasses.replace(request(), lease_seconds=1)])
    t0 = time.monotonic()
    failed: set[str] = set()
    while not failed and time.monotonic() - t0 < 10:
        failed |= r.loader.results()[1]
        time.sleep(0.02)
    elapsed = time.monotonic() - t0
    # once the 1 s window has passed, not later than a few polls after (slack: a loaded machine)
    assert failed == {"r1"} and 0.8 - 0.2 <= elapsed < 4.0, elapsed
    assert r.failures() == {"peer_unreachable": 1}
    assert r.loader.take_reports()["r1"].failed == "peer_unreachable"


# ---- issue 33: the claim presents this engine's prompt (H3a); peers isolated and capped (M2/M7)
def _bound(rid: str = "r1", digest: str = "d" * 24, tokens: int = 2 * BS + 5) -> LoadRequest:
    return dataclasses.replace(request(rid), prompt_digest=digest, prompt_tokens=tokens)


class PromptCheckingClient(FakeClient):
    """A prefill engine that staged ``staged`` (digest, tokens) for every lease."""

    def __init__(self, layout, record, staged: tuple[str, int]) -> None:
        super().__init__(layout, record)
        self.staged = staged
        self.prompts: list[object] = []

    def heartbeat(self, ids, engine_id="", lease_tokens=None, prompts=None, tp_size=0):
        reply = super().heartbeat(ids, engine_id, lease_tokens)
        self.prompts.append(prompts)
        bad = [i for i, p in zip(ids, prompts or [("", 0)] * len(ids), strict=True)
               if p[0] and p != self.staged]
        reply.done = [i for i in reply.done if i not in bad]
        reply.unknown = list(reply.unknown) + bad
        reply.prompt_mismatch = bad
        return reply


def _prompt_rig(staged: tuple[str, int]) -> Rig:
    r = rig()
    client = PromptCheckingClient(r.client.layout, r.client.record, staged)
    r.loader._clients = SimpleNamespace(get=lambda host, port: client)
    r.client = client
    return r


def test_a_claim_for_another_prompt_fails_as_prompt_mismatch_and_nothing_is_decoded(caplog):
    """Params of prompt P' presented with prompt P (their turbowire_prompt_hash replaced so the
    decode engine's own check passed): the claim presents P, the prefill engine staged P' and
    refuses it. The READs may have moved (they run while the claim is out), but nothing is
    decoded; the load fails as prompt_mismatch and the lease is released."""
    r = _prompt_rig(("f" * 24, 2 * BS + 5))
    r.loader.start([_bound()])
    finished, failed = drive(r)
    assert failed == {"r1"} and finished == {"r1"}
    assert r.decoded == []
    assert r.failures() == {"prompt_mismatch": 1}
    assert r.loader.take_reports()["r1"].failed == "prompt_mismatch"
    assert r.client.prompts[0] == [("d" * 24, 2 * BS + 5)]
    assert r.client.released == ["remote-r1"]
    assert "another prompt" in caplog.text and LEASE_TOKEN not in caplog.text


def test_a_claim_for_its_own_prompt_loads():
    r = _prompt_rig(("d" * 24, 2 * BS + 5))
    r.loader.start([_bound()])
    assert drive(r) == ({"r1"}, set())
    assert r.client.prompts == [[("d" * 24, 2 * BS + 5)]]
    # a load without a prompt (a decode engine that could not name one) claims as before
    r.loader.start([request("r2")])
    assert drive(r) == ({"r2"}, set())
    assert r.client.prompts[-1] is None


def test_a_load_the_scheduler_could_not_plan_fails_at_once():
    r = rig()
    bad = dataclasses.replace(request(), fail_reason="internal")
    assert not bad.release_only
    r.loader.start([bad])
    assert r.loader.results() == ({"r1"}, {"r1"})
    assert r.loader.take_reports()["r1"].failed == "internal"
    assert r.client.calls == ["release"] and r.transport.reads == []
    assert r.failures() == {}  # counted by the scheduler, not twice


class Lanes:
    """An executor with per-peer lanes (PeerExecutors' interface), recording which lane ran."""

    def __init__(self) -> None:
        self.keys: list[object] = []

    def submit_to(self, key, fn, *args, **kwargs) -> Future:
        self.keys.append(key)
        return InlineExecutor().submit(fn, *args, **kwargs)

    def submit(self, fn, *args, **kwargs) -> Future:  # pragma: no cover - not used with lanes
        raise AssertionError("a side-channel call went to the shared lane")


def test_side_channel_calls_run_on_their_peers_lane():
    r = rig()
    lanes = Lanes()
    r.loader._executor = lanes
    r.loader.start([request()])
    assert drive(r) == ({"r1"}, set())
    assert lanes.keys == [("127.0.0.1", 5700)] * 3  # handshake, claim, release


def test_at_most_max_peers_handshakes_are_kept(monkeypatch):
    r = rig(max_peers=2)
    removed: list[str] = []
    r.transport.add_peer = lambda md: "agent-" + md.decode()
    r.transport.remove_peer = removed.append
    handshake = r.client.handshake

    def per_peer(record, engine_id, tp_rank):
        info = handshake(record, engine_id, tp_rank)
        return dataclasses.replace(info, staging=dataclasses.replace(
            info.staging, agent_metadata=f"md-{len(r.client.calls)}".encode()))

    r.client.handshake = per_peer
    r.transport.read = lambda agent, local, remote, mem_type, notif=b"": (
        r.transport.reads.append(x := FakeTransfer(int(local[:, 1].sum()))) or x)
    for port in (1, 2, 3):
        load = dataclasses.replace(request(f"r{port}"),
                                   peer=PeerAddress(PEER.engine_id, "127.0.0.1", port, 1))
        r.loader.start([load])
        assert drive(r) == ({f"r{port}"}, set())
    assert [key[2] for key in r.loader._peers] == [2, 3]
    drive(r)
    assert removed == ["agent-md-1"]  # the least recently used peer's agent, once unused
