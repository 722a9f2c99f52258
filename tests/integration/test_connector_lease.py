"""Leases over the real side channel: heartbeats keep a lease alive past lease_seconds, a lease
nobody heartbeats expires and its staging slots are freed (and reused)."""

from __future__ import annotations

import threading
import time

import connector_peer as peer  # tests/integration is on sys.path (pytest rootdir insertion)
import grpc
import pytest

from turbowire.connector.sidechannel import sidechannel_pb2 as pb
from turbowire.connector.sidechannel import sidechannel_pb2_grpc as pb_grpc
from turbowire.connector.sidechannel.client import SideChannelClient
from turbowire.connector.sidechannel.convert import StagingInfo
from turbowire.connector.sidechannel.server import AUTH_HEADER, SideChannelServer
from turbowire.connector.staging import StagingPool

pytestmark = pytest.mark.integration


def test_heartbeat_keeps_lease_and_expiry_frees_staging():
    pool = StagingPool(num_slots=6, lease_seconds=1.0)
    stop = threading.Event()

    def reaper() -> None:  # what the scheduler's maintenance thread does
        while not stop.wait(0.05):
            pool.reap()

    threading.Thread(target=reaper, daemon=True).start()
    info = StagingInfo("agent-P", b"meta", 4096, 4096, 6, (0, 1024, 2048), 0, "DRAM")
    server = SideChannelServer(
        engine_id="engine-P", record=peer.record(), staging={0: info}, leases=pool,
        bind_host="127.0.0.1", port=0, auth_token=None,
    ).start()
    client = SideChannelClient("127.0.0.1", server.port, None, timeout=5)
    try:
        pool.reserve("kept", 3)
        kept = [pool.lease("kept").token]
        pool.reserve("dropped", 3)
        dropped = [pool.lease("dropped").token]
        assert pool.snapshot().used_slots == 6
        t_end = time.monotonic() + 2.5
        while time.monotonic() < t_end:  # 2.5 s > lease_seconds: only heartbeats keep "kept"
            reply = client.heartbeat(["kept"], lease_tokens=kept)
            assert list(reply.done) == ["kept"]
            time.sleep(0.3)
        snap = pool.snapshot()
        assert snap.leases == 1 and snap.used_slots == 3, snap
        reply = client.release(["dropped"], lease_tokens=dropped)
        assert list(reply.unknown) == ["dropped"] and not reply.refused  # expired, not refused
        # the freed slots are allocatable again
        assert sorted(pool.reserve("next", 3)) == [3, 4, 5]
        assert list(client.release(["kept"], lease_tokens=kept).done) == ["kept"]
        assert pool.snapshot().used_slots == 3
    finally:
        stop.set()
        client.close()
        server.stop()


def test_a_release_or_heartbeat_must_present_the_lease_token():
    """Over the real side channel (with the auth token, which every engine of the deployment
    holds): naming a live lease's request id without its lease token, or with another lease's,
    releases and extends nothing (answered refused); the holder's token does. Counted on the
    prefill engine."""
    refused: list[tuple[list[str], list[str]]] = []
    pool = StagingPool(num_slots=6, lease_seconds=30.0,
                       on_refused=lambda missing, wrong: refused.append((missing, wrong)))
    info = StagingInfo("agent-P", b"meta", 4096, 4096, 6, (0, 1024, 2048), 0, "DRAM")
    server = SideChannelServer(
        engine_id="engine-P", record=peer.record(), staging={0: info}, leases=pool,
        bind_host="127.0.0.1", port=0, auth_token="shared-token-123",
    ).start()
    client = SideChannelClient("127.0.0.1", server.port, "shared-token-123", timeout=5)
    try:
        pool.reserve("victim", 3)
        victim = pool.lease("victim").token
        pool.reserve("attacker", 3)
        attacker = pool.lease("attacker").token  # the attacker's own, valid token
        for call in (client.release, client.heartbeat):
            for tokens in (None, [attacker], ["0" * 32]):  # none at all, another's, a made-up
                reply = call(["victim"], lease_tokens=tokens)
                assert list(reply.unknown) == ["victim"] and list(reply.refused) == ["victim"]
        assert pool.has_lease("victim") and pool.snapshot().used_slots == 6
        assert refused == [(["victim"], [])]  # counted once per lease
        # a malformed call (sent raw: the client refuses to build one) is refused before it
        # reaches the pool
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel, \
                pytest.raises(grpc.RpcError, match="1 lease tokens for 2 request ids"):
            pb_grpc.SideChannelStub(channel).ReleaseLease(
                pb.LeaseRequest(request_ids=["victim", "attacker"], lease_tokens=[victim]),
                timeout=5, metadata=((AUTH_HEADER, "Bearer shared-token-123"),))
        assert list(client.heartbeat(["victim"], lease_tokens=[victim]).done) == ["victim"]
        reply = client.release(["victim", "attacker"], lease_tokens=[victim, attacker])
        assert list(reply.done) == ["victim", "attacker"]
        assert pool.snapshot().used_slots == 0
    finally:
        client.close()
        server.stop()
