"""turbowire.codec: the reference TurboQuant+ KV codec (pure PyTorch, CPU and GPU).

The single source of truth for the math and the bytes; kernels are tested against it.
"""

from turbowire.codec.codec import MAX_HEAD_DIM, ChunkLayout, Codec, EncodedChunk, check_head_dim
from turbowire.codec.errors import (
    ChecksumError,
    CodecError,
    FormatError,
    GeometryError,
    IncompatiblePayloadError,
    TruncatedPayloadError,
    UnknownPresetError,
    UnsupportedVersionError,
)
from turbowire.codec.presets import Preset, get_preset, list_presets
from turbowire.codec.streams import StreamSpec
from turbowire.codec.wire import FORMAT_VERSION, HEADER_BYTES, ChunkHeader, parse_header

__all__ = [
    "Codec", "ChunkLayout", "EncodedChunk", "ChunkHeader", "StreamSpec", "Preset",
    "list_presets", "get_preset", "parse_header", "FORMAT_VERSION", "HEADER_BYTES",
    "MAX_HEAD_DIM", "check_head_dim", "CodecError", "FormatError", "ChecksumError",
    "TruncatedPayloadError",
    "UnsupportedVersionError", "IncompatiblePayloadError", "GeometryError", "UnknownPresetError",
]
