"""A prefill-like peer process for the integration tests: a real NIXL agent with a staging pool
of opaque payloads, served by the real gRPC side channel. Run in a child process (spawn)."""

from __future__ import annotations

import multiprocessing as mp
import os

import numpy as np

from turbowire.connector.compat import CompatibilityRecord
from turbowire.connector.geometry import KVGeometry, LayerSpec

NUM_LAYERS = 3
SLOT_BYTES = 4096
NUM_SLOTS = 16
LAYER_OFFSETS = (0, 1024, 2048)

GEOMETRY = KVGeometry(
    layers=tuple(LayerSpec(f"model.layers.{i}.self_attn.attn", 2, 64) for i in range(NUM_LAYERS)),
    block_size=32,
    dtype="bfloat16",
)


def record(**over) -> CompatibilityRecord:
    import dataclasses

    base = CompatibilityRecord.build(
        model="tiny-llama",
        geometry=GEOMETRY,
        preset="raw",
        codec_format_version=1,
        tp_size=1,
        speculative_config=None,
        model_kv_heads=(2,) * NUM_LAYERS,
    )
    return dataclasses.replace(base, **over)


def lease_token(request_id: str) -> str:
    """The lease token the peer gives its lease of ``request_id`` (tests present it)."""
    import hashlib

    return hashlib.sha256(request_id.encode()).hexdigest()[:32]


def payload(slot: int) -> np.ndarray:
    """Deterministic bytes of one slot, so the reader can verify what it got."""
    rng = np.random.default_rng(1000 + slot)
    return rng.integers(0, 256, SLOT_BYTES, dtype=np.uint8)


def serve(port_queue: mp.Queue, stop: mp.Event, leased: dict[str, list[int]], lease_seconds: float,
          auth_token: str | None) -> None:
    """Child process body: register staging, lease slots, serve until told to stop."""
    import torch

    from turbowire.connector.sidechannel.convert import StagingInfo
    from turbowire.connector.sidechannel.server import SideChannelServer
    from turbowire.connector.staging import StagingPool
    from turbowire.connector.transports.nixl import NixlTransport

    staging = torch.from_numpy(np.concatenate([payload(s) for s in range(NUM_SLOTS)]))
    transport = NixlTransport(agent_name=f"peer-{os.getpid()}")
    transport.register(staging)
    pool = StagingPool(NUM_SLOTS, lease_seconds)
    for rid, slots in leased.items():
        got = pool.reserve(rid, len(slots))
        assert got == slots, (got, slots)
        pool.lease(rid).token = lease_token(rid)  # known to the test, like params would carry
    info = StagingInfo(
        agent_name=transport.agent_name,
        agent_metadata=transport.local_metadata(),
        base_addr=staging.data_ptr(),
        slot_bytes=SLOT_BYTES,
        num_slots=NUM_SLOTS,
        layer_offsets=LAYER_OFFSETS,
        device_id=0,
        mem_type="DRAM",
    )
    server = SideChannelServer(
        engine_id="engine-P",
        record=record(),
        staging={0: info},
        leases=pool,
        bind_host="127.0.0.1",
        port=0,
        auth_token=auth_token,
    ).start()
    port_queue.put(server.port)
    while not stop.wait(0.05):
        pool.reap()
    port_queue.put(pool.snapshot().used_slots)
    server.stop()
    transport.close()
    port_queue.close()
    port_queue.join_thread()
    os._exit(0)  # skip interpreter teardown of the UCX threads
