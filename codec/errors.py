"""Exceptions of the codec: each names what was wrong with a payload or a request."""

from __future__ import annotations

from turbowire.errors import TurboWireError


class CodecError(TurboWireError, ValueError):
    """Base class: the codec refused its input."""

    reason = "format"


class UnknownPresetError(CodecError):
    """The preset name or id is not one this build knows."""


class FormatError(CodecError):
    """The bytes are not a turbowire chunk (bad magic, sizes, or an inconsistent header)."""


class UnsupportedVersionError(FormatError):
    """The chunk uses a format version this build does not understand."""


class TruncatedPayloadError(FormatError):
    """The buffer is shorter than the header says the chunk is."""


class ChecksumError(FormatError):
    """The header or body checksum does not match: the bytes were corrupted in flight or at rest."""

    reason = "checksum"


class IncompatiblePayloadError(CodecError):
    """A valid chunk that does not fit this decoder (other preset, layer, geometry or tag)."""


class GeometryError(CodecError):
    """Tensors handed to the encoder have the wrong shape or dtype."""
