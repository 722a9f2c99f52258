"""The stand-in forward pass both GPU benches run: per layer a QKV projection whose K and V go
into the layer's paged cache as vLLM's ``reshape_and_cache`` puts them, the worker's per-layer
save (vLLM calls ``save_kv_layer`` after each attention layer), then an MLP-sized matmul chain."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def stand_in_layers(caches: Mapping[str, torch.Tensor], w: Mapping[str, torch.Tensor],
                    x0: torch.Tensor, slot_mapping: torch.Tensor, *, hidden: int,
                    kv_heads: int, head_dim: int, inter: int, worker: Any, meta: Any) -> None:
    """Every layer of ``caches`` in order; ``worker`` None: the forward alone."""
    kv = kv_heads * head_dim
    x = x0
    for name, cache in caches.items():
        qkv = x @ w["qkv"]
        # vLLM's reshape_and_cache: token t into slot_mapping[t] of the layer's paged cache
        cache[0].view(-1, kv_heads, head_dim).index_copy_(
            0, slot_mapping, qkv[:, hidden:hidden + kv].reshape(-1, kv_heads, head_dim))
        cache[1].view(-1, kv_heads, head_dim).index_copy_(
            0, slot_mapping, qkv[:, hidden + kv:].reshape(-1, kv_heads, head_dim))
        if worker is not None:
            worker.save_kv_layer(name, cache, meta)
        x = ((qkv[:, :hidden] @ w["o"]) @ w["gu"])[:, :inter] @ w["d"]
