"""The engine's registered KV caches: ordered like the geometry, their layouts and fp8 scales.

On CPU the layout carries the KV placement vLLM's attention really uses, probed with vLLM's own
cache-write op for the ISA the layer's attention runs (``turbowire.kernels.cpu_attn_layout``);
the placement found and the implementation serving it are logged once per kind of cache.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from turbowire.connector.geometry import GeometryError, KVGeometry

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)


class EngineCaches:
    """One worker's paged KV caches in geometry order, with a layout per layer."""

    def __init__(self, vllm_config: VllmConfig, geometry: KVGeometry,
                 kv_caches: dict[str, torch.Tensor]) -> None:
        self.vllm_config = vllm_config
        self.geometry = geometry
        missing = [layer.name for layer in geometry.layers if layer.name not in kv_caches]
        if missing:
            raise GeometryError(f"vLLM registered no KV cache for layers {missing[:3]}")
        # an attention layer's cache tensor; a state layer's list of state tensors (vLLM's
        # MambaSpec layers), served through its ``StatePages`` layout
        self.tensors: list[Any] = [kv_caches[layer.name] for layer in geometry.layers]
        self._check_dtypes()
        self._logged: set[tuple] = set()
        self.layouts: list[Any] = [self._layout_of(i, t) for i, t in enumerate(self.tensors)]

    @property
    def device(self) -> torch.device:
        return self.tensors[0].device

    @property
    def num_blocks(self) -> int:
        return int(self.layouts[0].num_blocks)

    def dense_bytes_per_token(self) -> int:
        return self.geometry.dense_bytes_per_token(self.tensors[0].element_size())

    def _check_dtypes(self) -> None:
        """bf16/fp16 caches anywhere; fp8 e4m3 caches in vLLM's GPU layout, with the layer's
        scales readable from vLLM's attention layer (checked now, read again per call). Layers
        are coded one by one, so a draft model's cache may have another dtype."""
        from turbowire.kernels import FP8_CACHE_DTYPES, is_fp8_cache

        attention = self.tensors[:self.geometry.num_attention_layers]
        odd = {t.dtype for t in attention} - {torch.bfloat16, torch.float16, *FP8_CACHE_DTYPES}
        if odd:
            raise GeometryError(
                f"the TurboWire connector serves bf16, fp16 or fp8 e4m3 KV caches, not "
                f"{sorted(map(str, odd))}"
            )
        for layer, cache in enumerate(attention):
            if not is_fp8_cache(cache) or self.geometry.layers[layer].is_latent:
                continue
            if cache.dim() != 5:
                raise GeometryError(
                    "fp8 KV caches are served in vLLM's GPU cache layout (5-D); this engine's are "
                    "CPU attention caches: run vLLM with --kv-cache-dtype auto"
                )
            self.kv_scales(layer)

    def _attention_layer(self, layer: int) -> Any:
        name = self.geometry.layers[layer].name
        context = getattr(getattr(self.vllm_config, "compilation_config", None),
                          "static_forward_context", None) or {}
        return context.get(name)

    def kv_scales(self, layer: int) -> tuple[float, float] | None:
        """The layer's fp8 (K, V) scales as vLLM's attention layer holds them, read per call
        (vLLM may compute them on the first forward pass); None for bf16/fp16 caches."""
        from turbowire.kernels import is_fp8_cache

        spec = self.geometry.layers[layer]
        if spec.is_state or spec.is_latent or not is_fp8_cache(self.tensors[layer]):
            return None
        attn = self._attention_layer(layer)
        if (
            attn is None
            or not hasattr(attn, "_k_scale_float")
            or not hasattr(attn, "_v_scale_float")
        ):
            raise GeometryError(
                f"fp8 KV cache of layer {self.geometry.layers[layer].name}: vLLM's attention layer "
                "with its k/v scales is not in the static forward context"
            )
        return float(attn._k_scale_float), float(attn._v_scale_float)

    def _layout_of(self, layer: int, cache: Any) -> Any:
        from turbowire.kernels import LatentPages, PagedKVLayout, StatePages

        spec = self.geometry.layers[layer]
        if spec.is_latent:
            return LatentPages.from_cache(cache, spec.latent_dim, spec.rope_dim)
        if spec.is_state:
            pages = StatePages.from_cache(cache)
            if pages.state_bytes != spec.state_bytes:
                raise GeometryError(
                    f"state layer {spec.name}: vLLM registered {pages.state_bytes} B of state "
                    f"per block, its KV cache spec says {spec.state_bytes} B"
                )
            return pages

        if cache.dim() != 4 or cache.device.type != "cpu":
            return PagedKVLayout.from_cache(cache, head_dim=self.geometry.head_dim)
        from turbowire.kernels import cpu_attn_layout, served_by

        isa = getattr(self._attention_layer(layer), "isa", None)
        layout = cpu_attn_layout(
            cache, self.geometry.head_dim, isa if isinstance(isa, str) else None
        )
        key = (layout.isa, layout.describe(), cache.dtype, layout.block_size)
        if key not in self._logged:
            self._logged.add(key)
            log = logger.warning if layout.path == "generic" else logger.info
            log(
                "vLLM CPU attention isa %s (%s, block size %d, head_dim %d): KV placed %s; "
                "turbowire serves it with %s",
                layout.isa, str(cache.dtype).replace("torch.", ""), layout.block_size,
                layout.head_dim, layout.describe(), served_by(layout),
            )
        return layout
