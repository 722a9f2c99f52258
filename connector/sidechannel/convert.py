"""Conversions between the connector's dataclasses and the side channel's protobuf messages."""

from __future__ import annotations

from dataclasses import dataclass

from turbowire.connector.compat import CompatibilityRecord
from turbowire.connector.sidechannel import sidechannel_pb2 as pb
from turbowire.errors import TurboWireError

MAX_LAYERS = 4096
MAX_AGENT_METADATA = 16 << 20
#: Exclusive bound of every staging address a peer advertises: the loader computes READ
#: addresses as int64 arrays (``base_addr + slot * slot_bytes + layer_offset``), so the whole pool
#: must end below 2**63 or the arithmetic would overflow or wrap around.
MAX_STAGING_ADDRESS = 1 << 63


class SideChannelProtocolError(TurboWireError, ValueError):
    """A side-channel message is malformed (sizes or fields out of range)."""

    reason = "handshake"


class StagingBoundsError(SideChannelProtocolError):
    """A peer's staging geometry reaches outside the addresses this engine can READ (int64)."""

    reason = "bounds"


def record_to_proto(record: CompatibilityRecord) -> pb.CompatibilityRecord:
    return pb.CompatibilityRecord(
        model=record.model,
        num_layers=record.num_layers,
        num_draft_layers=record.num_draft_layers,
        kv_heads=list(record.kv_heads),
        head_dim=record.head_dim,
        block_size=record.block_size,
        dtype=record.dtype,
        preset=record.preset,
        format_version=record.format_version,
        codec_format_version=record.codec_format_version,
        tp_size=record.tp_size,
        speculative_config=record.speculative_config,
        weights=record.weights,
        model_kv_heads=list(record.model_kv_heads),
        rope_dim=record.rope_dim,
    )


def record_from_proto(msg: pb.CompatibilityRecord) -> CompatibilityRecord:
    if max(len(msg.kv_heads), len(msg.model_kv_heads)) > MAX_LAYERS:
        raise SideChannelProtocolError(
            f"record lists {max(len(msg.kv_heads), len(msg.model_kv_heads))} layers "
            f"(max {MAX_LAYERS})"
        )
    return CompatibilityRecord(
        model=msg.model,
        num_layers=msg.num_layers,
        num_draft_layers=msg.num_draft_layers,
        kv_heads=tuple(msg.kv_heads),
        head_dim=msg.head_dim,
        block_size=msg.block_size,
        dtype=msg.dtype,
        preset=msg.preset,
        format_version=msg.format_version,
        codec_format_version=msg.codec_format_version,
        tp_size=msg.tp_size,
        speculative_config=msg.speculative_config,
        weights=msg.weights,
        model_kv_heads=tuple(msg.model_kv_heads),
        rope_dim=msg.rope_dim,
    )


@dataclass(frozen=True)
class StagingInfo:
    """A worker's NIXL agent and staging pool, as advertised at the handshake."""

    agent_name: str
    agent_metadata: bytes
    base_addr: int
    slot_bytes: int
    num_slots: int
    layer_offsets: tuple[int, ...]
    device_id: int
    mem_type: str
    head_groups: int = 1  # chunks of consecutive heads per staged K/V chunk (decode_tp_size)

    def to_proto(self) -> pb.StagingGeometry:
        return pb.StagingGeometry(
            base_addr=self.base_addr,
            slot_bytes=self.slot_bytes,
            num_slots=self.num_slots,
            layer_offsets=list(self.layer_offsets),
            device_id=self.device_id,
            mem_type=self.mem_type,
            head_groups=self.head_groups,
        )

    @classmethod
    def from_response(cls, resp: pb.HandshakeResponse) -> StagingInfo:
        geo = resp.staging
        if len(resp.agent_metadata) == 0 or len(resp.agent_metadata) > MAX_AGENT_METADATA:
            raise SideChannelProtocolError("handshake carries no (or oversized) NIXL metadata")
        if geo.mem_type not in ("DRAM", "VRAM"):
            raise SideChannelProtocolError(f"unknown staging memory type {geo.mem_type!r}")
        if geo.slot_bytes == 0 or geo.num_slots == 0:
            raise SideChannelProtocolError("peer advertises an empty staging pool")
        if len(geo.layer_offsets) > MAX_LAYERS or any(
            off >= geo.slot_bytes for off in geo.layer_offsets
        ):
            raise SideChannelProtocolError("peer layer offsets fall outside its slot")
        end = geo.base_addr + geo.num_slots * geo.slot_bytes  # Python ints: no wraparound
        if end >= MAX_STAGING_ADDRESS:
            raise StagingBoundsError(
                f"peer staging pool ends at {end:#x} (base {geo.base_addr:#x} + {geo.num_slots} "
                f"slots x {geo.slot_bytes} B): beyond 2**63, not a READ address"
            )
        return cls(
            agent_name=resp.agent_name,
            agent_metadata=bytes(resp.agent_metadata),
            base_addr=geo.base_addr,
            slot_bytes=geo.slot_bytes,
            num_slots=geo.num_slots,
            layer_offsets=tuple(geo.layer_offsets),
            device_id=geo.device_id,
            mem_type=geo.mem_type,
            head_groups=geo.head_groups or 1,  # checked against the chunk's heads by the loader
        )
