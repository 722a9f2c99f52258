"""Stand-ins for the third-party modules the GPU machine lacks (vLLM, NIXL), installed before
turbowire is imported. They replace other people's packages only, never turbowire's code (gRPC
and protobuf, which the worker imports for its side channel, must be installed)."""

from __future__ import annotations

import sys
import types
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
    class KVTransferConfig:
        kv_connector: str
        kv_role: str
        kv_connector_extra_config: dict
        engine_id: str

        def __post_init__(self) -> None:  # vLLM's are properties of the role
            self.is_kv_transfer_instance = True
            self.is_kv_producer = self.kv_role in ("kv_producer", "kv_both")
            self.is_kv_consumer = self.kv_role in ("kv_consumer", "kv_both")

    _module("vllm.config").KVTransferConfig = KVTransferConfig

    @dataclass
    class AttentionSpec:
        block_size: int
        num_kv_heads: int
        head_size: int
        dtype: Any
        sliding_window: int | None = None

    class FullAttentionSpec(AttentionSpec):
        pass

    class SlidingWindowSpec(AttentionSpec):
        pass

    @dataclass
    class MLAAttentionSpec(AttentionSpec):  # vLLM's MLA fields the connector reads
        cache_dtype_str: str | None = None
        alignment: int | None = None
        model_version: str | None = None

    @dataclass
    class MambaSpec:  # a Mamba / linear-attention layer's state (vLLM's fields the connector reads)
        block_size: int
        shapes: tuple
        dtypes: tuple
        mamba_cache_mode: str = "align"
        num_speculative_blocks: int = 0

        @property
        def state_content_size_bytes(self) -> int:
            import math

            import torch
            return sum(math.prod(s) * torch.empty((), dtype=d).element_size()
                       for s, d in zip(self.shapes, self.dtypes))

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
    for cls in (AttentionSpec, FullAttentionSpec, SlidingWindowSpec, MLAAttentionSpec,
                MambaSpec, KVCacheGroupSpec, KVCacheConfig):
        setattr(kvi, cls.__name__, cls)


class _Agent:
    """A NIXL agent that registers memory and nothing else: the bench's loads READ through the
    fake transport it gives the loader (fakes.FakeTransport), never through NIXL."""

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


def install() -> list[str]:
    """Install what this machine lacks; returns the names of the stand-ins installed."""
    installed = ["nixl"]
    stub_nixl()
    try:
        import vllm  # noqa: F401
    except ImportError:
        stub_vllm()
        installed.append("vllm")
    return installed
