"""The front door: one entry point per direction, and its multi-layer variant, that picks the
implementation for the cache at hand.

* ``encode_into`` / ``decode_into``: the items of one layer.
* ``encode_layers_into`` / ``decode_layers_into``: several layers of one model in one call
  (jobs of ``(layer, kv_cache, layout, items)``).

Implementations, chosen per call by ``impl`` ("auto" unless a test or benchmark pins one):

* ``triton_launch`` for CUDA caches (also on CPU under ``TRITON_INTERPRET=1`` with
  ``impl="triton"``); the multi-layer variants batch all layers in one launch per layer policy.
* ``cpu_binding``, the C codec (kernels/cpu/), for CPU bf16/fp16 caches where it is built and
  applies (``impl="cpu"`` requires it).
* the reference codec (``turbowire.codec``) with vectorised torch gather/scatter elsewhere
  (``impl="reference"``), and for an MLA layer's cache (a ``LatentPages`` layout: latent
  chunks, ``kernels/latent.py``) on any device. Items with a head window (``DecodeItem.heads``:
  another TP size's chunks) and items that encode a run of heads (``EncodeItem.head_count``: a
  chunk per decode rank's heads) take Triton where it applies; on CPU the C codec codes runs
  of heads and writes windows of a chunk's every head (a run staged for this rank, a narrower
  prefill rank's chunk), the reference (``kernels/heads.py``) a part of a chunk's heads.

All of them write the same bytes and raise the same exceptions. The items and their range check
live in ``kernels/items.py``; the implementations import them from there, never from here.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from turbowire.codec import Codec
from turbowire.codec.errors import GeometryError
from turbowire.kernels import cpu_binding, fp8_cache, triton_launch
from turbowire.kernels.fp8_cache import KVScales
from turbowire.kernels.heads import decode_heads_into
from turbowire.kernels.items import DecodeItem, EncodeItem, check_range
from turbowire.kernels.latent import LatentPages, decode_latent_into, encode_latent_into
from turbowire.kernels.paged import PagedKVLayout

__all__ = [
    "DecodeItem",
    "EncodeItem",
    "check_range",
    "decode_into",
    "decode_layers_into",
    "encode_into",
    "encode_layers_into",
]

logger = logging.getLogger(__name__)

EncodeJob = tuple[int, torch.Tensor, PagedKVLayout, Sequence[EncodeItem]]
DecodeJob = tuple[int, torch.Tensor, PagedKVLayout, Sequence[DecodeItem]]


def _use_triton(impl: str, codec: Codec, kv_cache: torch.Tensor) -> bool:
    """impl: "auto" (Triton for CUDA caches), "triton" (also on CPU under TRITON_INTERPRET=1,
    for tests) or "reference"."""
    if impl not in ("auto", "triton", "cpu", "reference"):
        raise ValueError(f"impl must be 'auto', 'triton', 'cpu' or 'reference', got {impl!r}")
    return impl == "triton" or (impl == "auto" and triton_launch.applies(codec, kv_cache))


def _use_cpu(impl: str, codec: Codec, kv_cache: torch.Tensor, layout: PagedKVLayout,
             buf: torch.Tensor) -> bool:
    """The C codec (kernels/cpu/, same bytes) for CPU bf16/fp16 caches: "auto" when it applies
    and is built, "cpu" always (refused with CpuKernelError where it cannot serve)."""
    if impl == "cpu":
        cpu_binding.require_applicable(codec, kv_cache, layout, buf)
        return True
    return impl == "auto" and cpu_binding.applies(codec, kv_cache, layout, buf)


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
    if isinstance(layout, LatentPages):
        return encode_latent_into(codec, layer, kv_cache, layout, items, staging)
    scales = fp8_cache.resolve_scales(kv_cache, kv_scales)
    if _use_triton(impl, codec, kv_cache):  # runs of heads included
        return triton_launch.encode_into(
            codec, layer, kv_cache, layout, items, staging, kernel_config, kv_scales=scales
        )
    if (scales is None or impl == "cpu") and _use_cpu(impl, codec, kv_cache, layout, staging):
        return cpu_binding.encode_into(codec, layer, kv_cache, layout, items, staging)
    written = []
    for item in items:
        k, v = layout.gather(kv_cache, item.block_ids, item.token_start, item.num_tokens)
        if item.head_count:
            if item.head_start + item.head_count > k.shape[1]:
                raise GeometryError(f"heads {item.head_start}+{item.head_count} outside the "
                                    f"cache's {k.shape[1]}")
            run = slice(item.head_start, item.head_start + item.head_count)
            k, v = k[:, run], v[:, run]
        if scales is not None:
            ks, vs = scales.as_fp32()
            k, v = fp8_cache.dequantize(k, ks), fp8_cache.dequantize(v, vs)
        enc = codec.encode(layer, k, v, tag=item.tag, token_offset=item.token_start)
        check_range(staging, item.out_offset, enc.nbytes, "staging")
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
    """Verify and decode every item and scatter it; raises for the first item that fails.

    A refused item is never written. The reference and C paths verify every item before they
    write any (nothing is written if one fails); the Triton path verifies each chunk in the
    program that decodes it, so the valid items of a call with a refused one are written.
    fp8 caches need the layer's ``kv_scales`` (see ``encode_into``)."""
    if isinstance(layout, LatentPages):
        if any(item.heads is not None for item in items):
            raise ValueError("an MLA latent is the same on every TP rank: no head window")
        decode_latent_into(codec, layer, kv_cache, layout, items, source)
        return
    scales = fp8_cache.resolve_scales(kv_cache, kv_scales)
    if _use_triton(impl, codec, kv_cache):  # head windows included
        triton_launch.decode_into(codec, layer, kv_cache, layout, items, source, kernel_config,
                                    kv_scales=scales)
        return
    windows = any(item.heads is not None for item in items)  # another TP size's chunks
    if windows and cpu_binding.whole_window(items) is None:  # a part of the chunks' heads
        decode_heads_into(codec, layer, kv_cache, layout, items, source, scales)
        return
    if (scales is None or impl == "cpu") and _use_cpu(impl, codec, kv_cache, layout, source):
        cpu_binding.decode_into(codec, layer, kv_cache, layout, items, source)
        return
    if windows:
        decode_heads_into(codec, layer, kv_cache, layout, items, source, scales)
        return
    decoded = []
    for item in items:
        check_range(source, item.in_offset, item.nbytes, "source")
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


def _per_job_scales(n_jobs: int, kv_scales: Sequence[Any] | None) -> list[Any]:
    scales = list(kv_scales) if kv_scales is not None else [None] * n_jobs
    if len(scales) != n_jobs:
        raise ValueError(f"kv_scales has {len(scales)} entries for {n_jobs} layers")
    return scales


def _per_layer_only(jobs: Sequence[Any]) -> bool:
    """MLA layers take the per-layer latent path (no batched Triton launch serves them)."""
    return any(isinstance(job[2], LatentPages) for job in jobs)


def encode_layers_into(
    codec: Codec,
    jobs: Sequence[EncodeJob],
    staging: torch.Tensor,
    *,
    impl: str = "auto",
    kernel_config: Any = None,
    kv_scales: Sequence[KVScales | tuple[float, float] | None] | None = None,
) -> list[list[int]]:
    """Encode several layers of one model into ``staging``; bytes written per item, per job.

    ``jobs`` are ``(layer, kv_cache, layout, items)``; all caches must share dtype, device and
    geometry (one model). fp8 caches need ``kv_scales``, one (k_scale, v_scale) per job.

    The implementation is picked here from the first job's cache, as ``encode_into`` picks it:
    Triton (CUDA caches, or ``impl="triton"``) encodes all jobs with one launch per distinct
    layer policy (``triton_launch.encode_layers_into``); everywhere else (the C codec, the
    reference) this is a loop over ``encode_into``, one job at a time. The bytes are the same
    either way: those of one ``encode_into`` per job."""
    scales = _per_job_scales(len(jobs), kv_scales)
    if not jobs:
        return []
    if _use_triton(impl, codec, jobs[0][1]) and not _per_layer_only(jobs):
        resolved = [fp8_cache.resolve_scales(cache, sc) for (_l, cache, _lay, _i), sc
                    in zip(jobs, scales)]
        return triton_launch.encode_layers_into(codec, jobs, staging, kernel_config,
                                                  kv_scales=resolved)
    return [
        encode_into(codec, layer, cache, layout, items, staging, impl=impl,
                    kernel_config=kernel_config, kv_scales=sc)
        for (layer, cache, layout, items), sc in zip(jobs, scales)
    ]


def decode_layers_into(
    codec: Codec,
    jobs: Sequence[DecodeJob],
    source: torch.Tensor,
    *,
    impl: str = "auto",
    kernel_config: Any = None,
    kv_scales: Sequence[KVScales | tuple[float, float] | None] | None = None,
) -> None:
    """Verify, decode and scatter several layers of one model (jobs as in
    ``encode_layers_into``); fp8 caches need ``kv_scales``, one per job.

    The implementation is picked here from the first job's cache, as ``decode_into`` picks it:
    Triton decodes every job with one launch per distinct layer policy, each program verifying
    the chunk it decodes (``triton_launch.decode_layers_into``): a refused chunk is not
    written, the valid chunks of every job are. Everywhere else this is a loop over
    ``decode_into``, one job at a time: each job is all-or-nothing, but a failing job leaves the
    jobs before it decoded. The exception raised for a bad chunk is the same on both paths, and
    on neither is a refused chunk ever written."""
    scales = _per_job_scales(len(jobs), kv_scales)
    if not jobs:
        return
    if _use_triton(impl, codec, jobs[0][1]) and not _per_layer_only(jobs):
        resolved = [fp8_cache.resolve_scales(cache, sc) for (_l, cache, _lay, _i), sc
                    in zip(jobs, scales)]
        triton_launch.decode_layers_into(codec, jobs, source, kernel_config,
                                           kv_scales=resolved)
        return
    for (layer, cache, layout, items), sc in zip(jobs, scales):
        decode_into(codec, layer, cache, layout, items, source, impl=impl,
                    kernel_config=kernel_config, kv_scales=sc)


def decode_tail_into(
    codec: Codec,
    layer: int,
    kv_cache: torch.Tensor,
    layout: PagedKVLayout,
    item: DecodeItem,
    source: torch.Tensor,
    skip_tokens: int,
    *,
    kv_scales: KVScales | tuple[float, float] | None = None,
) -> None:
    """Verify and decode one chunk but write only its tokens from ``skip_tokens`` on.

    Why: a chunk that starts inside the part of a request vLLM already holds (its prefix cache,
    block-aligned but not chunk-aligned) must not write over those blocks, which other requests
    may share. The reference codec decodes the chunk; the layout scatters its tail. At most one
    chunk per load takes this path."""
    if not 0 < skip_tokens < item.num_tokens:
        raise ValueError(f"skip_tokens={skip_tokens} must be inside the chunk's "
                         f"{item.num_tokens} tokens")
    if isinstance(layout, LatentPages):
        decode_latent_into(codec, layer, kv_cache, layout, [item], source, skip_tokens)
        return
    scales = fp8_cache.resolve_scales(kv_cache, kv_scales)
    check_range(source, item.in_offset, item.nbytes, "source")
    data = source[item.in_offset : item.in_offset + item.nbytes].cpu()
    k, v = codec.decode(
        layer, data, expected_tag=item.expected_tag, expected_tokens=item.num_tokens,
        expected_offset=item.token_start,
    )
    k, v = k[skip_tokens:].to(kv_cache.device), v[skip_tokens:].to(kv_cache.device)
    start = item.token_start + skip_tokens
    layout.token_index(item.block_ids, start, k.shape[0])  # validate before writing
    if scales is not None:
        ks, vs = scales.as_fp32()
        k, v = fp8_cache.quantize(k, ks), fp8_cache.quantize(v, vs)
        kv_cache = fp8_cache.as_e4m3(kv_cache)
    layout.scatter(kv_cache, item.block_ids, start, k, v)
