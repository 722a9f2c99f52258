"""Where the connector builds its codec: the stock presets and the codec of a model's layers.

The kernels are reached through ``turbowire.kernels`` only (the cache coders, ``connector/
coder``); the wire format's header checks through ``turbowire.codec.wire`` (the store path).
"""

from __future__ import annotations

from typing import Any

from turbowire.connector.geometry import KVGeometry


def known_presets() -> list[str]:
    from turbowire.codec import list_presets

    return list(list_presets())


def make_codec(preset: str, geometry: KVGeometry) -> Any:
    """A codec for this model's transferred layers (the preset was validated with the config:
    ``TurboWireConfig.from_extra_config(known_presets=...)``)."""
    from turbowire.codec import Codec

    return Codec(preset, geometry.head_dim, geometry.num_attention_layers)


def chunk_nbytes(codec: Any, geometry: KVGeometry, layer: int, num_tokens: int,
                 block_index: int, heads: int | None = None) -> int:
    """Exact bytes of the chunk of request block ``block_index`` of ``layer``: the codec's
    size for an attention layer (the first block of a sequence carries extra rows; an MLA
    layer's latent chunk), the state
    chunk's for a Mamba / linear-attention layer (one per request, whatever its tokens).
    ``heads``: a K/V layer's heads in the chunk when not this rank's (a prefill rank of
    another TP size)."""
    spec = geometry.layers[layer]
    if spec.is_state:
        from turbowire.codec.state import state_chunk_nbytes

        return state_chunk_nbytes(spec.state_bytes)
    if spec.is_latent:
        from turbowire.codec.latent import latent_nbytes

        return latent_nbytes(codec, layer, num_tokens, spec.latent_dim, spec.rope_dim,
                             block_index * geometry.block_size)
    return int(codec.encoded_nbytes(layer, num_tokens, heads or spec.num_kv_heads,
                                    block_index * geometry.block_size))


def staged_nbytes(codec: Any, geometry: KVGeometry, layer: int, num_tokens: int,
                  block_index: int, head_groups: int = 1) -> int:
    """Bytes a prefill rank stages for that chunk: a K/V layer's cut into ``head_groups``
    chunks of consecutive heads (``decode_tp_size``) takes that many of the smaller chunk."""
    spec = geometry.layers[layer]
    if head_groups == 1 or spec.is_state or spec.is_latent:
        return chunk_nbytes(codec, geometry, layer, num_tokens, block_index)
    return head_groups * chunk_nbytes(codec, geometry, layer, num_tokens, block_index,
                                      spec.num_kv_heads // head_groups)


def codec_format_version() -> int:
    import turbowire.codec as codec

    return int(getattr(codec, "FORMAT_VERSION", 1))
