"""The KV geometries and the stand-in forward of the producer.

The forward is bench/gpu_path/rig.py's (bf16 matmuls of one layer's shapes, weights shared by
the layers, each layer's K and V written into its paged cache as vLLM's ``reshape_and_cache``
does, ``save_kv_layer`` after it, ``wait_for_save`` after the last layer), for any geometry, and
with a mark between the last layer and ``wait_for_save``: the handoff starts there. rig's is
fixed to Llama-3.1-8B's shapes and its module installs a NIXL stand-in (env.py says why this
bench does not import it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from bench.gpu_path.forward import stand_in_layers

BLOCK = 16  # tokens per KV block, as in bench/gpu_path


@dataclass(frozen=True)
class Model:
    """A decoder's per-layer shapes (bf16 KV, one KV cache group)."""

    name: str
    layers: int
    hidden: int
    inter: int
    q_heads: int
    kv_heads: int
    head_dim: int

    def dense_bytes_per_token(self) -> int:
        """K and V of every layer, bf16."""
        return self.layers * 2 * self.kv_heads * self.head_dim * 2


MODELS = {
    "8b": Model("Llama-3.1-8B", 32, 4096, 14336, 32, 8, 128),
    # Llama-3.1-70B's shapes (80 layers, GQA 64/8, hd128), TP 1: one worker holds every KV head
    "70b": Model("70B-like", 80, 8192, 28672, 64, 8, 128),
}
SMOKE_MODEL = Model("smoke", 2, 256, 512, 2, 1, 128)


def layer_names(n: int) -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(n)]


@dataclass
class Forward:
    """The stand-in forward of ``tokens`` tokens whose KV goes to ``slot_mapping``."""

    model: Model
    tokens: int
    caches: dict[str, torch.Tensor]
    slot_mapping: torch.Tensor
    device: torch.device
    w: dict[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        m = self.model
        kv = m.kv_heads * m.head_dim
        g = torch.Generator(device=self.device).manual_seed(1)

        def weight(a: int, b: int) -> torch.Tensor:
            return (torch.randn(a, b, generator=g, device=self.device) / a ** 0.5).to(
                torch.bfloat16)

        self.w = {"qkv": weight(m.hidden, m.hidden + 2 * kv), "o": weight(m.hidden, m.hidden),
                  "gu": weight(m.hidden, 2 * m.inter), "d": weight(m.inter, m.hidden)}
        self.x0 = torch.randn(self.tokens, m.hidden, generator=g, device=self.device).to(
            torch.bfloat16)

    def run(self, worker: Any, meta: Any, last_layer_done: Callable[[], None]) -> None:
        """The layers (with the worker's per-layer saves when ``worker`` is given), then
        ``last_layer_done()``, then ``wait_for_save``."""
        m = self.model
        stand_in_layers(self.caches, self.w, self.x0, self.slot_mapping, hidden=m.hidden,
                        kv_heads=m.kv_heads, head_dim=m.head_dim, inter=m.inter,
                        worker=worker, meta=meta)
        last_layer_done()
        if worker is not None:
            worker.wait_for_save(meta)
