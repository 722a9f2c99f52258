"""Leases over the real side channel: heartbeats keep a lease alive past lease_seconds, a lease
nobody heartbeats expires and its staging slots are freed (and reused)."""

from __future__ import annotations

import threading
import time

import connector_peer as peer  # tests/integration is on sys.path (pytest rootdir insertion)
import pytest

from turbowire.connector.sidechannel.client import SideChannelClient
from turbowire.connector.sidechannel.convert import StagingInfo
from turbowire.connector.sidechannel.server import SideChannelServer
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
        lease_seconds=1.0, bind_host="127.0.0.1", port=0, auth_token=None,
    ).start()
    client = SideChannelClient("127.0.0.1", server.port, None, timeout=5)
    try:
        pool.reserve("kept", 3)
        pool.lease("kept")
        pool.reserve("dropped", 3)
        pool.lease("dropped")
        assert pool.snapshot().used_slots == 6
        t_end = time.monotonic() + 2.5
        while time.monotonic() < t_end:  # 2.5 s > lease_seconds: only heartbeats keep "kept"
            reply = client.heartbeat(["kept"])
            assert list(reply.done) == ["kept"]
            time.sleep(0.3)
        snap = pool.snapshot()
        assert snap.leases == 1 and snap.used_slots == 3, snap
        assert list(client.release(["dropped"]).unknown) == ["dropped"]
        # the freed slots are allocatable again
        assert sorted(pool.reserve("next", 3)) == [3, 4, 5]
        assert list(client.release(["kept"]).done) == ["kept"]
        assert pool.snapshot().used_slots == 3
    finally:
        stop.set()
        client.close()
        server.stop()
