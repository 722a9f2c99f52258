"""The connector's only doorway to turbowire.codec / turbowire.kernels (one place to adapt)."""

from __future__ import annotations

from typing import Any

from turbowire.connector.config import ConnectorConfigError
from turbowire.connector.geometry import KVGeometry


def known_presets() -> list[str]:
    from turbowire.codec import list_presets

    return list(list_presets())


def make_codec(preset: str, geometry: KVGeometry) -> Any:
    """A codec for this model's transferred layers; an unknown preset is a config error."""
    from turbowire.codec import Codec

    presets = known_presets()
    if preset not in presets:
        raise ConnectorConfigError(f"preset={preset!r} is unknown: use one of {presets}")
    return Codec(preset, geometry.head_dim, geometry.num_layers)


def codec_format_version() -> int:
    import turbowire.codec as codec

    return int(getattr(codec, "FORMAT_VERSION", 1))
