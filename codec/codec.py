"""The Codec: a preset bound to a model's geometry, encoding one layer's KV chunk at a time."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from turbowire.codec.errors import GeometryError, IncompatiblePayloadError
from turbowire.codec.presets import LayerPolicy, Preset, get_preset
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

logger = logging.getLogger(__name__)

MAX_HEAD_DIM = 1024  # head sizes coded: every multiple of 8 up to this
DEFAULT_CHUNK_TOKENS = 256
MAX_CHUNK_TOKENS = 1 << 16


@dataclass(frozen=True)
class ChunkLayout:
    """Where K and V live inside a chunk (offsets from the chunk start, header included)."""

    header: ChunkHeader
    k: StreamLayout
    v: StreamLayout
    k_offset: int
    v_offset: int

    @property
    def nbytes(self) -> int:
        return self.header.nbytes


@dataclass(frozen=True)
class EncodedChunk:
    """One encoded chunk: ``data`` holds every byte that crosses the wire."""

    header: ChunkHeader
    data: torch.Tensor  # uint8, header + body

    @property
    def nbytes(self) -> int:
        return int(self.data.numel())

    def to_bytes(self) -> bytes:
        return self.data.cpu().numpy().tobytes()


def check_head_dim(head_dim: int) -> None:
    """Refuse a head size no preset codes. Every multiple of 8 up to ``MAX_HEAD_DIM`` is coded
    (every head size vLLM's attention backends take): raw and fp8 streams copy or scale rows of
    any width, a Lloyd-Max stream rotates a vector zero-padded to a power of two
    (``streams.rotated_dim``)."""
    if not (0 < head_dim <= MAX_HEAD_DIM and head_dim % 8 == 0):
        raise GeometryError(
            f"head_dim {head_dim} is not supported: turbowire codes head sizes that are a "
            f"multiple of 8 up to {MAX_HEAD_DIM}"
        )


class Codec:
    """A preset for a model with ``num_layers`` layers and ``head_dim``-wide heads.

    ``encode(layer, k, v)`` takes [T, H, D] bf16/fp16 tensors (post-RoPE K as the cache holds it)
    and returns an ``EncodedChunk``; ``decode(layer, chunk)`` gives back (k, v). Tokens are
    coded in chunks of at most ``chunk_tokens`` (per-chunk statistics keep chunks independent).
    """

    def __init__(
        self,
        preset: str | Preset,
        head_dim: int,
        num_layers: int,
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    ) -> None:
        self.preset: Preset = preset if isinstance(preset, Preset) else get_preset(preset)
        check_head_dim(head_dim)
        if not 0 < num_layers < 1 << 16:
            raise GeometryError(f"num_layers must be in 1..65535, got {num_layers}")
        if not 0 < chunk_tokens <= MAX_CHUNK_TOKENS:
            raise GeometryError(
                f"chunk_tokens must be in 1..{MAX_CHUNK_TOKENS}, got {chunk_tokens}"
            )
        self.head_dim = head_dim
        self.num_layers = num_layers
        self.chunk_tokens = chunk_tokens

    def __repr__(self) -> str:
        return (
            f"Codec({self.preset.name!r}, head_dim={self.head_dim}, num_layers={self.num_layers}, "
            f"chunk_tokens={self.chunk_tokens})"
        )

    # ---- geometry -----------------------------------------------------------------------
    def policy(self, layer: int) -> LayerPolicy:
        return self.preset.policy(layer, self.num_layers)

    def layout(
        self,
        layer: int,
        num_tokens: int,
        num_heads: int,
        token_offset: int = 0,
        dtype: torch.dtype = torch.bfloat16,
        tag: int = 0,
        body_checksum: int = 0,
    ) -> ChunkLayout:
        """Section offsets of a chunk (the kernels write into exactly these places)."""
        if not 0 < num_tokens <= MAX_CHUNK_TOKENS:
            raise GeometryError(f"a chunk holds 1..{MAX_CHUNK_TOKENS} tokens, got {num_tokens}")
        if not 0 < num_heads < 1 << 16:
            raise GeometryError(f"num_heads must be in 1..65535, got {num_heads}")
        if dtype not in DTYPE_CODES:
            raise GeometryError(f"KV dtype {dtype} is not supported (bfloat16 or float16)")
        pol = self.policy(layer)
        start = token_offset == 0
        k = stream_layout(pol.k, num_tokens, num_heads, self.head_dim, start)
        v = stream_layout(pol.v, num_tokens, num_heads, self.head_dim, start)
        header = ChunkHeader(
            preset_id=self.preset.preset_id, layer=layer, num_layers=self.num_layers,
            num_heads=num_heads, head_dim=self.head_dim, dtype=dtype, num_tokens=num_tokens,
            token_offset=token_offset, body_nbytes=k.nbytes + v.nbytes, tag=tag,
            body_checksum=body_checksum,
        )
        return ChunkLayout(header, k, v, HEADER_BYTES, HEADER_BYTES + k.nbytes)

    def encoded_nbytes(
        self, layer: int, num_tokens: int, num_heads: int, token_offset: int = 0
    ) -> int:
        """Exact size of the chunk ``encode`` would produce (token_offset 0 is the largest)."""
        return self.layout(layer, num_tokens, num_heads, token_offset).nbytes

    def bits_per_element(
        self, layer: int, num_heads: int = 8, num_tokens: int | None = None
    ) -> float:
        """Wire bits per K/V element of a full chunk, all metadata (header, scales, means) counted.

        The sink row of a sequence's first chunk is left out (it is paid once per sequence).
        """
        tokens = num_tokens or self.chunk_tokens
        nbytes = self.encoded_nbytes(layer, tokens, num_heads, token_offset=tokens)
        return nbytes * 8 / (2 * tokens * num_heads * self.head_dim)

    # ---- encode / decode ----------------------------------------------------------------
    def _check_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if not 0 <= layer < self.num_layers:
            raise GeometryError(f"layer {layer} out of range 0..{self.num_layers - 1}")
        if k.shape != v.shape or k.dim() != 3:
            raise GeometryError(
                f"k and v must both be [T, H, D], got {tuple(k.shape)} and {tuple(v.shape)}"
            )
        if k.shape[-1] != self.head_dim:
            raise GeometryError(
                f"head_dim of the tensors is {k.shape[-1]}, codec has {self.head_dim}"
            )
        if k.dtype != v.dtype or k.dtype not in DTYPE_CODES:
            raise GeometryError(f"k/v dtype must be bfloat16 or float16, got {k.dtype}/{v.dtype}")

    def encode(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, *, tag: int = 0, token_offset: int = 0
    ) -> EncodedChunk:
        """Encode one layer's K and V for T tokens starting at ``token_offset`` of the sequence."""
        self._check_kv(layer, k, v)
        tokens, heads, _ = k.shape
        if not 0 <= tag < 1 << 64:
            raise GeometryError("tag must fit in 64 unsigned bits")
        layout = self.layout(layer, tokens, heads, token_offset, k.dtype, tag)
        pol = self.policy(layer)
        start = token_offset == 0
        body = torch.cat([encode_stream(pol.k, k, start), encode_stream(pol.v, v, start)])
        checksum = wsum32(body)
        header = ChunkHeader(**{**layout.header.__dict__, "body_checksum": checksum})
        head = torch.frombuffer(bytearray(header.pack()), dtype=torch.uint8).to(body.device)
        return EncodedChunk(header, torch.cat([head, body]))

    def decode(
        self,
        layer: int,
        encoded: EncodedChunk | bytes | bytearray | memoryview | torch.Tensor,
        *,
        expected_tag: int | None = None,
        expected_tokens: int | None = None,
        expected_offset: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Verify and decode a chunk of this layer; returns (k, v) as [T, H, D] tensors."""
        data = encoded.data if isinstance(encoded, EncodedChunk) else as_uint8(encoded)
        header = parse_header(data)
        self.check_compatible(header, layer, expected_tag, expected_tokens, expected_offset)
        body = verify_body(header, data)
        pol = self.policy(layer)
        start = header.sequence_start
        k_layout = stream_layout(pol.k, header.num_tokens, header.num_heads, self.head_dim, start)
        v_layout = stream_layout(pol.v, header.num_tokens, header.num_heads, self.head_dim, start)
        if k_layout.nbytes + v_layout.nbytes != header.body_nbytes:
            raise IncompatiblePayloadError(
                f"body is {header.body_nbytes} bytes; preset {self.preset.name} at this geometry "
                f"needs {k_layout.nbytes + v_layout.nbytes}"
            )
        args = (header.num_tokens, header.num_heads, self.head_dim, header.dtype, start)
        k = decode_stream(pol.k, body[: k_layout.nbytes], *args)
        v = decode_stream(pol.v, body[k_layout.nbytes :], *args)
        return k, v

    def check_compatible(
        self,
        header: ChunkHeader,
        layer: int,
        expected_tag: int | None = None,
        expected_tokens: int | None = None,
        expected_offset: int | None = None,
    ) -> None:
        """Refuse a well-formed chunk that is not the one this decoder expects."""
        problems = []
        if header.is_latent:
            problems.append("an MLA latent chunk (turbowire.codec.latent decodes it)")
        if header.preset_id != self.preset.preset_id:
            try:
                other = get_preset(header.preset_id).name
            except Exception:  # an id from a newer build
                other = f"id {header.preset_id}"
            problems.append(f"preset {other} (decoder uses {self.preset.name})")
        if header.layer != layer:
            problems.append(f"layer {header.layer} (expected {layer})")
        if header.num_layers != self.num_layers:
            problems.append(f"{header.num_layers} model layers (decoder has {self.num_layers})")
        if header.head_dim != self.head_dim:
            problems.append(f"head_dim {header.head_dim} (decoder has {self.head_dim})")
        if expected_tag is not None and header.tag != expected_tag:
            problems.append(f"tag {header.tag:#x} (expected {expected_tag:#x})")
        if expected_tokens is not None and header.num_tokens != expected_tokens:
            problems.append(f"{header.num_tokens} tokens (expected {expected_tokens})")
        if expected_offset is not None and header.token_offset != expected_offset:
            problems.append(f"token offset {header.token_offset} (expected {expected_offset})")
        if problems:
            raise IncompatiblePayloadError("chunk refused: " + "; ".join(problems))
