"""The latent chunk: one MLA layer's cache rows (DeepSeek V2/V3, Kimi) for a run of tokens.

An MLA layer caches one row per token, not K and V per head: the compressed latent ``kv_c``
(``kv_lora_rank`` wide, 512 in DeepSeek V2/V3) and the RoPE part of the key ``k_pe``
(``qk_rope_head_dim``, 64), side by side. Every query head reads the whole row twice: as its
key (through the absorbed ``W_UK``) and as its value (through ``W_UV``). So:

- ``kv_c`` is coded with the preset's **key** stream, in vectors of ``codec.head_dim`` (each
  rotated and scaled on its own, like one K head): its error reaches the scores through the
  softmax, the way a key's does. A preset that keeps keys raw (``k16v4``) keeps the latent raw.
- ``k_pe`` crosses raw: it is an eighth of the row and carries the positions.

The container is the K/V chunk's (``FORMAT.md``, "Latent chunks"): the same 48-byte header with
flag bit 1 set, ``num_heads`` = latent vectors per token, ``head_dim`` = the vector width, bytes
18..19 = the RoPE width; the body is the latent stream then the raw RoPE stream. A K/V decoder
refuses a latent chunk and this one refuses a K/V chunk.
"""

from __future__ import annotations

import torch

from turbowire.codec.codec import Codec, EncodedChunk
from turbowire.codec.errors import GeometryError, IncompatiblePayloadError
from turbowire.codec.presets import RAW
from turbowire.codec.streams import StreamLayout, decode_stream, encode_stream, stream_layout
from turbowire.codec.wire import (
    DTYPE_CODES,
    HEADER_BYTES,
    ChunkHeader,
    as_uint8,
    parse_header,
    verify_body,
    wsum32,
)

MAX_ROPE_DIM = 1 << 15  # bytes 18..19 of the header


def check_latent_dims(codec: Codec, latent_dim: int, rope_dim: int) -> int:
    """Latent vectors per token; refuses widths the codec's vectors do not tile."""
    if latent_dim <= 0 or latent_dim % codec.head_dim:
        raise GeometryError(
            f"an MLA latent of {latent_dim} is not a whole number of the codec's "
            f"{codec.head_dim}-wide vectors"
        )
    if not 0 < rope_dim < MAX_ROPE_DIM:
        raise GeometryError(f"the RoPE part of an MLA row is 1..{MAX_ROPE_DIM - 1} wide, "
                            f"got {rope_dim}")
    return latent_dim // codec.head_dim


def _streams(codec: Codec, layer: int, tokens: int, vectors: int, rope_dim: int,
             start: bool) -> tuple[StreamLayout, StreamLayout]:
    spec = codec.policy(layer).k
    return (stream_layout(spec, tokens, vectors, codec.head_dim, start),
            stream_layout(RAW, tokens, 1, rope_dim, start))


def latent_header(codec: Codec, layer: int, num_tokens: int, latent_dim: int, rope_dim: int,
                  token_offset: int = 0, dtype: torch.dtype = torch.bfloat16, tag: int = 0,
                  body_checksum: int = 0) -> ChunkHeader:
    """The header of a latent chunk (its ``nbytes`` is the chunk's size)."""
    vectors = check_latent_dims(codec, latent_dim, rope_dim)
    # the K/V layout checks tokens, heads and dtype the same way
    codec.layout(layer, num_tokens, vectors, token_offset, dtype)
    c, pe = _streams(codec, layer, num_tokens, vectors, rope_dim, token_offset == 0)
    return ChunkHeader(
        preset_id=codec.preset.preset_id, layer=layer, num_layers=codec.num_layers,
        num_heads=vectors, head_dim=codec.head_dim, dtype=dtype, num_tokens=num_tokens,
        token_offset=token_offset, body_nbytes=c.nbytes + pe.nbytes, tag=tag,
        body_checksum=body_checksum, rope_dim=rope_dim,
    )


def latent_nbytes(codec: Codec, layer: int, num_tokens: int, latent_dim: int, rope_dim: int,
                  token_offset: int = 0) -> int:
    """Exact size of the chunk ``encode_latent`` would produce."""
    return latent_header(codec, layer, num_tokens, latent_dim, rope_dim, token_offset).nbytes


def encode_latent(codec: Codec, layer: int, latent: torch.Tensor, rope: torch.Tensor, *,
                  tag: int = 0, token_offset: int = 0) -> EncodedChunk:
    """Encode ``latent`` [T, latent_dim] and ``rope`` [T, rope_dim] (bf16/fp16) of tokens
    starting at ``token_offset``."""
    if latent.dim() != 2 or rope.dim() != 2 or latent.shape[0] != rope.shape[0]:
        raise GeometryError(f"latent and rope must be [T, L] and [T, R], got "
                            f"{tuple(latent.shape)} and {tuple(rope.shape)}")
    if latent.dtype != rope.dtype or latent.dtype not in DTYPE_CODES:
        raise GeometryError(f"latent/rope dtype must be bfloat16 or float16, got "
                            f"{latent.dtype}/{rope.dtype}")
    if not 0 <= tag < 1 << 64:
        raise GeometryError("tag must fit in 64 unsigned bits")
    tokens, latent_dim = latent.shape
    rope_dim = rope.shape[1]
    header = latent_header(codec, layer, tokens, latent_dim, rope_dim, token_offset,
                           latent.dtype, tag)
    start = token_offset == 0
    body = torch.cat([
        encode_stream(codec.policy(layer).k, latent.reshape(tokens, header.num_heads,
                                                            codec.head_dim), start),
        encode_stream(RAW, rope.reshape(tokens, 1, rope_dim), start),
    ])
    header = ChunkHeader(**{**header.__dict__, "body_checksum": wsum32(body)})
    head = torch.frombuffer(bytearray(header.pack()), dtype=torch.uint8).to(body.device)
    return EncodedChunk(header, torch.cat([head, body]))


def check_latent_chunk(
    codec: Codec,
    layer: int,
    data: torch.Tensor,
    latent_dim: int,
    rope_dim: int,
    *,
    expected_tag: int | None = None,
    expected_tokens: int | None = None,
    expected_offset: int | None = None,
) -> tuple[ChunkHeader, torch.Tensor]:
    """Verify that ``data`` (uint8) is the latent chunk of this layer and geometry that the caller
    expects, body checksum included, without decoding it: a caller that writes several chunks
    all or nothing checks each first. Returns its header and body."""
    header = parse_header(data)
    vectors = check_latent_dims(codec, latent_dim, rope_dim)
    if not header.is_latent:
        raise IncompatiblePayloadError("chunk refused: a K/V chunk where an MLA latent chunk "
                                       "was expected")
    latent_only = ChunkHeader(**{**header.__dict__, "rope_dim": 0})
    codec.check_compatible(latent_only, layer, expected_tag, expected_tokens, expected_offset)
    if header.num_heads != vectors or header.rope_dim != rope_dim:
        raise IncompatiblePayloadError(
            f"chunk refused: a latent of {header.num_heads} x {header.head_dim} + RoPE "
            f"{header.rope_dim} (expected {latent_dim} + {rope_dim})")
    body = verify_body(header, data)
    c, pe = _streams(codec, layer, header.num_tokens, vectors, rope_dim, header.sequence_start)
    if c.nbytes + pe.nbytes != header.body_nbytes:
        raise IncompatiblePayloadError(
            f"body is {header.body_nbytes} bytes; preset {codec.preset.name} at this geometry "
            f"needs {c.nbytes + pe.nbytes}")
    return header, body


def decode_latent(
    codec: Codec,
    layer: int,
    encoded: EncodedChunk | bytes | bytearray | memoryview | torch.Tensor,
    latent_dim: int,
    rope_dim: int,
    *,
    expected_tag: int | None = None,
    expected_tokens: int | None = None,
    expected_offset: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify a latent chunk of this layer and geometry; returns (latent [T, L], rope [T, R])."""
    data = encoded.data if isinstance(encoded, EncodedChunk) else as_uint8(encoded)
    header, body = check_latent_chunk(codec, layer, data, latent_dim, rope_dim,
                                      expected_tag=expected_tag, expected_tokens=expected_tokens,
                                      expected_offset=expected_offset)
    start, tokens, vectors = header.sequence_start, header.num_tokens, header.num_heads
    c, pe = _streams(codec, layer, tokens, vectors, rope_dim, start)
    latent = decode_stream(codec.policy(layer).k, body[:c.nbytes], tokens, vectors,
                           codec.head_dim, header.dtype, start)
    rope = decode_stream(RAW, body[c.nbytes:c.nbytes + pe.nbytes], tokens, 1, rope_dim,
                         header.dtype, start)
    return latent.reshape(tokens, latent_dim), rope.reshape(tokens, rope_dim)


__all__ = ["HEADER_BYTES", "check_latent_chunk", "check_latent_dims", "decode_latent",
           "encode_latent", "latent_header", "latent_nbytes"]
