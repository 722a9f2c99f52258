"""Stand-ins for what a worker talks to (NIXL transfers and transport, a prefill engine's side
channel, an executor) and a worker built the way vLLM builds one, for the connector's tests."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

from turbowire.connector.sidechannel.client import PeerInfo
from turbowire.connector.sidechannel.convert import StagingInfo
from turbowire.connector.transports.base import TransferState, TransportError


class FakeTransfer:
    """A READ: PENDING until a test sets ``current``."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.current = TransferState.PENDING
        self.released = False

    def state(self) -> TransferState:
        return self.current

    def release(self) -> None:
        self.released = True


@dataclass
class FakeTransport:
    """NIXL for one worker: registers buffers, adds the prefill peer, records its READs (they
    land when the test says so, or at once with ``auto_land``)."""

    name: str = "fake"
    agent_name: str = "decode-agent"
    reads: list[FakeTransfer] = field(default_factory=list)
    fail_read: bool = False
    auto_land: bool = False

    def register(self, tensor: torch.Tensor) -> None:
        pass

    def local_metadata(self) -> bytes:
        return b"md"

    def add_peer(self, metadata: bytes) -> str:
        return "prefill-agent"

    def read(self, peer, local, remote, mem_type, notif=b""):
        assert peer == "prefill-agent" and len(local) == len(remote)
        if self.fail_read:
            raise TransportError("the peer vanished")
        x = FakeTransfer(int(local[:, 1].sum()))
        if self.auto_land:
            x.current = TransferState.DONE
        self.reads.append(x)
        return x

    def close(self) -> None:
        pass


class FakeClient:
    """A prefill engine's side channel: leases in ``expired`` are gone, those in ``refused`` are
    held but named with a token that is not theirs (the real pool answers both ``unknown``, the
    refused ones ``refused`` too)."""

    def __init__(self, layout, record, engine_id: str = "prefill-engine",
                 mem_type: str = "DRAM") -> None:
        self.layout, self.record, self.engine_id, self.mem_type = layout, record, engine_id, \
            mem_type
        self.expired: set[str] = set()
        self.refused: set[str] = set()
        self.released: list[str] = []
        self.calls: list[str] = []
        self.tokens: list[tuple[str, list[str] | None]] = []  # (call, lease_tokens presented)

    def handshake(self, record, engine_id, tp_rank):
        self.calls.append("handshake")
        staging = StagingInfo("prefill-agent", b"md", 1 << 20, self.layout.slot_bytes,
                              self.layout.num_slots, tuple(self.layout.layer_offsets), 0,
                              self.mem_type)
        return PeerInfo(self.engine_id, self.record, staging)

    def _reply(self, ids):
        refused = [i for i in ids if i in self.refused]
        return SimpleNamespace(done=[i for i in ids if i not in self.expired | self.refused],
                               unknown=[i for i in ids if i in self.expired] + refused,
                               refused=refused)

    def heartbeat(self, ids, engine_id="", lease_tokens=None, **claim):
        self.calls.append("heartbeat")
        self.tokens.append(("heartbeat", lease_tokens))
        return self._reply(ids)

    def release(self, ids, engine_id="", tp_rank=0, lease_tokens=None):
        self.calls.append("release")
        self.tokens.append(("release", lease_tokens))
        self.released.extend(ids)
        return self._reply(ids)


class InlineExecutor:
    """Runs each call at once: the state machine then advances deterministically."""

    def submit(self, fn, *args, **kwargs) -> Future:
        f: Future = Future()
        try:
            f.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller through the future
            f.set_exception(exc)
        return f


def stand_in_configs(extra: dict[str, Any], layer_names: list[str], *, block_size: int,
                     num_kv_heads: int, head_size: int, num_blocks: int, engine_id: str,
                     kv_role: str = "kv_both", dtype: torch.dtype = torch.bfloat16,
                     forward_context: dict[str, Any] | None = None):
    """(vllm_config, kv_cache_config) as vLLM hands them to a connector: the parts it reads.
    ``forward_context``: vLLM's attention layers by name (an fp8 cache's k/v scales)."""
    from vllm.config import KVTransferConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    ktc = KVTransferConfig(kv_connector="TurboWireConnector", kv_role=kv_role,
                           kv_connector_extra_config=extra, engine_id=engine_id)
    vcfg = SimpleNamespace(
        kv_transfer_config=ktc,
        parallel_config=SimpleNamespace(tensor_parallel_size=1, data_parallel_index=0),
        model_config=SimpleNamespace(model="/m/tiny", served_model_name="tiny"),
        speculative_config=None,
        compilation_config=SimpleNamespace(static_forward_context=forward_context or {}))
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=num_kv_heads,
                             head_size=head_size, dtype=dtype)
    kcfg = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(layer_names, spec)])
    return vcfg, kcfg


def make_worker(monkeypatch, extra: dict[str, Any], layer_names: list[str], *, engine_id: str,
                transport: Any = None, **shape: Any):
    """A TurboWireWorker built from ``stand_in_configs`` the way vLLM builds one, its NIXL
    transport replaced by ``transport`` (a ``FakeTransport`` unless given)."""
    from turbowire.connector import worker as worker_mod
    from turbowire.connector.config import TurboWireConfig

    wire = transport if transport is not None else FakeTransport()
    monkeypatch.setattr(worker_mod, "make_transport", lambda config, name: wire)
    vcfg, kcfg = stand_in_configs(extra, layer_names, engine_id=engine_id, **shape)
    cfg = TurboWireConfig.from_extra_config(extra, environ={})
    return worker_mod.TurboWireWorker(vcfg, kcfg, cfg, engine_id)


def use_cuda_coder(worker, kernel_config: Any = "auto") -> Any:
    """Give a worker with CPU caches the CUDA coder (Triton's interpreter: the same plans,
    launched inline without streams), where its loader and store path reach it too."""
    coder = worker.make_coder("cuda", kernel_config=kernel_config)
    worker.coder = coder
    if worker.loader is not None:
        worker.loader.decode = coder.decode
        worker.loader.prepare = coder.prepare_load
    if worker.store is not None:
        worker.store.coder = coder
    return coder
