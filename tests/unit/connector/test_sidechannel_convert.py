"""StagingInfo.from_response: a peer's staging geometry is bounded before the loader uses it."""

from __future__ import annotations

import numpy as np
import pytest

from turbowire.connector.sidechannel import sidechannel_pb2 as pb
from turbowire.connector.sidechannel.convert import (
    MAX_STAGING_ADDRESS,
    SideChannelProtocolError,
    StagingBoundsError,
    StagingInfo,
)
from turbowire.errors import TurboWireError, failure_reason


def _resp(base_addr: int, slot_bytes: int = 1 << 16, num_slots: int = 64) -> pb.HandshakeResponse:
    return pb.HandshakeResponse(
        engine_id="p", agent_name="agent-p", agent_metadata=b"nixl-md",
        staging=pb.StagingGeometry(base_addr=base_addr, slot_bytes=slot_bytes,
                                   num_slots=num_slots, layer_offsets=[0, 4096],
                                   device_id=0, mem_type="DRAM"),
    )


def test_sane_geometry_is_accepted() -> None:
    info = StagingInfo.from_response(_resp(1 << 20))
    assert (info.base_addr, info.slot_bytes, info.num_slots) == (1 << 20, 1 << 16, 64)


def test_runs_of_heads_travel_and_an_older_peer_stages_whole_chunks() -> None:
    info = StagingInfo.from_response(_resp(1 << 20))
    assert info.head_groups == 1  # field absent: an older prefill engine, whole chunks
    cut = StagingInfo("agent-p", b"md", 1 << 20, 1 << 16, 64, (0, 4096), 0, "DRAM", 4)
    resp = pb.HandshakeResponse(engine_id="p", agent_name="agent-p", agent_metadata=b"md",
                                staging=cut.to_proto())
    assert StagingInfo.from_response(resp).head_groups == 4


def test_pool_ending_just_below_2_63_is_accepted() -> None:
    base = MAX_STAGING_ADDRESS - 64 * (1 << 16) - 1
    info = StagingInfo.from_response(_resp(base))
    # the loader's vectorised address arithmetic stays exact for the last slot's last layer
    addr = base + np.array([63], np.int64) * info.slot_bytes + np.int64(4096)
    assert int(addr[0]) == base + 63 * (1 << 16) + 4096


@pytest.mark.parametrize(
    ("base_addr", "slot_bytes", "num_slots"),
    [
        ((1 << 64) - 1, 1 << 16, 64),  # base alone beyond int64
        (MAX_STAGING_ADDRESS - 64 * (1 << 16), 1 << 16, 64),  # ends exactly at 2**63
        (1 << 20, (1 << 64) - 1, 2),  # slot_bytes x num_slots overflows int64
        (0, 1 << 40, (1 << 32) - 1),  # product beyond 2**63 with base 0
    ],
)
def test_pool_reaching_2_63_is_a_bounds_violation(
    base_addr: int, slot_bytes: int, num_slots: int
) -> None:
    with pytest.raises(StagingBoundsError, match="2\\*\\*63") as info:
        StagingInfo.from_response(_resp(base_addr, slot_bytes, num_slots))
    exc = info.value
    assert isinstance(exc, SideChannelProtocolError) and isinstance(exc, TurboWireError)
    assert not isinstance(exc, OverflowError)
    assert failure_reason(exc) == "bounds"
