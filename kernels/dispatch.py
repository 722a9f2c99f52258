"""One entry point per direction that picks the implementation for the cache at hand.

On CPU (and wherever no Triton kernel applies) the reference codec with vectorised torch
gather/scatter serves; the Triton kernels plug in here for CUDA caches.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from turbowire.codec import Codec
from turbowire.kernels import fp8_cache
from turbowire.kernels.fp8_cache import KVScales
from turbowire.kernels.paged import BlockIndexError, PagedKVLayout

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EncodeItem:
    """Encode tokens [token_start, token_start + num_tokens) of a request as one chunk."""

    block_ids: Sequence[int] | torch.Tensor
    token_start: int
    num_tokens: int
    out_offset: int
    tag: int = 0


@dataclass(frozen=True)
class DecodeItem:
    """Decode the chunk at source[in_offset : in_offset + nbytes] into those tokens' slots."""

    block_ids: Sequence[int] | torch.Tensor
    token_start: int
    num_tokens: int
    in_offset: int
    nbytes: int
    expected_tag: int | None = None


def _check_range(buf: torch.Tensor, offset: int, nbytes: int, what: str) -> None:
    if offset < 0 or nbytes < 0 or offset + nbytes > buf.numel():
        raise BlockIndexError(
            f"{what} range {offset}..{offset + nbytes} is outside the {buf.numel()}-byte buffer"
        )


def _use_triton(impl: str, codec: Codec, kv_cache: torch.Tensor) -> bool:
    """impl: "auto" (Triton for CUDA caches), "triton" (also on CPU under TRITON_INTERPRET=1,
    for tests) or "reference"."""
    from turbowire.kernels import triton_dispatch

    if impl not in ("auto", "triton", "cpu", "reference"):
        raise ValueError(f"impl must be 'auto', 'triton', 'cpu' or 'reference', got {impl!r}")
    return impl == "triton" or (impl == "auto" and triton_dispatch.applies(codec, kv_cache))


def _use_cpu(impl: str, codec: Codec, kv_cache: torch.Tensor, layout: PagedKVLayout,
             buf: torch.Tensor) -> bool:
    """The C codec (kernels/cpu/, same bytes) for CPU bf16/fp16 caches: "auto" when it applies
    and is built, "cpu" always (refused with CpuKernelError where it cannot serve)."""
    from turbowire.kernels import cpu_dispatch

    if impl == "cpu":
        cpu_dispatch.require_applicable(codec, kv_cache, layout, buf)
        return True
    return impl == "auto" and cpu_dispatch.applies(codec, kv_cache, layout, buf)


def encode_into(
    codec: Codec,
    layer: int,
    kv_cache: torch.Tensor,
    layout: PagedKVLayout,
    items: Sequence[EncodeItem],
    staging: torch.Tensor,
    *,
    impl: str = "auto",
    kernel_config: Any = None,
    kv_scales: KVScales | tuple[float, float] | None = None,
) -> list[int]:
    """Encode each item's tokens of this layer into ``staging`` (uint8); bytes written per item.

    fp8 caches (float8_e4m3fn or uint8 bits) need the layer's ``kv_scales`` = (k_scale,
    v_scale); their values are coded as bf16 (``kernels/fp8_cache.py``)."""
    from turbowire.kernels import triton_dispatch

    scales = fp8_cache.resolve_scales(kv_cache, kv_scales)
    if _use_triton(impl, codec, kv_cache):
        return triton_dispatch.encode_into(
            codec, layer, kv_cache, layout, items, staging, kernel_config, kv_scales=scales
        )
    if (scales is None or impl == "cpu") and _use_cpu(impl, codec, kv_cache, layout, staging):
        from turbowire.kernels import cpu_dispatch

        return cpu_dispatch.encode_into(codec, layer, kv_cache, layout, items, staging)
    written = []
    for item in items:
        k, v = layout.gather(kv_cache, item.block_ids, item.token_start, item.num_tokens)
        if scales is not None:
            ks, vs = scales.as_fp32()
            k, v = fp8_cache.dequantize(k, ks), fp8_cache.dequantize(v, vs)
        enc = codec.encode(layer, k, v, tag=item.tag, token_offset=item.token_start)
        _check_range(staging, item.out_offset, enc.nbytes, "staging")
        staging[item.out_offset : item.out_offset + enc.nbytes] = enc.data.to(staging.device)
        written.append(enc.nbytes)
    return written


def decode_into(
    codec: Codec,
    layer: int,
    kv_cache: torch.Tensor,
    layout: PagedKVLayout,
    items: Sequence[DecodeItem],
    source: torch.Tensor,
    *,
    impl: str = "auto",
    kernel_config: Any = None,
    kv_scales: KVScales | tuple[float, float] | None = None,
) -> None:
    """Verify and decode every item, then scatter them; nothing is written if any item fails.

    fp8 caches need the layer's ``kv_scales`` (see ``encode_into``)."""
    from turbowire.kernels import triton_dispatch

    scales = fp8_cache.resolve_scales(kv_cache, kv_scales)
    if _use_triton(impl, codec, kv_cache):
        triton_dispatch.decode_into(codec, layer, kv_cache, layout, items, source, kernel_config,
                                    kv_scales=scales)
        return
    if (scales is None or impl == "cpu") and _use_cpu(impl, codec, kv_cache, layout, source):
        from turbowire.kernels import cpu_dispatch

        cpu_dispatch.decode_into(codec, layer, kv_cache, layout, items, source)
        return
    decoded = []
    for item in items:
        _check_range(source, item.in_offset, item.nbytes, "source")
        data = source[item.in_offset : item.in_offset + item.nbytes]
        k, v = codec.decode(
            layer, data, expected_tag=item.expected_tag, expected_tokens=item.num_tokens,
            expected_offset=item.token_start,
        )
        # validate the destination before anything is written
        layout.token_index(item.block_ids, item.token_start, item.num_tokens)
        decoded.append((item, k, v))
    if scales is not None:
        ks, vs = scales.as_fp32()
        decoded = [(item, fp8_cache.quantize(k, ks), fp8_cache.quantize(v, vs))
                   for item, k, v in decoded]
        kv_cache = fp8_cache.as_e4m3(kv_cache)
    for item, k, v in decoded:
        layout.scatter(kv_cache, item.block_ids, item.token_start, k, v)
