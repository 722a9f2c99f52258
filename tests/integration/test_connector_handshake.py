"""Real gRPC side channel: a handshake is refused for every incompatible field (the message
names it), and the shared token is enforced on every call."""

from __future__ import annotations

import dataclasses

import connector_peer as peer  # tests/integration is on sys.path (pytest rootdir insertion)
import pytest

from turbowire.connector.compat import CompatibilityRecord, IncompatiblePeerError
from turbowire.connector.sidechannel.client import (
    PeerUnreachableError,
    SideChannelAuthError,
    SideChannelClient,
)
from turbowire.connector.sidechannel.convert import StagingInfo
from turbowire.connector.sidechannel.server import SideChannelServer
from turbowire.connector.staging import StagingPool

pytestmark = pytest.mark.integration
TOKEN = "handshake-token-xyz"

CHANGES = {
    "model": "other-model",
    "num_layers": 4,
    "num_draft_layers": 1,
    "kv_heads": (2, 2, 1),
    "head_dim": 128,
    "block_size": 64,
    "dtype": "float16",
    "preset": "tq4",
    "format_version": 99,
    "codec_format_version": 7,
    "tp_size": 2,
    "speculative_config": '{"method": "eagle3"}',
    "weights": "fedcba9876543210",
    "model_kv_heads": (2, 2, 1),
    "rope_dim": 64,
}


@pytest.fixture(scope="module")
def server():
    info = StagingInfo("agent-P", b"fake-nixl-metadata", 4096, 4096, 8, (0, 1024, 2048), 0, "DRAM")
    srv = SideChannelServer(
        engine_id="engine-P",
        record=peer.record(),
        staging={0: info},
        leases=StagingPool(8, 30.0),
        bind_host="127.0.0.1",
        port=0,
        auth_token=TOKEN,
    ).start()
    yield srv
    srv.stop()


def test_every_compat_field_is_covered():
    assert set(CHANGES) == {f.name for f in dataclasses.fields(CompatibilityRecord)}


@pytest.mark.parametrize("field", sorted(CHANGES))
def test_incompatible_field_is_refused_by_name(server, field):
    client = SideChannelClient("127.0.0.1", server.port, TOKEN, timeout=5)
    theirs = peer.record(**{field: CHANGES[field]})
    before = server.counters.refused
    with pytest.raises(IncompatiblePeerError) as err:
        client.handshake(theirs, "engine-D", 0)
    assert err.value.field_name == field
    assert f"{field} differs" in str(err.value)
    assert "prefill engine" in str(err.value) and "decode engine" in str(err.value)
    assert server.counters.refused == before + 1
    client.close()


def test_compatible_handshake_returns_geometry(server):
    client = SideChannelClient("127.0.0.1", server.port, TOKEN, timeout=5)
    info = client.handshake(peer.record(), "engine-D", 0)
    assert info.record == peer.record()
    assert info.staging.agent_metadata == b"fake-nixl-metadata"
    assert info.staging.layer_offsets == (0, 1024, 2048)
    client.close()


def test_unknown_tp_rank_is_refused(server):
    from turbowire.connector.sidechannel.client import SideChannelError

    client = SideChannelClient("127.0.0.1", server.port, TOKEN, timeout=5)
    with pytest.raises(SideChannelError, match="no prefill worker with tp_rank 3"):
        client.handshake(peer.record(), "engine-D", 3)
    client.close()


@pytest.mark.parametrize("token", [None, "wrong-token-000"])
def test_every_call_needs_the_token(server, token):
    client = SideChannelClient("127.0.0.1", server.port, token, timeout=5)
    with pytest.raises(SideChannelAuthError, match="same auth_token"):
        client.handshake(peer.record(), "engine-D", 0)
    with pytest.raises(SideChannelAuthError):
        client.release(["x"])
    with pytest.raises(SideChannelAuthError):
        client.heartbeat(["x"])
    client.close()


def test_unreachable_peer():
    client = SideChannelClient("127.0.0.1", 1, TOKEN, timeout=2)
    with pytest.raises(PeerUnreachableError, match="unreachable"):
        client.handshake(peer.record(), "engine-D", 0)
    client.close()
