"""Two processes, real NIXL agents (UCX) and the real gRPC side channel: the decode side
handshakes, READs compressed-payload slots of the prefill process, verifies the bytes and
releases the lease; the prefill side frees its staging."""

from __future__ import annotations

import multiprocessing as mp
import time

import connector_peer as peer  # tests/integration is on sys.path (pytest rootdir insertion)
import numpy as np
import pytest
import torch

from turbowire.connector.sidechannel.client import SideChannelClient
from turbowire.connector.transports.base import TransferState
from turbowire.connector.transports.nixl import NixlTransport

pytestmark = pytest.mark.integration
TOKEN = "integration-token-123"


@pytest.fixture(scope="module")
def prefill_peer():
    ctx = mp.get_context("spawn")
    ports: mp.Queue = ctx.Queue()
    stop = ctx.Event()
    leased = {"req-A": [0, 1, 2], "req-B": [3, 4]}
    proc = ctx.Process(target=peer.serve, args=(ports, stop, leased, 60.0, TOKEN), daemon=True)
    proc.start()
    port = ports.get(timeout=60)
    yield port, stop, ports
    stop.set()
    proc.join(timeout=10)
    if proc.is_alive():
        proc.kill()


def _read_slots(transport, agent, info, slots, recv):
    rows_l, rows_r, cursor, expected = [], [], 0, []
    for slot in slots:
        for layer, off in enumerate(info.layer_offsets):
            size = 700 + 100 * layer  # chunk bytes, less than the 1024-byte room per layer
            rows_r.append((info.base_addr + slot * info.slot_bytes + off, size, 0))
            rows_l.append((recv.data_ptr() + cursor, size, 0))
            expected.append((cursor, peer.payload(slot)[off : off + size]))
            cursor += size
    xfer = transport.read(
        agent, np.array(rows_l, dtype=np.uint64), np.array(rows_r, dtype=np.uint64), "DRAM"
    )
    deadline = time.monotonic() + 30
    while xfer.state() is TransferState.PENDING and time.monotonic() < deadline:
        time.sleep(0.001)
    assert xfer.state() is TransferState.DONE
    xfer.release()
    return cursor, expected


def test_handshake_read_verify_release(prefill_peer):
    port, stop, ports = prefill_peer
    client = SideChannelClient("127.0.0.1", port, TOKEN, timeout=10)
    t0 = time.perf_counter()
    info = client.handshake(peer.record(), "engine-D", 0)
    handshake_ms = (time.perf_counter() - t0) * 1e3
    assert info.engine_id == "engine-P"
    assert info.staging.num_slots == peer.NUM_SLOTS
    assert info.staging.layer_offsets == peer.LAYER_OFFSETS

    transport = NixlTransport(agent_name="decode-test")
    recv = torch.zeros(64 * 1024, dtype=torch.uint8)
    transport.register(recv)
    agent = transport.add_peer(info.staging.agent_metadata)
    assert transport.add_peer(info.staging.agent_metadata) == agent  # cached

    nbytes, expected = _read_slots(transport, agent, info.staging, [0, 1, 2], recv)
    for off, want in expected:
        got = recv[off : off + len(want)].numpy()
        assert np.array_equal(got, want)
    assert nbytes == 3 * (700 + 800 + 900)

    token_a, token_b = peer.lease_token("req-A"), peer.lease_token("req-B")
    reply = client.release(["req-A"], "engine-D")  # no lease token: held, refused
    assert list(reply.unknown) == ["req-A"] and list(reply.refused) == ["req-A"]
    reply = client.release(["req-A"], "engine-D", lease_tokens=[token_a])
    assert list(reply.done) == ["req-A"] and not reply.unknown
    reply = client.release(["req-A", "never"], "engine-D", lease_tokens=[token_a, ""])
    assert not reply.done and list(reply.unknown) == ["req-A", "never"] and not reply.refused
    reply = client.heartbeat(["req-B"], "engine-D", lease_tokens=[token_b])
    assert list(reply.done) == ["req-B"]
    client.release(["req-B"], "engine-D", lease_tokens=[token_b])
    transport.close()
    client.close()
    print(f"handshake {handshake_ms:.1f} ms")


def test_read_outside_registered_memory_is_refused(prefill_peer):
    port, _, _ = prefill_peer
    client = SideChannelClient("127.0.0.1", port, TOKEN, timeout=10)
    info = client.handshake(peer.record(), "engine-D", 0).staging
    transport = NixlTransport(agent_name="decode-bounds")
    recv = torch.zeros(8192, dtype=torch.uint8)
    transport.register(recv)
    agent = transport.add_peer(info.agent_metadata)
    end = info.base_addr + info.slot_bytes * info.num_slots
    from turbowire.connector.transports.base import TransportError

    with pytest.raises(TransportError, match="could not be posted"):
        transport.read(
            agent,
            np.array([(recv.data_ptr(), 4096, 0)], dtype=np.uint64),
            np.array([(end - 100, 4096, 0)], dtype=np.uint64),
            "DRAM",
        )
    transport.close()


def test_prefill_side_freed_every_slot(prefill_peer):
    """Runs last: stop the peer and read back how many staging slots are still in use."""
    _, stop, ports = prefill_peer
    stop.set()
    assert ports.get(timeout=30) == 0, "all staging slots must be free after the releases"


@pytest.mark.parametrize("delay_us", [100])
def test_progress_thread_does_not_busy_poll(delay_us):
    """NIXL's Python API starts a progress thread that never sleeps (a whole core); ours sleeps
    between polls, so an idle agent costs a few percent of a core."""
    import resource

    def cpu() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    transport = NixlTransport(agent_name=f"idle-{delay_us}", progress_delay_us=delay_us)
    try:
        time.sleep(0.3)
        c0, w0 = cpu(), time.monotonic()
        time.sleep(2.0)
        share = (cpu() - c0) / (time.monotonic() - w0)
        assert share < 0.3, f"idle NIXL agent used {share:.2f} of a core"
    finally:
        transport.close()
