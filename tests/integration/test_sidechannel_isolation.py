"""Peers isolated from each other on the decode side (issue 33, M2/M7), over the real gRPC side
channel: prefill peers that accept TCP and never answer (a partitioned node, a firewall that
drops instead of refusing) hold up their own loads only; a healthy peer's handshake, claim and
release go through at once. Also: the prompt binding of a claim over the wire (H3a), and the
per-peer state capped (clients, lanes)."""

from __future__ import annotations

import threading
import time

import connector_peer as peer  # tests/integration is on sys.path (pytest rootdir insertion)
import numpy as np
import pytest
from support.blackhole import BlackHole

from turbowire.codec import Codec
from turbowire.connector.coder.base import DoneDecode
from turbowire.connector.config import TurboWireConfig
from turbowire.connector.geometry import StagingLayout
from turbowire.connector.loader import KVLoader, LocalEnd
from turbowire.connector.metadata import LoadBlock, LoadRequest, PeerAddress
from turbowire.connector.params import prompt_digest
from turbowire.connector.sidechannel.client import ClientPool, PeerExecutors, SideChannelClient
from turbowire.connector.sidechannel.convert import StagingInfo
from turbowire.connector.sidechannel.server import SideChannelServer
from turbowire.connector.staging import ByteRanges, StagingPool
from turbowire.connector.stats import TurboWireConnectorStats, iter_counters
from turbowire.connector.transports.base import TransferState

pytestmark = pytest.mark.integration
CALL_S = 3.0  # handshake_timeout_seconds of the decode side
TOKEN = "isolation-token-123"
GEO = peer.GEOMETRY
CODEC = Codec("raw", 64, GEO.num_layers)
LAYOUT = StagingLayout.build(GEO, CODEC.encoded_nbytes, 1 << 20)
PROMPT = list(range(7, 7 + 40))


class Done:
    def state(self) -> TransferState:
        return TransferState.DONE

    def release(self) -> None:
        pass


class Transport:
    """NIXL stand-in: every READ lands at once (the side channel is what is under test)."""

    name = "fake"
    agent_name = "decode-agent"

    def add_peer(self, metadata: bytes) -> str:
        return "agent-" + metadata.decode()

    def read(self, agent, local, remote, mem_type, notif=b""):
        return Done()


@pytest.fixture
def healthy():
    """A prefill engine's side channel with one lease of PROMPT staged (40 tokens, 2 slots)."""
    pool = StagingPool(LAYOUT.num_slots, 30.0)
    pool.reserve("p-req", 2)
    lease = pool.lease("p-req", prompt_digest=prompt_digest(PROMPT, 40), num_tokens=40)
    info = StagingInfo("agent-P", b"P", 4096, LAYOUT.slot_bytes, LAYOUT.num_slots,
                       tuple(LAYOUT.layer_offsets), 0, "DRAM")
    server = SideChannelServer(
        engine_id="engine-P", record=peer.record(), staging={0: info}, leases=pool,
        bind_host="127.0.0.1", port=0, auth_token=TOKEN,
    ).start()
    yield server, pool, lease
    server.stop()


def _loader(executor) -> tuple[KVLoader, list[str], TurboWireConnectorStats]:
    config = TurboWireConfig.from_extra_config(
        {"preset": "raw", "handshake_timeout_seconds": CALL_S, "lease_seconds": 2 * CALL_S,
         "transfer_timeout_seconds": 60, "auth_token": TOKEN}, environ={})
    decoded: list[str] = []
    stats = TurboWireConnectorStats()
    local = LocalEnd("engine-D", 0, peer.record(), "DRAM", 1 << 30, 0, 64,
                     GEO.dense_bytes_per_token(2))
    loader = KVLoader(
        config, GEO, LAYOUT, lambda layer, tokens, index: CODEC.encoded_nbytes(
            layer, tokens, 2, index * GEO.block_size),
        local, Transport(), ClientPool.from_config(config), ByteRanges(1 << 20),
        lambda load, layers, off, offsets: decoded.append(load.request_id) or DoneDecode(layers),
        executor, stats,
    )
    return loader, decoded, stats


def _load(rid: str, port: int, token: str, digest: str = "") -> LoadRequest:
    blocks = [LoadBlock(0, 3, 32, 0, 11), LoadBlock(1, 4, 8, 1, 12)]
    return LoadRequest(rid, "p-req", PeerAddress("engine-P", "127.0.0.1", port, 1), blocks,
                       "raw", [3, 4], lease_token=token, prompt_digest=digest,
                       prompt_tokens=40 if digest else 0)


def _until(loader: KVLoader, rid: str, timeout: float) -> tuple[float, bool]:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        finished, failed = loader.results()
        if rid in finished:
            return time.monotonic() - t0, rid in failed
        time.sleep(0.005)
    return time.monotonic() - t0, False


def test_blackholed_peers_do_not_stall_a_healthy_peers_load(healthy):
    """Two prefill peers that never answer are named first (their handshakes each hold a thread
    for CALL_S). With one pool of two threads for every peer, the healthy peer's handshake
    waited behind them for the whole deadline; on per-peer lanes it is served at once."""
    server, pool, lease = healthy
    holes = [BlackHole(), BlackHole()]
    lanes = PeerExecutors(max_peers=8, threads_per_peer=2)
    loader, decoded, stats = _loader(lanes)
    try:
        loader.start([_load(f"stuck-{i}", h.port, "0" * 32) for i, h in enumerate(holes)])
        deadline = time.monotonic() + 5
        while not all(h.accepted for h in holes):  # both handshakes are on their threads
            assert time.monotonic() < deadline
            time.sleep(0.01)
        loader.start([_load("healthy", server.port, lease.token, prompt_digest(PROMPT, 40))])
        seconds, failed = _until(loader, "healthy", 2 * CALL_S)
        assert not failed and decoded.count("healthy") >= 1
        assert seconds < CALL_S / 2, f"the healthy load took {seconds:.2f} s"
        deadline = time.monotonic() + 5
        while pool.has_lease("p-req"):  # its release (sent at the next poll) went through too
            assert time.monotonic() < deadline
            loader.results()
            time.sleep(0.01)
    finally:
        lanes.shutdown()
        for h in holes:
            h.close()


def test_a_claim_over_the_wire_for_another_prompt_is_refused(healthy):
    server, pool, lease = healthy
    refusals: list[list[str]] = []
    pool.on_mismatch = refusals.append
    loader, decoded, stats = _loader(PeerExecutors(max_peers=2))
    other = prompt_digest(list(range(1000, 1040)), 40)
    loader.start([_load("forged", server.port, lease.token, other)])
    seconds, failed = _until(loader, "forged", 10)
    assert failed and decoded == []
    assert {lbl["reason"] for n, lbl, _ in iter_counters(stats.data)
            if n == "failures"} == {"prompt_mismatch"}
    assert refusals == [["p-req"]]
    deadline = time.monotonic() + 5
    while pool.has_lease("p-req"):  # the holder of the token releases it
        assert time.monotonic() < deadline
        loader.results()
        time.sleep(0.01)


def test_per_peer_state_is_capped():
    clients = ClientPool(None, 1.0, max_clients=2)
    a, b = clients.get("127.0.0.1", 1), clients.get("127.0.0.1", 2)
    assert clients.get("127.0.0.1", 1) is a  # used again: now the most recent
    clients.get("127.0.0.1", 3)
    assert len(clients) == 2 and clients.get("127.0.0.1", 1) is a
    assert clients.get("127.0.0.1", 2) is not b  # b was closed and dropped, made anew
    clients.close()

    lanes = PeerExecutors(max_peers=2, threads_per_peer=1)
    gate = threading.Event()
    running = lanes.submit_to("a", gate.wait, 5)
    lanes.submit_to("b", lambda: None).result(5)
    lanes.submit_to("c", lambda: None).result(5)  # "a" is dropped: its call still finishes
    assert len(lanes) == 2
    gate.set()
    assert running.result(5) is True
    lanes.shutdown()
    with pytest.raises(RuntimeError):
        lanes.submit_to("a", lambda: None)


def test_heartbeat_batches_respect_the_ids_per_call_bound():
    from turbowire.connector.sidechannel.client import batched
    from turbowire.connector.sidechannel.server import MAX_IDS_PER_CALL

    assert MAX_IDS_PER_CALL == 4096
    ids = list(range(10_000))
    rows = batched(ids)
    assert [len(r) for r in rows] == [4096, 4096, 1808]
    assert np.concatenate([list(r) for r in rows]).tolist() == ids
    c = SideChannelClient("127.0.0.1", 1, None, timeout=1)
    c.close()
