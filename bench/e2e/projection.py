"""GPU-scale projection of the P/D KV handoff: a model, not a measurement.

For a model's KV size, a prompt length and a link rate, the handoff time of

- **dense** (vLLM NixlConnector): ``dense_bytes / (link * efficiency)``;
- **turbowire** as built (encode in ``save_kv_layer`` during prefill, READ of the compressed chunks,
  then decode into the paged cache):
  ``wire_bytes / (link * efficiency) + dense_bytes / decode_rate`` on the critical path, plus
  ``dense_bytes / encode_rate`` added to the prefill (reported apart);
- **turbowire, serial** (nothing overlapped): encode + wire + decode, the worst case.

``efficiency`` is the fraction of the nominal link rate a bulk transfer achieves (the CPU benchmark
measures it for TCP over veth); ``encode_rate``/``decode_rate`` are the H200 kernels' throughputs in
dense KV bytes per second from the kernels benchmark (bench/RESULTS.md). Fixed per-transfer
latencies (handshake, notification, scheduling) are left out: they are the same for both paths and
small against GB-sized transfers.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelKV:
    """KV geometry of a model (all layers transferred, bf16 unless dtype_bytes says otherwise)."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int = 2

    def __post_init__(self) -> None:
        if min(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype_bytes) < 1:
            raise ValueError(
                f"{self.name}: layers, kv heads, head_dim and dtype_bytes must be >= 1")

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes


LLAMA_31_8B = ModelKV("Llama-3.1-8B", 32, 8, 128)
LLAMA_31_70B = ModelKV("Llama-3.1-70B", 80, 8, 128)


@dataclass(frozen=True)
class PresetRates:
    """A codec preset's wire ratio and kernel throughputs (dense bytes per second)."""

    preset: str
    wire_ratio: float  # dense bytes / wire bytes (headers included)
    encode_dense_bps: float
    decode_dense_bps: float
    source: str  # where the rates come from (measurement or stated assumption)

    def __post_init__(self) -> None:
        if self.wire_ratio < 1.0:
            raise ValueError(
                f"{self.preset}: wire_ratio must be >= 1 (dense/wire), got {self.wire_ratio}")
        if self.encode_dense_bps <= 0 or self.decode_dense_bps <= 0:
            raise ValueError(f"{self.preset}: kernel rates must be > 0 bytes/s")


@dataclass(frozen=True)
class ProjectionRow:
    model: str
    prompt_tokens: int
    link_gbit: float
    preset: str
    dense_bytes: int
    wire_bytes: int
    dense_s: float
    turbowire_s: float  # critical path as built: wire + decode
    serial_s: float  # encode + wire + decode
    prefill_added_s: float  # encode time added to the prefill

    @property
    def speedup(self) -> float:
        return self.dense_s / self.turbowire_s

    @property
    def speedup_serial(self) -> float:
        return self.dense_s / self.serial_s


def project_one(model: ModelKV, tokens: int, link_gbit: float, rates: PresetRates,
                efficiency: float = 1.0) -> ProjectionRow:
    """Project one (model, prompt, link, preset) case."""
    if tokens < 1 or link_gbit <= 0 or not 0 < efficiency <= 1:
        raise ValueError("tokens must be >= 1, link_gbit > 0 and efficiency in (0, 1]")
    dense = tokens * model.bytes_per_token
    wire = math.ceil(dense / rates.wire_ratio)
    link_bps = link_gbit * 1e9 / 8 * efficiency
    enc = dense / rates.encode_dense_bps
    dec = dense / rates.decode_dense_bps
    return ProjectionRow(
        model=model.name, prompt_tokens=tokens, link_gbit=link_gbit, preset=rates.preset,
        dense_bytes=dense, wire_bytes=wire, dense_s=dense / link_bps,
        turbowire_s=wire / link_bps + dec, serial_s=enc + wire / link_bps + dec,
        prefill_added_s=enc)


def project(models: Sequence[ModelKV], prompts: Sequence[int], links: Sequence[float],
            presets: Sequence[PresetRates], efficiency: float = 1.0) -> list[ProjectionRow]:
    return [project_one(m, n, link, p, efficiency)
            for m in models for n in prompts for link in links for p in presets]


@functools.lru_cache(maxsize=64)
def wire_ratio_from_codec(preset: str, head_dim: int = 128, num_kv_heads: int = 8,
                          num_layers: int = 32) -> float:
    """Exact dense/wire ratio of a preset from the codec's own sizes (headers included)."""
    from turbowire.codec import Codec

    codec = Codec(preset, head_dim, num_layers)
    tokens = int(getattr(codec, "chunk_tokens", 256))
    dense = 2 * tokens * num_kv_heads * head_dim * 2 * num_layers
    wire = sum(codec.encoded_nbytes(layer, tokens, num_kv_heads) for layer in range(num_layers))
    return dense / wire


def _fmt_time(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def markdown(rows: Sequence[ProjectionRow]) -> str:
    head = ("| model | prompt | link Gbit/s | preset | dense GB | wire GB | dense handoff | "
            "turbowire handoff | x faster | serial (enc+wire+dec) | + prefill (encode) |")
    out = [head, "|" + "|".join(["---"] * 11) + "|"]
    for r in rows:
        out.append(
            f"| {r.model} | {r.prompt_tokens // 1024}k | {r.link_gbit:g} | {r.preset} | "
            f"{r.dense_bytes / 1e9:.2f} | {r.wire_bytes / 1e9:.2f} | {_fmt_time(r.dense_s)} | "
            f"{_fmt_time(r.turbowire_s)} | {r.speedup:.2f} | {_fmt_time(r.serial_s)} | "
            f"{_fmt_time(r.prefill_added_s)} |")
    return "\n".join(out)


#: Kernel throughputs measured on the H200 (bytes read + written per second) when no kernels
#: benchmark result is given: the naive fused Triton encode/decode of ENVIRONMENT.md's GPU section.
NAIVE_H200_RW_BPS = {"encode": 0.93e12, "decode": 1.43e12}
NAIVE_SOURCE = ("ENVIRONMENT.md: naive fused Triton kernels on H200, 0.93 TB/s encode and "
                "1.43 TB/s decode counted as bytes read + written")


def rates_from_rw(preset: str, encode_rw_bps: float, decode_rw_bps: float, source: str,
                  wire_ratio: float | None = None) -> PresetRates:
    """Convert (dense + compressed bytes)/s kernel throughputs to dense-bytes/s rates."""
    ratio = wire_ratio if wire_ratio is not None else wire_ratio_from_codec(preset)
    dense_share = ratio / (ratio + 1.0)  # dense bytes per (dense + wire) byte touched
    return PresetRates(preset, ratio, encode_rw_bps * dense_share, decode_rw_bps * dense_share,
                       source)
