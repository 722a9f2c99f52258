"""The state chunk: one layer's recurrent state (Mamba / gated-delta-net) of one request, moved raw.

A hybrid model's linear-attention and Mamba layers keep no per-token K/V but a fixed-size state
per request (vLLM's ``MambaSpec``: a conv state and an SSM state in one cache page). It is small
next to the attention KV of a long prompt and a lossy code would compound at every later token,
so it moves byte for byte in a checksummed container of its own (``FORMAT.md``, "State chunks").
This module is its reference: build and verify one; the kernels copy the pages in and out.

Header (32 bytes, little-endian):

    0   4  magic b"TWST"
    4   1  format version = 1
    5   1  header size / 16 = 2
    6   2  reserved, 0
    8   2  layer index (in the connector's layer order)
    10  2  layers of the model (attention and state layers)
    12  4  body bytes (multiple of 16)
    16  8  tag (chosen by the sender; 0 = none)
    24  4  body checksum, wsum32 of the body
    28  4  header checksum, wsum32 of bytes 0..27
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import torch

from turbowire.codec.errors import (
    ChecksumError,
    FormatError,
    IncompatiblePayloadError,
    TruncatedPayloadError,
    UnsupportedVersionError,
)
from turbowire.codec.wire import align_up, wsum32

STATE_MAGIC = b"TWST"
STATE_VERSION = 1
STATE_HEADER_BYTES = 32
_HEADER = struct.Struct("<4sBBHHHIQI")  # bytes 0..27; the header checksum follows


def state_chunk_nbytes(state_bytes: int) -> int:
    """Bytes of the chunk of a state of ``state_bytes`` bytes (header + body padded to 16)."""
    if state_bytes <= 0:
        raise ValueError(f"a state has a positive size (got {state_bytes})")
    return STATE_HEADER_BYTES + align_up(state_bytes)


def encode_state(layer: int, num_layers: int, pages: Sequence[torch.Tensor], tag: int,
                 out: torch.Tensor) -> int:
    """Write the chunk of one layer's state (``pages``: its tensors' bytes, in order, each a
    1-D uint8 tensor) at the start of ``out`` (1-D uint8, on the pages' device); its bytes."""
    state_bytes = sum(int(p.numel()) for p in pages)
    total = state_chunk_nbytes(state_bytes)
    if out.dtype != torch.uint8 or out.dim() != 1 or out.numel() < total:
        raise ValueError(f"a state chunk needs {total} bytes of 1-D uint8 room")
    body = out[STATE_HEADER_BYTES:total]
    cursor = 0
    for page in pages:
        n = int(page.numel())
        body[cursor:cursor + n].copy_(page)
        cursor += n
    body[cursor:].zero_()
    head = _HEADER.pack(STATE_MAGIC, STATE_VERSION, STATE_HEADER_BYTES // 16, 0, layer,
                        num_layers, total - STATE_HEADER_BYTES, tag, wsum32(body))
    head += struct.pack("<I", wsum32(torch.frombuffer(bytearray(head), dtype=torch.uint8)))
    out[:STATE_HEADER_BYTES].copy_(torch.frombuffer(bytearray(head), dtype=torch.uint8))
    return total


def decode_state(data: torch.Tensor, layer: int, num_layers: int, state_bytes: int,
                 expected_tag: int | None = None) -> torch.Tensor:
    """Verify a state chunk and return its state bytes (a view of ``data``, 1-D uint8).

    Refused with the codec's exceptions: not a state chunk, another version, a checksum that
    does not match, or a valid chunk of another layer, model depth, state size or tag."""
    if data.dtype != torch.uint8 or data.dim() != 1:
        raise FormatError("a state chunk is a 1-D uint8 buffer")
    if data.numel() < STATE_HEADER_BYTES:
        raise TruncatedPayloadError(f"{data.numel()} bytes cannot hold a state chunk header")
    head = bytes(data[:STATE_HEADER_BYTES].cpu().numpy())
    magic, version, hsize, _res, got_layer, got_layers, body_bytes, tag, body_sum = \
        _HEADER.unpack(head[:_HEADER.size])
    if magic != STATE_MAGIC:
        raise FormatError(f"not a state chunk (magic {magic!r})")
    if version != STATE_VERSION:
        raise UnsupportedVersionError(f"state chunk version {version} (this build reads 1)")
    (head_sum,) = struct.unpack("<I", head[_HEADER.size:STATE_HEADER_BYTES])
    if wsum32(torch.frombuffer(bytearray(head[:_HEADER.size]), dtype=torch.uint8)) != head_sum:
        raise ChecksumError("state chunk header checksum mismatch")
    if hsize * 16 != STATE_HEADER_BYTES or body_bytes % 16:
        raise FormatError(f"inconsistent state chunk header (header {hsize * 16} B, body "
                          f"{body_bytes} B)")
    problems = []
    if got_layer != layer:
        problems.append(f"layer {got_layer} (expected {layer})")
    if got_layers != num_layers:
        problems.append(f"{got_layers} layers (expected {num_layers})")
    if body_bytes != align_up(state_bytes):
        problems.append(f"body {body_bytes} B (expected {align_up(state_bytes)})")
    if expected_tag is not None and tag != expected_tag:
        problems.append(f"tag {tag:#x} (expected {expected_tag:#x})")
    if problems:
        raise IncompatiblePayloadError("state chunk of another transfer: " + ", ".join(problems))
    if data.numel() < STATE_HEADER_BYTES + body_bytes:
        raise TruncatedPayloadError(
            f"state chunk of {STATE_HEADER_BYTES + body_bytes} bytes in a {data.numel()}-byte "
            "buffer")
    body = data[STATE_HEADER_BYTES:STATE_HEADER_BYTES + body_bytes]
    if wsum32(body) != body_sum:
        raise ChecksumError("state chunk body checksum mismatch")
    return body[:state_bytes]
