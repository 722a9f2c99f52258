"""KV methods compared by the quality table: turbowire presets and reproduced baselines.

A method maps one layer's prompt KV ([T, H, D] bf16) to its reconstruction and the number of
bytes it would put on the wire. Baselines are simulations with exact byte accounting, labelled as
reproductions of their published formats (research/turboquant.md §1.2-1.7).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from turbowire.codec import Codec, Preset
from turbowire.codec.codebooks import boundaries, centroids


class KVMethod(Protocol):
    name: str
    family: str  # "turbowire", "baseline" or "reproduction"

    def apply(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        ...


@dataclass
class CodecMethod:
    """A turbowire preset, run through the real codec chunk by chunk (bytes are the real bytes)."""

    preset: "str | Preset"
    head_dim: int
    num_layers: int
    chunk_tokens: int = 256
    family: str = "turbowire"
    name: str = field(init=False)

    def __post_init__(self) -> None:
        self.name = self.preset if isinstance(self.preset, str) else self.preset.name
        self.codec = Codec(self.preset, self.head_dim, self.num_layers, self.chunk_tokens)

    def apply(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Encode/decode [T, H, D] through the kernels' dispatch: the C codec when it is built
        (same bytes as the reference, tests/unit/test_kernels_cpu.py), else the reference."""
        from turbowire.kernels import (
            DecodeItem,
            EncodeItem,
            PagedKVLayout,
            decode_into,
            encode_into,
        )

        num_tokens, heads, dim = k.shape
        chunk = self.chunk_tokens
        num_chunks = -(-num_tokens // chunk)
        # one paged block per chunk, in vLLM's CPU cache layout [blocks, H, block, 2*D]
        cache = torch.zeros(num_chunks, heads, chunk, 2 * dim, dtype=k.dtype)
        flat = cache.permute(0, 2, 1, 3).reshape(num_chunks * chunk, heads, 2 * dim)
        flat[:num_tokens, :, :dim] = k
        flat[:num_tokens, :, dim:] = v
        cache = flat.reshape(num_chunks, chunk, heads, 2 * dim).permute(0, 2, 1, 3).contiguous()
        layout = PagedKVLayout.from_cache(cache, head_dim=dim)
        blocks = list(range(num_chunks))
        enc_items, dec_items, offset = [], [], 0
        for i in range(num_chunks):
            t0 = i * chunk
            n = min(chunk, num_tokens - t0)
            size = self.codec.encoded_nbytes(layer, n, heads, token_offset=t0)
            enc_items.append(EncodeItem(blocks, t0, n, offset))
            dec_items.append(DecodeItem(blocks, t0, n, offset, size))
            offset += size
        staging = torch.empty(offset, dtype=torch.uint8)
        written = encode_into(self.codec, layer, cache, layout, enc_items, staging)
        out = torch.zeros_like(cache)
        decode_into(self.codec, layer, out, layout, dec_items, staging)
        flat = out.permute(0, 2, 1, 3).reshape(num_chunks * chunk, heads, 2 * dim)[:num_tokens]
        return flat[..., :dim].clone(), flat[..., dim:].clone(), int(sum(written))


@dataclass
class ProtectedMethod:
    """A preset with the prompt's first ``sink`` and last ``recent`` tokens kept exact: what
    protected tokens would buy, measured before they are a wire format. Bytes: the preset's real
    bytes, less its average per-token share for the protected tokens, plus those tokens in bf16
    (both streams)."""

    inner: CodecMethod
    sink: int
    recent: int
    family: str = "simulation"
    name: str = field(init=False)

    def __post_init__(self) -> None:
        if self.sink < 0 or self.recent < 0:
            raise ValueError("protected token counts must be >= 0")
        self.name = f"{self.inner.name} +s{self.sink}r{self.recent} (sim)"

    def protected(self, num_tokens: int) -> torch.Tensor:
        """Indices of the exact tokens in a prompt of ``num_tokens``."""
        keep = torch.zeros(num_tokens, dtype=torch.bool)
        keep[:self.sink] = True
        if self.recent:
            keep[max(num_tokens - self.recent, 0):] = True
        return keep.nonzero().flatten()

    def apply(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        kq, vq, nbytes = self.inner.apply(layer, k, v)
        idx = self.protected(k.shape[0])
        kq[idx], vq[idx] = k[idx], v[idx]
        n = idx.numel()
        exact = n * (k[0].numel() + v[0].numel()) * k.element_size()
        return kq, vq, round(nbytes - nbytes * n / k.shape[0]) + exact


@dataclass
class RecomputedTailMethod:
    """A preset whose decode engine recomputes the prompt's last ``recent`` tokens instead of
    loading them (the connector's ``recompute_recent_tokens``): the wire carries the rest, and
    the recent window's KV is the model's own, computed over the decoded prefix (the harness
    runs that forward pass). Bytes: the prefix's real bytes; the cost is ``recent`` tokens of
    prefill on the decode engine, not bytes."""

    inner: CodecMethod
    recent: int
    family: str = "turbowire"
    name: str = field(init=False)

    def __post_init__(self) -> None:
        if self.recent <= 0:
            raise ValueError("a recomputed tail has at least one token")
        self.name = f"{self.inner.name} +recompute {self.recent}"

    def apply(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The prefix's KV (the tokens before the recomputed tail) through the preset."""
        return self.inner.apply(layer, k, v)


def parse_tokens(text: str, option: str) -> list[int]:
    """``"64,128"`` -> [64, 128]: positive token counts of ``option``."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        if not part.isdigit() or int(part) <= 0:
            raise ValueError(f"{option} takes positive token counts, got {part!r}")
        out.append(int(part))
    return out


def parse_protect(text: str) -> list[tuple[int, int]]:
    """``"4:64,0:128"`` -> [(4, 64), (0, 128)]: (sink, recent) pairs of ``--protect``."""
    pairs = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        sink, sep, recent = part.partition(":")
        if not sep or not sink.isdigit() or not recent.isdigit():
            raise ValueError(f"--protect takes SINK:RECENT pairs of token counts, got {part!r}")
        pairs.append((int(sink), int(recent)))
    return pairs


# ---- simulated formats ----------------------------------------------------------------------
def _fp16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16).to(torch.float32)


def fp8_per_vector(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    amax = x.abs().amax(-1, keepdim=True)
    s = _fp16(amax / 448.0)
    q = (x / torch.where(s > 0, s, torch.ones_like(s))).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q.to(torch.float32) * s, x.numel() + x[..., 0].numel() * 2


def fp8_unscaled(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    return x.clamp(-448, 448).to(torch.float8_e4m3fn).to(torch.float32), x.numel()


def uniform_per_vector(
    x: torch.Tensor, bits: int, group: int | None = None
) -> tuple[torch.Tensor, int]:
    """Asymmetric min/max uniform quantizer over the last dim (or groups of it); fp16 scale+zero."""
    shape = x.shape
    g = group or shape[-1]
    xg = x.reshape(*shape[:-1], shape[-1] // g, g)
    mn = xg.amin(-1, keepdim=True)
    mx = xg.amax(-1, keepdim=True)
    levels = 2**bits - 1
    scale = _fp16((mx - mn) / levels)
    zero = _fp16(mn)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = ((xg - zero) / safe).round().clamp(0, levels)
    out = (q * scale + zero).reshape(shape)
    nbytes = math.ceil(x.numel() * bits / 8) + xg[..., 0].numel() * 4
    return out, nbytes


def uniform_per_channel(x: torch.Tensor, bits: int, group_tokens: int) -> tuple[torch.Tensor, int]:
    """KIVI keys: per channel over groups of ``group_tokens`` tokens (x: [T, H, D])."""
    outs, nbytes = [], 0
    for t0 in range(0, x.shape[0], group_tokens):
        blk = x[t0 : t0 + group_tokens]
        q, nb = uniform_per_vector(blk.permute(1, 2, 0), bits)  # [H, D, t]
        outs.append(q.permute(2, 0, 1))
        nbytes += nb
    return torch.cat(outs), nbytes


def _hadamard(n: int, device: torch.device) -> torch.Tensor:
    h = torch.ones(1, 1, device=device)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


def vllm_lloyd_key(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, int]:
    """vLLM TurboQuant MSE key: plain Hadamard (no signs), Lloyd-Max of N(0, 1/D), fp16 norm,
    norm correction at decode (reconstruction renormalised to the stored norm)."""
    d = x.shape[-1]
    h = _hadamard(d, x.device)
    norm = x.norm(dim=-1, keepdim=True)
    y = (x / torch.where(norm > 0, norm, torch.ones_like(norm))) @ h.T * math.sqrt(d)
    idx = torch.searchsorted(boundaries(bits).to(x.device), y.contiguous())
    c = centroids(bits).to(x.device)[idx]
    c = c / c.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    out = (c @ h) * _fp16(norm)
    return out, math.ceil(x.numel() * bits / 8) + x[..., 0].numel() * 2


@dataclass
class SimulatedMethod:
    """A baseline built from per-stream simulation functions, with optional bf16 boundary layers."""

    name: str
    family: str
    key_fn: Callable[[torch.Tensor], tuple[torch.Tensor, int]]
    value_fn: Callable[[torch.Tensor], tuple[torch.Tensor, int]]
    num_layers: int
    boundary_layers: int = 0

    def apply(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        if layer < self.boundary_layers or layer >= self.num_layers - self.boundary_layers:
            return k, v, (k.numel() + v.numel()) * 2
        kq, kb = self.key_fn(k.to(torch.float32))
        vq, vb = self.value_fn(v.to(torch.float32))
        return kq.to(k.dtype), vq.to(v.dtype), kb + vb


VLLM_PRESETS: dict[str, tuple[Callable, Callable]] = {
    "turboquant_k8v4": (fp8_unscaled, lambda v: uniform_per_vector(v, 4)),
    "turboquant_4bit_nc": (lambda k: vllm_lloyd_key(k, 4), lambda v: uniform_per_vector(v, 4)),
    "turboquant_k3v4_nc": (lambda k: vllm_lloyd_key(k, 3), lambda v: uniform_per_vector(v, 4)),
    "turboquant_3bit_nc": (lambda k: vllm_lloyd_key(k, 3), lambda v: uniform_per_vector(v, 3)),
}


def baseline_methods(num_layers: int) -> list[SimulatedMethod]:
    """fp8, KIVI-4/2, and the four vLLM TurboQuant presets (all layers, and first/last 2 in
    bf16)."""
    methods = [
        SimulatedMethod("fp8 e4m3 (per-vector scale)", "baseline", fp8_per_vector, fp8_per_vector,
                        num_layers),
        SimulatedMethod("KIVI-4", "baseline", lambda k: uniform_per_channel(k, 4, 32),
                        lambda v: uniform_per_vector(v, 4, group=32), num_layers),
        SimulatedMethod("KIVI-2", "baseline", lambda k: uniform_per_channel(k, 2, 32),
                        lambda v: uniform_per_vector(v, 2, group=32), num_layers),
    ]
    for name, (kf, vf) in VLLM_PRESETS.items():
        methods.append(SimulatedMethod(f"vLLM {name} (repro)", "reproduction", kf, vf, num_layers))
        methods.append(SimulatedMethod(f"vLLM {name} +bf16 boundary 2+2 (repro)", "reproduction",
                                       kf, vf, num_layers, boundary_layers=2))
    return methods


#: the anchors the retrieval task compares with (the issue's: fp8, KIVI-4, vLLM 4bit_nc/3bit_nc)
ANCHORS = (
    "fp8 e4m3 (per-vector scale)",
    "KIVI-4",
    "vLLM turboquant_4bit_nc (repro)",
    "vLLM turboquant_3bit_nc (repro)",
)


def anchor_methods(num_layers: int) -> list[SimulatedMethod]:
    """The subset of :func:`baseline_methods` that long-context runs compare with (each baseline
    costs as much as a preset per case)."""
    return [m for m in baseline_methods(num_layers) if m.name in ANCHORS]
