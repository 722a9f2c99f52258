"""The chunk container: a fixed 48-byte header, then the body, both checksummed.

Byte layout (little-endian; documented with the body sections in codec/FORMAT.md):

    off size field
    0   4    magic b"TWKV"
    4   1    format version (FORMAT_VERSION)
    5   1    header size in 16-byte units (3)
    6   2    preset id
    8   2    layer index
    10  2    number of layers of the model
    12  2    KV heads in the chunk
    14  2    head_dim
    16  1    source dtype (1 = bfloat16, 2 = float16)
    17  1    flags (bit 0: the chunk starts the sequence, token_offset == 0; bit 1: an MLA
             latent chunk, turbowire.codec.latent)
    18  2    a latent chunk's raw RoPE width (rope_dim); zero in a K/V chunk
    20  4    tokens in the chunk
    24  4    position of the chunk's first token in the sequence
    28  4    body bytes (a multiple of 16)
    32  8    tag (chosen by the sender, e.g. a transfer id; 0 = none)
    40  4    body checksum, wsum32 of the body
    44  4    header checksum, wsum32 of bytes 0..43

wsum32 is sum_i w_i·(2i+1) mod 2**32 over the little-endian 32-bit words w_i: any single flipped
bit changes it, and it is a plain reduction that a GPU computes without a serial loop.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch

from turbowire.codec.errors import (
    ChecksumError,
    FormatError,
    TruncatedPayloadError,
    UnsupportedVersionError,
)

MAGIC = b"TWKV"
FORMAT_VERSION = 1
HEADER_BYTES = 48
ALIGN = 16
_HEADER = struct.Struct("<4sBBHHHHHBBHIIIQII")
assert _HEADER.size == HEADER_BYTES

DTYPE_CODES: dict[torch.dtype, int] = {torch.bfloat16: 1, torch.float16: 2}
CODE_DTYPES: dict[int, torch.dtype] = {v: k for k, v in DTYPE_CODES.items()}
FLAG_SEQUENCE_START = 1
FLAG_LATENT = 2


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def wsum32(data: torch.Tensor) -> int:
    """Checksum of a uint8 tensor whose length is a multiple of 4 (see module doc)."""
    if data.dtype != torch.uint8 or data.dim() != 1:
        raise TypeError("wsum32 takes a 1-D uint8 tensor")
    if data.numel() % 4:
        raise ValueError("wsum32 needs a whole number of 32-bit words")
    words = data.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    weights = torch.arange(words.numel(), dtype=torch.int64, device=data.device) * 2 + 1
    # (w · weight) mod 2**32 stays below 2**32; a sum of up to 2**31 of them fits in int64.
    return int(((words * (weights & 0xFFFFFFFF)) & 0xFFFFFFFF).sum().item() & 0xFFFFFFFF)


@dataclass(frozen=True)
class ChunkHeader:
    """What a chunk says about itself."""

    preset_id: int
    layer: int
    num_layers: int
    num_heads: int
    head_dim: int
    dtype: torch.dtype
    num_tokens: int
    token_offset: int
    body_nbytes: int
    tag: int
    body_checksum: int
    version: int = FORMAT_VERSION
    #: an MLA latent chunk's raw RoPE key width (``turbowire.codec.latent``); 0: a K/V chunk
    rope_dim: int = 0

    @property
    def nbytes(self) -> int:
        """Whole chunk: header and body."""
        return HEADER_BYTES + self.body_nbytes

    @property
    def sequence_start(self) -> bool:
        return self.token_offset == 0

    @property
    def is_latent(self) -> bool:
        return self.rope_dim > 0

    def pack(self) -> bytes:
        flags = FLAG_SEQUENCE_START if self.sequence_start else 0
        flags |= FLAG_LATENT if self.is_latent else 0
        head = _HEADER.pack(
            MAGIC, self.version, HEADER_BYTES // 16, self.preset_id, self.layer,
            self.num_layers, self.num_heads, self.head_dim, DTYPE_CODES[self.dtype], flags,
            self.rope_dim,
            self.num_tokens, self.token_offset, self.body_nbytes, self.tag, self.body_checksum, 0,
        )
        check = wsum32(torch.frombuffer(bytearray(head[:44]), dtype=torch.uint8))
        return head[:44] + struct.pack("<I", check)


def as_uint8(buf: object) -> torch.Tensor:
    """View bytes, bytearray, memoryview or a uint8 tensor as a flat uint8 CPU/GPU tensor."""
    if isinstance(buf, torch.Tensor):
        if buf.dtype != torch.uint8:
            raise FormatError(f"payload tensors must be uint8, got {buf.dtype}")
        return buf.reshape(-1)
    if isinstance(buf, (bytes, bytearray, memoryview)):
        mv = memoryview(buf).cast("B")
        if len(mv) == 0:
            raise TruncatedPayloadError("empty payload")
        if mv.readonly:
            return torch.frombuffer(bytearray(mv), dtype=torch.uint8)
        return torch.frombuffer(mv, dtype=torch.uint8)
    raise FormatError(f"cannot read a chunk from {type(buf).__name__}")


def parse_header(buf: object) -> ChunkHeader:
    """Parse and validate the header at the start of ``buf`` (the body is not checked here)."""
    data = as_uint8(buf)
    if data.numel() < HEADER_BYTES:
        raise TruncatedPayloadError(
            f"payload has {data.numel()} bytes, a chunk header alone has {HEADER_BYTES}"
        )
    raw = bytes(data[:HEADER_BYTES].cpu().numpy().tobytes())
    (magic, version, hunits, preset_id, layer, num_layers, heads, head_dim, dtype_code, flags,
     rope_dim, tokens, offset, body_nbytes, tag, body_check, head_check) = _HEADER.unpack(raw)
    if magic != MAGIC:
        raise FormatError(f"not a turbowire chunk (magic {magic!r}, expected {MAGIC!r})")
    if version != FORMAT_VERSION:
        raise UnsupportedVersionError(
            f"chunk format version {version}; this build reads version {FORMAT_VERSION}"
        )
    expected = wsum32(torch.frombuffer(bytearray(raw[:44]), dtype=torch.uint8))
    if head_check != expected:
        raise ChecksumError(f"header checksum {head_check:#010x} != computed {expected:#010x}")
    if hunits * 16 != HEADER_BYTES:
        raise FormatError("header size is not what format version 1 defines")
    if dtype_code not in CODE_DTYPES:
        raise FormatError(f"unknown source dtype code {dtype_code}")
    if bool(flags & FLAG_SEQUENCE_START) != (offset == 0) or flags & ~(
        FLAG_SEQUENCE_START | FLAG_LATENT
    ):
        raise FormatError(f"flags {flags:#x} disagree with token offset {offset}")
    if bool(flags & FLAG_LATENT) != (rope_dim > 0):
        raise FormatError(f"flags {flags:#x} disagree with the RoPE width field {rope_dim}")
    if body_nbytes % ALIGN:
        raise FormatError(f"body size {body_nbytes} is not a multiple of {ALIGN}")
    if layer >= num_layers or heads == 0 or head_dim == 0 or tokens == 0:
        raise FormatError(
            f"impossible geometry: layer {layer}/{num_layers}, {heads} heads, "
            f"head_dim {head_dim}, {tokens} tokens"
        )
    return ChunkHeader(
        preset_id=preset_id, layer=layer, num_layers=num_layers, num_heads=heads,
        head_dim=head_dim, dtype=CODE_DTYPES[dtype_code], num_tokens=tokens, token_offset=offset,
        body_nbytes=body_nbytes, tag=tag, body_checksum=body_check, version=version,
        rope_dim=rope_dim,
    )


def verify_body(header: ChunkHeader, data: torch.Tensor) -> torch.Tensor:
    """Return the body view of a whole chunk after checking its length and checksum."""
    if data.numel() < header.nbytes:
        raise TruncatedPayloadError(
            f"chunk is {data.numel()} bytes, its header says {header.nbytes}"
        )
    body = data[HEADER_BYTES : header.nbytes]
    actual = wsum32(body)
    if actual != header.body_checksum:
        raise ChecksumError(
            f"body checksum {actual:#010x} != {header.body_checksum:#010x} in the header "
            f"(layer {header.layer}, tokens {header.token_offset}..."
            f"{header.token_offset + header.num_tokens})"
        )
    return body
