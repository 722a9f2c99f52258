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
    """What a prefill worker's handshake carries (picklable): its staging as the side channel
    advertises it, and its compatibility record."""

    engine_id: str
    staging: StagingInfo
    record: Any  # the worker's CompatibilityRecord

    @property
    def mem_type(self) -> str:
        return self.staging.mem_type

    @classmethod
    def of(cls, worker: Any) -> ProducerHello:
        meta = worker.handshake_metadata
        return cls(worker.engine_id,
                   StagingInfo(meta.agent_name, bytes(meta.agent_metadata), meta.base_addr,
                               meta.slot_bytes, meta.num_slots, tuple(meta.layer_offsets),
                               meta.device_id, meta.mem_type),
                   worker.record)


class PipeSideChannel(FakeClient):
    """A prefill engine's side channel answering with the producer's real handshake."""

    def __init__(self, hello: ProducerHello, layout: Any) -> None:
        super().__init__(layout, hello.record, engine_id=hello.engine_id,
                         mem_type=hello.mem_type)
        self.hello = hello

    def handshake(self, record: Any, engine_id: str, tp_rank: int) -> PeerInfo:
        self.calls.append("handshake")
        return PeerInfo(self.hello.engine_id, self.hello.record, self.hello.staging)
