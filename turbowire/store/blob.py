"""A stored chunk's bytes: a small header, then one codec chunk per layer.

The layer chunks are the NIXL path's wire format (``codec/FORMAT.md``: magic, version, preset,
geometry, tag, checksums), tagged with the chunk's prefix hash. The header in front says which
prefix, tokens, rank and layer sizes the blob holds, with its own checksum, so a reader refuses a
blob of another prefix, another geometry or a truncated one before decoding anything.

Header (little-endian), padded to a multiple of 16 bytes:
``magic "TWSB" | version u8 | reserved u8 | num_layers u16 | rank u16 | tp_size u16 |
token_start u32 | num_tokens u32 | chunk_hash 16 B | layer sizes u32 x num_layers | crc32 u32``
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

from turbowire.errors import TurboWireError
from turbowire.store.keys import CHUNK_HASH_BYTES

MAGIC = b"TWSB"
VERSION = 1
_FIXED = struct.Struct("<4sBBHHHII16s")
ALIGN = 16


class BlobError(TurboWireError, ValueError):
    """A stored blob that is truncated, corrupt, or not the chunk that was asked for."""

    reason = "checksum"


class BlobMismatch(BlobError):
    """An intact blob of another chunk, rank or geometry than the one asked for."""

    reason = "format"


def header_nbytes(num_layers: int) -> int:
    raw = _FIXED.size + 4 * num_layers + 4
    return -(-raw // ALIGN) * ALIGN


@dataclass(frozen=True)
class BlobHeader:
    num_layers: int
    rank: int
    tp_size: int
    token_start: int
    num_tokens: int
    chunk_hash: bytes
    layer_nbytes: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return header_nbytes(self.num_layers)

    @property
    def total_nbytes(self) -> int:
        return self.nbytes + sum(self.layer_nbytes)

    def layer_offsets(self) -> list[int]:
        """Offset of each layer's codec chunk from the start of the blob."""
        out, off = [], self.nbytes
        for n in self.layer_nbytes:
            out.append(off)
            off += n
        return out

    def pack(self) -> bytes:
        if len(self.chunk_hash) != CHUNK_HASH_BYTES or len(self.layer_nbytes) != self.num_layers:
            raise BlobError("blob header fields are inconsistent")
        body = _FIXED.pack(
            MAGIC, VERSION, 0, self.num_layers, self.rank, self.tp_size, self.token_start,
            self.num_tokens, self.chunk_hash,
        ) + struct.pack(f"<{self.num_layers}I", *self.layer_nbytes)
        body += struct.pack("<I", zlib.crc32(body))
        return body + bytes(self.nbytes - len(body))


def parse_header(blob: bytes | bytearray | memoryview) -> BlobHeader:
    """The header of ``blob``; BlobError when it is not a whole, intact turbowire blob."""
    view = memoryview(blob)
    if len(view) < _FIXED.size + 8:
        raise BlobError(f"blob of {len(view)} bytes is shorter than a header")
    magic, version, _, layers, rank, tp, start, tokens, chash = _FIXED.unpack_from(view, 0)
    if magic != MAGIC:
        raise BlobError("not a turbowire store blob (bad magic)")
    if version != VERSION:
        raise BlobError(f"store blob version {version} is not understood (this is {VERSION})")
    if layers == 0 or len(view) < header_nbytes(layers):
        raise BlobError("blob is truncated inside its header")
    sizes_end = _FIXED.size + 4 * layers
    (crc,) = struct.unpack_from("<I", view, sizes_end)
    if zlib.crc32(view[:sizes_end]) != crc:
        raise BlobError("blob header checksum mismatch")
    sizes = struct.unpack_from(f"<{layers}I", view, _FIXED.size)
    header = BlobHeader(layers, rank, tp, start, tokens, bytes(chash), tuple(sizes))
    if header.total_nbytes != len(view):
        raise BlobError(
            f"blob is {len(view)} bytes, its header describes {header.total_nbytes}"
        )
    return header


def check_expected(header: BlobHeader, *, chunk_hash: bytes, token_start: int, num_tokens: int,
                   rank: int, tp_size: int, layer_nbytes: Sequence[int]) -> None:
    """Refuse a valid blob of another chunk, rank or geometry than the one asked for."""
    problems = []
    if header.chunk_hash != chunk_hash:
        problems.append("prefix hash")
    if header.token_start != token_start or header.num_tokens != num_tokens:
        problems.append(f"tokens {header.token_start}+{header.num_tokens}")
    if header.rank != rank or header.tp_size != tp_size:
        problems.append(f"rank {header.rank}/{header.tp_size}")
    if tuple(layer_nbytes) != header.layer_nbytes:
        problems.append("layer sizes (another model, preset or geometry)")
    if problems:
        raise BlobMismatch("stored blob is not the chunk asked for: " + ", ".join(problems))
