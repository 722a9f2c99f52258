"""The control plane between the two processes: a pipe stands in for the gRPC side channel and
for the proxy's hop that hands the decode engine its ``kv_transfer_params``.

The producer sends its worker's real handshake metadata (``TurboWireWorker.handshake_metadata``:
the NIXL agent's metadata, the staging pool's address and geometry) and compatibility record;
the consumer's loader gets them from ``PipeSideChannel.handshake`` as it would from the gRPC
call, and adds the peer to its real NIXL agent. Leases are granted (bench/gpu_path/fakes.py's
``FakeClient``): the bench times bytes and kernels, not the side channel's network.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bench.gpu_path.fakes import FakeClient
from turbowire.connector.sidechannel.client import PeerInfo
from turbowire.connector.sidechannel.convert import StagingInfo


@dataclass(frozen=True)
class ProducerHello:
    """What a prefill worker's handshake carries, as plain fields (picklable)."""

    engine_id: str
    agent_name: str
    agent_metadata: bytes
    base_addr: int
    slot_bytes: int
    num_slots: int
    layer_offsets: tuple[int, ...]
    device_id: int
    mem_type: str
    record: Any  # the worker's CompatibilityRecord

    @classmethod
    def of(cls, worker: Any) -> ProducerHello:
        meta = worker.handshake_metadata
        return cls(worker.engine_id, meta.agent_name, bytes(meta.agent_metadata),
                   meta.base_addr, meta.slot_bytes, meta.num_slots, tuple(meta.layer_offsets),
                   meta.device_id, meta.mem_type, worker.record)


class PipeSideChannel(FakeClient):
    """A prefill engine's side channel answering with the producer's real handshake."""

    def __init__(self, hello: ProducerHello, layout: Any) -> None:
        super().__init__(layout, hello.record, engine_id=hello.engine_id,
                         mem_type=hello.mem_type)
        self.hello = hello

    def handshake(self, record: Any, engine_id: str, tp_rank: int) -> PeerInfo:
        self.calls.append("handshake")
        h = self.hello
        staging = StagingInfo(h.agent_name, h.agent_metadata, h.base_addr, h.slot_bytes,
                              h.num_slots, h.layer_offsets, h.device_id, h.mem_type)
        return PeerInfo(h.engine_id, h.record, staging)
