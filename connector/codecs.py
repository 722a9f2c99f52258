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

    return Codec(preset, geometry.head_dim, geometry.num_layers)


def codec_format_version() -> int:
    import turbowire.codec as codec

    return int(getattr(codec, "FORMAT_VERSION", 1))
