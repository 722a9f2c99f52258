"""fp8 (e4m3) paged KV caches: how their values enter and leave the codec.

vLLM's ``--kv-cache-dtype fp8`` stores K and V as float8 e4m3 (``torch.float8_e4m3fn``, or
``torch.uint8`` holding the same bits) with one scale per layer for K and one for V: the model
sees ``fp32(q) * scale``. turbowire codes what the model sees, as bfloat16 chunks (the wire
format's source dtypes are bf16/fp16), and writes decoded values back with the formula of vLLM's
cache writer (``x / scale``, rounded to e4m3 with saturation; here the division is IEEE-rounded):

- encode: ``x = bf16(fp32(e4m3(q)) * scale)``, rounded to nearest even;
- decode: ``q = e4m3(clamp(fp32(x_src) / scale, -448, 448))``, where ``x_src`` is the decoded
  value in the chunk's source dtype (as for bf16/fp16 caches).

Every implementation (this reference, the Triton kernels) does exactly these fp32 operations, so
they agree bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from turbowire.kernels.paged import CacheLayoutError

FP8_CACHE_DTYPES = (torch.float8_e4m3fn, torch.uint8)
E4M3_MAX = 448.0


def is_fp8_cache(kv_cache: torch.Tensor) -> bool:
    return kv_cache.dtype in FP8_CACHE_DTYPES


@dataclass(frozen=True)
class KVScales:
    """One layer's K and V scales of an fp8 cache (vLLM's ``_k_scale_float``/``_v_scale_float``)."""

    k: float
    v: float

    def __post_init__(self) -> None:
        for name, s in (("k", self.k), ("v", self.v)):
            if not (isinstance(s, (int, float)) and math.isfinite(s) and s > 0):
                raise CacheLayoutError(
                    f"fp8 cache {name} scale must be a finite number > 0, got {s!r} (pass the "
                    "layer's k/v scale as vLLM computed it; 1.0 when unscaled)"
                )

    def as_fp32(self) -> tuple[float, float]:
        """The scales rounded to fp32, the precision every implementation computes in."""
        t = torch.tensor([self.k, self.v], dtype=torch.float32)
        return float(t[0]), float(t[1])


def resolve_scales(kv_cache: torch.Tensor, kv_scales: KVScales | tuple[float, float] | None
                   ) -> KVScales | None:
    """The scales a call needs: required for fp8 caches, refused for others."""
    if is_fp8_cache(kv_cache):
        if kv_scales is None:
            raise CacheLayoutError(
                f"a {kv_cache.dtype} cache is read as fp8 e4m3 and needs the layer's K/V scales "
                "(kv_scales=(k_scale, v_scale))"
            )
        return kv_scales if isinstance(kv_scales, KVScales) else KVScales(*kv_scales)
    if kv_scales is not None:
        raise CacheLayoutError(
            f"kv_scales only apply to fp8 caches; this cache is {kv_cache.dtype}"
        )
    return None


def as_e4m3(kv_cache: torch.Tensor) -> torch.Tensor:
    """The cache (or a part of it) as float8_e4m3fn, viewing uint8 storage in place."""
    return kv_cache if kv_cache.dtype == torch.float8_e4m3fn else kv_cache.view(torch.float8_e4m3fn)


def dequantize(q: torch.Tensor, scale: float) -> torch.Tensor:
    """e4m3 values (float8 or uint8 bits) -> bf16(fp32(q) * scale)."""
    s = torch.tensor(scale, dtype=torch.float32, device=q.device)
    return (as_e4m3(q).to(torch.float32) * s).to(torch.bfloat16)


def quantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Decoded values (bf16/fp16) -> e4m3(clamp(fp32(x) / scale)) as float8_e4m3fn."""
    s = torch.tensor(scale, dtype=torch.float32, device=x.device)
    y = (x.to(torch.float32) / s).clamp(-E4M3_MAX, E4M3_MAX)
    return y.to(torch.float8_e4m3fn)
