"""Quantizers for one stream (all K or all V of one layer in one chunk) and their byte sections.

Every float operation that decides a stored bit is spelled out in a fixed order (fp32, pairwise
folds for sums, IEEE division and square root, no fused multiply-add), so the Triton kernels in
turbowire.kernels can reproduce the packed bytes exactly. Section offsets come from
``stream_layout``; FORMAT.md documents them.

Kinds:
- ``raw``: the source dtype, unchanged.
- ``fp8``: e4m3 codes with a per-vector fp16 scale amax/448 (never an unscaled cast).
- ``lloyd``: optional per-chunk per-channel mean removal, randomized Hadamard rotation, nearest
  Lloyd-Max level of N(0, 1) per coordinate, a per-vector fp16 scale that restores the norm
  exactly (matched norm), and the first ``sink_tokens`` tokens of a sequence kept exactly (the
  attention sink: its key is an outlier that every later query attends to).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from turbowire.codec.codebooks import boundaries, centroids
from turbowire.codec.errors import GeometryError
from turbowire.codec.packing import pack_codes, packed_row_bytes, unpack_codes
from turbowire.codec.rotation import pairwise_sum, rotate, unrotate
from turbowire.codec.wire import align_up

StreamKind = Literal["raw", "fp8", "lloyd"]
FP8_MAX = 448.0
FP16_MAX = 65504.0


@dataclass(frozen=True)
class StreamSpec:
    """How one stream (K or V) of a layer is coded."""

    kind: StreamKind
    bits: int = 16
    center: bool = False
    sink_tokens: int = 0
    hi_eighths: int = 0  # lloyd: the first hi_eighths/8 of the rotated coordinates get bits + 1

    def __post_init__(self) -> None:
        if self.kind == "raw" and self.bits != 16:
            raise ValueError("raw streams keep the 16-bit source dtype: use bits=16")
        if self.kind == "fp8" and self.bits != 8:
            raise ValueError("fp8 streams use bits=8")
        if self.kind == "lloyd" and not 1 <= self.bits <= 6:
            raise ValueError(f"lloyd streams take 1..6 bits, got {self.bits}")
        if self.kind != "lloyd" and (self.center or self.sink_tokens):
            raise ValueError("center and sink_tokens apply to lloyd streams only")
        if self.sink_tokens < 0:
            raise ValueError("sink_tokens must be >= 0")
        if self.hi_eighths and (
            self.kind != "lloyd" or not 0 < self.hi_eighths < 8 or self.bits >= 6
        ):
            raise ValueError("hi_eighths (1..7) applies to lloyd streams of fewer than 6 bits")

    def coord_bits(self, dim: int) -> list[tuple[int, int]]:
        """(bits, count) groups of rotated coordinates, in order (lloyd streams)."""
        hi = dim * self.hi_eighths // 8
        groups = [(self.bits + 1, hi), (self.bits, dim - hi)]
        return [(b, n) for b, n in groups if n]

    def row_bytes(self, dim: int) -> int:
        """Packed code bytes per vector (lloyd streams)."""
        return sum(packed_row_bytes(n, b) for b, n in self.coord_bits(dim))

    @property
    def short(self) -> str:
        """Compact label: LM<bits> for Lloyd-Max, +mean for chunk centring, +sink."""
        if self.kind != "lloyd":
            return {"raw": "16-bit", "fp8": "fp8+scale"}[self.kind]
        bits = f"{self.bits + self.hi_eighths / 8:g}"
        return (
            f"LM{bits}" + ("+mean" if self.center else "") + ("+sink" if self.sink_tokens else "")
        )

    @property
    def label(self) -> str:
        if self.kind == "raw":
            return "bf16/fp16"
        if self.kind == "fp8":
            return "fp8 e4m3 + scale"
        bits = f"{self.bits + self.hi_eighths / 8:g}"
        extras = "".join(
            [
                ", chunk mean" if self.center else "",
                f", {self.sink_tokens} sink" if self.sink_tokens else "",
            ]
        )
        return f"{bits}-bit Lloyd-Max{extras}"


def rotated_dim(dim: int) -> int:
    """Coordinates a Lloyd-Max stream rotates a ``dim``-wide vector in: the next power of two
    (the Hadamard transform's size). A narrower vector (Phi-3's 96) is zero-padded first; the
    padding's codes cross the wire and are dropped after the inverse rotation."""
    return 1 << (dim - 1).bit_length()


@dataclass(frozen=True)
class StreamLayout:
    """Byte sections of one stream inside a chunk body (offsets relative to the stream start)."""

    sections: dict[str, tuple[int, int]]  # name -> (offset, nbytes)
    nbytes: int
    sink_rows: int


def stream_layout(
    spec: StreamSpec, tokens: int, heads: int, dim: int, sequence_start: bool
) -> StreamLayout:
    sections: dict[str, tuple[int, int]] = {}
    off = 0

    def add(name: str, size: int) -> None:
        nonlocal off
        sections[name] = (off, size)
        off = align_up(off + size)

    sink_rows = 0
    if spec.kind == "raw":
        add("data", tokens * heads * dim * 2)
    elif spec.kind == "fp8":
        add("scales", tokens * heads * 2)
        add("codes", tokens * heads * dim)
    else:
        if spec.center:
            add("mean", heads * dim * 2)
        sink_rows = min(spec.sink_tokens, tokens) if sequence_start else 0
        if sink_rows:
            add("sink", sink_rows * heads * dim * 2)
        add("codes", tokens * heads * spec.row_bytes(rotated_dim(dim)))
        add("scales", tokens * heads * 2)
    return StreamLayout(sections=sections, nbytes=off, sink_rows=sink_rows)


def token_pairwise_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over dim 0 (tokens) in the codec's fixed order: zero-pad to a power of two, fold
    pairs."""
    t = x.shape[0]
    padded = 1 << max(0, (t - 1).bit_length())
    if padded != t:
        x = torch.cat([x, x.new_zeros(padded - t, *x.shape[1:])], dim=0)
    return pairwise_sum(x.movedim(0, -1))


def chunk_mean(x: torch.Tensor) -> torch.Tensor:
    """Per-(head, channel) mean over the chunk's tokens, rounded to fp16. x: [T, H, D] fp32."""
    return (token_pairwise_sum(x) / float(x.shape[0])).to(torch.float16)


def ieee_sqrt(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded fp32 square root (the FORMAT.md contract).

    torch.sqrt on fp32 CPU tensors goes through MKL's vector math and is off by one ulp for ~17%
    of inputs, which changed stored scales and codes against other implementations. The fp64
    square root rounded to fp32 is the correctly rounded fp32 result (53 >= 2*24 + 2 bits).
    """
    return torch.sqrt(x.to(torch.float64)).to(torch.float32)


def lloyd_quantize(
    xc: torch.Tensor, groups: list[tuple[int, int]]
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Codes per coordinate group (int64 [..., n_g]) and fp16 scales ([...]) of centred fp32
    vectors xc [..., D]; ``groups`` lists (bits, count) of consecutive rotated coordinates."""
    dim = xc.shape[-1]
    u = rotate(xc)
    norm = ieee_sqrt(pairwise_sum(xc * xc))
    inv = torch.where(norm > 0, 1.0 / norm, torch.zeros_like(norm))
    v = u * inv.unsqueeze(-1)
    codes, recon = [], []
    start = 0
    for bits, count in groups:
        part = v[..., start : start + count].contiguous()
        # code = #{k : v > B_k}, counted directly (torch.searchsorted is slow on CPU)
        idx = (part.unsqueeze(-1) > boundaries(bits).to(xc.device)).sum(-1)
        codes.append(idx)
        recon.append(centroids(bits).to(xc.device)[idx])
        start += count
    c = torch.cat(recon, dim=-1)
    cnorm = ieee_sqrt(pairwise_sum(c * c))
    sqrt_d = torch.tensor(math.sqrt(dim), dtype=torch.float32, device=xc.device)
    scale = norm / (sqrt_d * cnorm)
    return codes, scale.clamp(max=FP16_MAX).to(torch.float16)


def lloyd_dequantize(
    codes: list[torch.Tensor], scales: torch.Tensor, groups: list[tuple[int, int]]
) -> torch.Tensor:
    """fp32 vectors from per-group codes and fp16 scales [...] (before adding any mean)."""
    c = torch.cat(
        [centroids(bits).to(scales.device)[idx] for (bits, _), idx in zip(groups, codes)], dim=-1
    )
    return unrotate(c) * scales.to(torch.float32).unsqueeze(-1)


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(-1)


def encode_stream(
    spec: StreamSpec, x: torch.Tensor, sequence_start: bool
) -> torch.Tensor:
    """Encode x [T, H, D] (bf16/fp16) into a uint8 tensor of ``stream_layout(...).nbytes`` bytes."""
    tokens, heads, dim = x.shape
    layout = stream_layout(spec, tokens, heads, dim, sequence_start)
    out = torch.zeros(layout.nbytes, dtype=torch.uint8, device=x.device)

    def put(name: str, data: torch.Tensor) -> None:
        off, size = layout.sections[name]
        flat = _bytes_of(data)
        if flat.numel() != size:
            raise AssertionError(f"section {name}: {flat.numel()} bytes, layout says {size}")
        out[off : off + size] = flat

    if spec.kind == "raw":
        put("data", x)
        return out
    xf = x.to(torch.float32)
    if spec.kind == "fp8":
        amax = xf.abs().amax(dim=-1)
        scale = (amax / FP8_MAX).clamp(max=FP16_MAX).to(torch.float16)
        s32 = scale.to(torch.float32)
        inv = torch.where(s32 > 0, 1.0 / s32, torch.zeros_like(s32))
        v = (xf * inv.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX)
        put("scales", scale)
        put("codes", v.to(torch.float8_e4m3fn))
        return out
    if spec.center:
        mean16 = chunk_mean(xf)
        put("mean", mean16)
        xf = xf - mean16.to(torch.float32)
    if layout.sink_rows:
        put("sink", x[: layout.sink_rows])
    padded = rotated_dim(dim)
    if padded != dim:
        xf = torch.nn.functional.pad(xf, (0, padded - dim))
    groups = spec.coord_bits(padded)
    codes, scales = lloyd_quantize(xf, groups)
    put("codes", torch.cat([pack_codes(c, b) for c, (b, _) in zip(codes, groups)], dim=-1))
    put("scales", scales)
    return out


def decode_stream(
    spec: StreamSpec,
    data: torch.Tensor,
    tokens: int,
    heads: int,
    dim: int,
    dtype: torch.dtype,
    sequence_start: bool,
) -> torch.Tensor:
    """Decode one stream's bytes back to [T, H, D] in ``dtype``."""
    layout = stream_layout(spec, tokens, heads, dim, sequence_start)
    if data.numel() < layout.nbytes:
        raise GeometryError(f"stream needs {layout.nbytes} bytes, got {data.numel()}")

    def get(name: str, as_dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        off, size = layout.sections[name]
        return data[off : off + size].view(as_dtype).reshape(shape)

    if spec.kind == "raw":
        return get("data", dtype, (tokens, heads, dim)).clone()
    if spec.kind == "fp8":
        scales = get("scales", torch.float16, (tokens, heads)).to(torch.float32)
        codes = get("codes", torch.float8_e4m3fn, (tokens, heads, dim)).to(torch.float32)
        return (codes * scales.unsqueeze(-1)).to(dtype)
    padded = rotated_dim(dim)
    groups = spec.coord_bits(padded)
    packed = get("codes", torch.uint8, (tokens, heads, spec.row_bytes(padded)))
    codes, start = [], 0
    for bits, count in groups:
        nb = packed_row_bytes(count, bits)
        codes.append(unpack_codes(packed[..., start : start + nb], bits, count))
        start += nb
    scales = get("scales", torch.float16, (tokens, heads))
    xf = lloyd_dequantize(codes, scales, groups)[..., :dim]
    if spec.center:
        xf = xf + get("mean", torch.float16, (heads, dim)).to(torch.float32)
    out = xf.to(dtype)
    if layout.sink_rows:
        out[: layout.sink_rows] = get("sink", dtype, (layout.sink_rows, heads, dim))
    return out
