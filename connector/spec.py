"""The per-engine setup both connector sides derive from vLLM's config, built in one place.

The scheduler (engine core process) and each worker derive the same geometry, codec, staging
layout and compatibility record from the same ``KVCacheConfig``, so only slot indices travel in
the connector metadata; building them here keeps the two from drifting apart.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from turbowire.codec import Codec
from turbowire.connector.codecs import codec_format_version, make_codec
from turbowire.connector.compat import CompatibilityRecord, model_identity, speculative_factors
from turbowire.connector.config import TurboWireConfig
from turbowire.connector.geometry import KVGeometry, StagingLayout, layer_sort_key

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

TRANSPORT = "nixl"  # the metric label of the peer-to-peer path


@dataclass(frozen=True)
class EngineSetup:
    """What one engine's connector is: KV geometry, codec, staging slots, compatibility."""

    geometry: KVGeometry
    codec: Codec
    layout: StagingLayout
    record: CompatibilityRecord
    is_producer: bool
    is_consumer: bool
    tp_size: int

    @classmethod
    def build(cls, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig,
              config: TurboWireConfig) -> EngineSetup:
        geometry = KVGeometry.from_kv_cache_config(
            kv_cache_config, draft_layer_predicate(vllm_config)
        )
        codec = make_codec(config.preset, geometry)
        layout = StagingLayout.build(geometry, codec.encoded_nbytes, config.staging_bytes)
        tp_size = vllm_config.parallel_config.tensor_parallel_size
        record = CompatibilityRecord.build(
            model=model_identity(vllm_config),
            geometry=geometry,
            preset=config.preset,
            codec_format_version=codec_format_version(),
            tp_size=tp_size,
            speculative_config=speculative_factors(vllm_config),
        )
        ktc = vllm_config.kv_transfer_config
        return cls(geometry, codec, layout, record, bool(ktc.is_kv_producer),
                   bool(ktc.is_kv_consumer), tp_size)


def draft_layer_predicate(vllm_config: VllmConfig) -> Callable[[str], bool]:
    """Which KV layers belong to a draft model (EAGLE/MTP/draft-model speculative decoding):
    vLLM numbers them after the target model's layers."""
    spec = vllm_config.speculative_config
    if spec is None or getattr(spec, "method", None) in (None, "ngram", "suffix"):
        return lambda name: False
    target_layers = vllm_config.model_config.get_num_layers(vllm_config.parallel_config)
    return lambda name: layer_sort_key(name)[0] >= target_layers
