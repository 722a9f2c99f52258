"""Stand-ins for the third-party modules the GPU machine lacks (vLLM, NIXL, gRPC), installed
before turbowire is imported. They replace other people's packages only, never turbowire's code,
with one exception where gRPC is missing (see ``stub_side_channel_client``)."""

from __future__ import annotations

import sys
import types
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any


def _module(name: str) -> types.ModuleType:
    """``sys.modules[name]``, created (with its parents) as an empty package if missing."""
    found = sys.modules.get(name)
    if found is not None:
        return found
    made = types.ModuleType(name)
    made.__path__ = []  # type: ignore[attr-defined]
    sys.modules[name] = made
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(_module(parent), child, made)
    return made


def stub_vllm() -> None:
    """The vLLM names turbowire's worker side imports, as plain classes."""
    from abc import ABC

    base = _module("vllm.distributed.kv_transfer.kv_connector.v1.base")
    for name in ("KVConnectorMetadata", "KVConnectorHandshakeMetadata",
                 "KVConnectorWorkerMetadata"):
        setattr(base, name, type(name, (ABC,), {}))

    @dataclass
    class KVConnectorStats:
        data: dict = field(default_factory=dict)

    _module("vllm.distributed.kv_transfer.kv_connector.v1.metrics").KVConnectorStats = \
        KVConnectorStats

    def get_tensor_model_parallel_rank() -> int:
        raise AssertionError("no vLLM parallel state in this benchmark")

    _module("vllm.distributed.parallel_state").get_tensor_model_parallel_rank = \
        get_tensor_model_parallel_rank

    @dataclass
    class AttentionSpec:
        block_size: int
        num_kv_heads: int
        head_size: int
        dtype: Any
        sliding_window: int | None = None

    class FullAttentionSpec(AttentionSpec):
        pass

    class MLAAttentionSpec(AttentionSpec):
        pass

    @dataclass
    class KVCacheGroupSpec:
        layer_names: list
        kv_cache_spec: Any

    @dataclass
    class KVCacheConfig:
        num_blocks: int
        kv_cache_tensors: list
        kv_cache_groups: list

    kvi = _module("vllm.v1.kv_cache_interface")
    for cls in (AttentionSpec, FullAttentionSpec, MLAAttentionSpec, KVCacheGroupSpec,
                KVCacheConfig):
        setattr(kvi, cls.__name__, cls)


class _Agent:
    """A NIXL agent that registers memory and nothing else: the bench's loads READ through the
    fake transport it gives the loader (rig.FakeTransport), never through NIXL."""

    def __init__(self, name: str, config: Any = None) -> None:
        self.name = name

    def get_plugin_list(self) -> list[str]:
        return ["UCX"]

    def create_backend(self, backend: str, params: dict) -> None:
        pass

    def register_memory(self, tensor: Any, backends: Any = None) -> object:
        return object()

    def deregister_memory(self, reg: Any, backends: Any = None) -> None:
        pass

    def get_agent_metadata(self) -> bytes:
        return b"bench-agent"

    def add_remote_agent(self, metadata: bytes) -> bytes:
        return b"prefill-agent"

    def make_connection(self, name: str) -> None:
        pass

    def remove_remote_agent(self, name: str) -> None:
        pass

    def get_new_notifs(self) -> dict:
        return {}


def stub_nixl() -> None:
    """Always: the bench measures the connector's path, not NIXL's (nor needs its plugins)."""
    api = _module("nixl._api")
    api.nixl_agent = _Agent
    api.nixl_agent_config = lambda backends=(): SimpleNamespace(backends=backends)


class _PeerExecutors:
    """The worker's per-peer executor, one pool for all (the bench's loads run inline)."""

    def __init__(self, max_peers: int, threads_per_peer: int = 2, **kw: Any) -> None:
        self._pool = ThreadPoolExecutor(max_workers=threads_per_peer)

    def submit_to(self, key: Any, fn: Any, *args: Any, **kwargs: Any) -> Future:
        return self._pool.submit(fn, *args, **kwargs)

    def submit(self, fn: Any, *args: Any, **kwargs: Any) -> Future:
        return self._pool.submit(fn, *args, **kwargs)

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        self._pool.shutdown(wait=wait, cancel_futures=cancel_futures)


class _ClientPool:
    """The side channel's client pool: the bench gives the loader its own fake clients."""

    @classmethod
    def from_config(cls, config: Any) -> _ClientPool:
        return cls()

    def get(self, host: str, port: int) -> Any:
        raise RuntimeError("the benchmark gives its loaders fake side-channel clients")

    def close(self) -> None:
        pass


class _PeerTimeoutError(TimeoutError):
    pass


def stub_side_channel_client() -> None:
    """Where gRPC (and its generated protobuf code) is not installed, the side channel's client
    module cannot be imported, and ``connector/worker.py`` imports it at the top (for
    ``PeerExecutors``). This registers a stand-in under the product's module name: the one place
    the bench stands in for turbowire code (the report of issue 34 asks for a gRPC-free import
    of ``PeerExecutors``)."""
    stub = types.ModuleType("turbowire.connector.sidechannel.client")
    stub.ClientPool = _ClientPool
    stub.PeerExecutors = _PeerExecutors
    stub.PeerInfo = SimpleNamespace
    stub.PeerTimeoutError = _PeerTimeoutError
    sys.modules[stub.__name__] = stub


def install() -> list[str]:
    """Install what this machine lacks; returns the names of the stand-ins installed."""
    installed = ["nixl"]
    stub_nixl()
    try:
        import vllm  # noqa: F401
    except ImportError:
        stub_vllm()
        installed.append("vllm")
    try:
        import google.protobuf  # noqa: F401
        import grpc  # noqa: F401
    except ImportError:
        stub_side_channel_client()
        installed.append("side-channel client")
    return installed
