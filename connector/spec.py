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
from turbowire.connector.codecs import codec_format_version, make_codec, staged_nbytes
from turbowire.connector.compat import (
    CompatibilityRecord,
    has_draft_kv,
    model_identity,
    speculative_factors,
)
from turbowire.connector.config import ConnectorConfigError, TurboWireConfig
from turbowire.connector.geometry import KVGeometry, StagingLayout, layer_sort_key
from turbowire.connector.speculative import SpeculativeSetup
from turbowire.connector.tp_plan import TensorParallelError, model_kv_heads, staged_head_groups
from turbowire.store.fingerprint import vllm_config_fingerprint
from turbowire.store.keys import StoreScope, model_slug

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


@dataclass(frozen=True)
class EngineSetup:
    """What one engine's connector is: KV geometry, codec, staging slots, compatibility."""

    geometry: KVGeometry
    codec: Codec
    layout: StagingLayout
    record: CompatibilityRecord
    is_producer: bool  # stages KV for NIXL peers (kv_producer/kv_both, transport nixl/both)
    is_consumer: bool  # READs KV from NIXL peers
    tp_size: int
    store_scope: StoreScope | None = None  # set when the config's transport uses the store
    speculative: SpeculativeSetup = SpeculativeSetup()
    # trailing prompt tokens the prefill engine leaves out and the decode engine recomputes:
    # the drafter's backoff, or the config's recompute_recent_tokens if more
    prefill_backoff: int = 0

    @classmethod
    def build(cls, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig,
              config: TurboWireConfig) -> EngineSetup:
        geometry = KVGeometry.from_kv_cache_config(
            kv_cache_config, draft_layer_predicate(vllm_config), mla_rope_dim(vllm_config)
        )
        codec = make_codec(config.preset, geometry)
        tp_size = vllm_config.parallel_config.tensor_parallel_size
        groups = head_groups(geometry, config.decode_tp_size, tp_size)
        layout = StagingLayout.build(
            geometry,
            lambda layer, tokens, _heads: staged_nbytes(codec, geometry, layer, tokens, 0, groups),
            config.staging_bytes, groups)
        # the weights' fingerprint (cached: computed once per process): other weights under the
        # same served name neither handshake nor share stored chunks
        weights = vllm_config_fingerprint(vllm_config)
        record = CompatibilityRecord.build(
            model=model_identity(vllm_config),
            geometry=geometry,
            preset=config.preset,
            codec_format_version=codec_format_version(),
            tp_size=tp_size,
            speculative_config=speculative_factors(vllm_config),
            weights=weights,
            model_kv_heads=model_kv_heads(geometry, tp_size, total_kv_heads(vllm_config)),
        )
        ktc = vllm_config.kv_transfer_config
        store_scope = None
        if config.uses_store:
            if geometry.state_groups:
                raise ConnectorConfigError(
                    "transport 'store' does not serve hybrid models (Mamba / linear-attention "
                    "layers beside attention): a stored chunk carries K/V, not the state a "
                    "later request would resume from. Use transport 'nixl'"
                )
            if geometry.frees_out_of_window or geometry.num_groups > 1:
                raise ConnectorConfigError(
                    "transport 'store' does not serve sliding-window layers whose blocks vLLM "
                    "frees (a model whose every layer has a sliding window, or the hybrid KV "
                    "cache manager's sliding-window group): a stored chunk spans them. Use "
                    "transport 'nixl', or for a model with full-attention layers too, "
                    "--disable-hybrid-kv-cache-manager"
                )
            if config.store_chunk_tokens % geometry.block_size:
                fit = max(1, config.store_chunk_tokens // geometry.block_size) * geometry.block_size
                raise ConnectorConfigError(
                    f"store_chunk_tokens={config.store_chunk_tokens} is not a multiple of the KV "
                    f"block size {geometry.block_size}: use "
                    f"{fit}"
                )
            store_scope = StoreScope(
                namespace=config.store_namespace,
                model=model_slug(f"{record.model}.{record.dtype}"),
                preset=config.preset,
                format_version=codec_format_version(),
                chunk_tokens=config.store_chunk_tokens,
                tp_size=tp_size,
                weights=weights,
            )
        # the NIXL roles: with transport "store" an engine neither stages nor READs from peers
        speculative = SpeculativeSetup.from_vllm_config(vllm_config)
        return cls(geometry, codec, layout, record, bool(ktc.is_kv_producer) and config.uses_nixl,
                   bool(ktc.is_kv_consumer) and config.uses_nixl, tp_size, store_scope,
                   speculative, max(speculative.prefill_backoff, config.recompute_recent_tokens))


def head_groups(geometry: KVGeometry, decode_tp: int, tp_size: int) -> int:
    """How many chunks of consecutive heads each K/V chunk is staged as for decode engines of TP
    ``decode_tp`` (1: whole chunks); refuses a size the heads do not split over, at start."""
    heads = {layer.num_kv_heads for layer in geometry.layers
             if not (layer.is_state or layer.is_latent)}
    if decode_tp <= tp_size or not heads:
        return 1  # MLA latents and states move whole: nothing to cut
    if len(heads) != 1:
        raise ConnectorConfigError(f"decode_tp_size={decode_tp}: this model's layers hold "
                                   f"different KV head counts ({sorted(heads)}); leave it 0")
    try:
        return staged_head_groups(decode_tp, tp_size, heads.pop())
    except TensorParallelError as exc:
        raise ConnectorConfigError(f"decode_tp_size={decode_tp}: {exc}") from exc


def mla_rope_dim(vllm_config: VllmConfig) -> int:
    """The RoPE part of an MLA model's cache row (``qk_rope_head_dim``); 0 for other models."""
    model_config = getattr(vllm_config, "model_config", None)
    if model_config is None or not getattr(model_config, "use_mla", False):
        return 0
    return int(getattr(model_config.hf_text_config, "qk_rope_head_dim", 0) or 0)


def draft_layer_predicate(vllm_config: VllmConfig) -> Callable[[str], bool]:
    """Which KV layers belong to a draft model (EAGLE/MTP/draft-model speculative decoding):
    vLLM numbers them after the target model's layers."""
    spec = vllm_config.speculative_config
    if spec is None or not has_draft_kv(spec):
        return lambda name: False
    target_layers = vllm_config.model_config.get_num_layers(vllm_config.parallel_config)
    return lambda name: layer_sort_key(name)[0] >= target_layers


def total_kv_heads(vllm_config: VllmConfig) -> int:
    """The target model's KV heads over all TP ranks (0: unknown, no other TP size reads it)."""
    get = getattr(vllm_config.model_config, "get_total_num_kv_heads", None)
    try:
        return int(get()) if callable(get) else 0
    except (AttributeError, TypeError, ValueError):
        return 0
