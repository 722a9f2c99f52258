"""Decode a window of a chunk's KV heads into other heads of a cache: the load of a decode
rank whose TP size differs from the prefill rank's that staged the chunk (``HeadWindow``;
which window is the connector's ``tp_plan``).

The reference codec decodes each whole chunk (its header must name exactly the heads the
window expects: a peer's chunk of other heads is refused, never sliced); the window's heads
replace those of the destination tokens through the layout's own gather and scatter, so it
serves every layout the reference serves (GPU, the CPU attention placements, fp8 caches) and
leaves every other head of those tokens as it was. The Triton kernels serve windows of CUDA
caches themselves (``triton_launch.DecodePlan``: the same bytes written); the C codec does not.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from turbowire.codec import Codec
from turbowire.codec.errors import GeometryError
from turbowire.kernels import fp8_cache
from turbowire.kernels.items import DecodeItem, HeadWindow, check_chunk_heads, check_range


def decode_heads_into(codec: Codec, layer: int, kv_cache: torch.Tensor, layout: Any,
                      items: Sequence[DecodeItem], source: torch.Tensor,
                      scales: fp8_cache.KVScales | None) -> None:
    """Verify and decode every item, then write each one's head window; a refused item (or a
    window outside the cache's heads) raises before anything is written."""
    decoded = []
    for item in items:
        window = item.heads or HeadWindow(layout.num_heads, 0, layout.num_heads, 0)
        check_range(source, item.in_offset, item.nbytes, "source")
        data = source[item.in_offset : item.in_offset + item.nbytes]
        k, v = codec.decode(
            layer, data, expected_tag=item.expected_tag, expected_tokens=item.num_tokens,
            expected_offset=item.token_start,
        )
        check_chunk_heads(layer, k.shape[1], window)
        if window.dst_start + window.count > layout.num_heads:
            raise GeometryError(f"head window {window} outside the cache's "
                                f"{layout.num_heads} heads")
        layout.token_index(item.block_ids, item.token_start, item.num_tokens)  # validate first
        src = slice(window.src_start, window.src_start + window.count)
        decoded.append((item, window, k[:, src], v[:, src]))
    if scales is not None:
        ks, vs = scales.as_fp32()
        decoded = [(item, w, fp8_cache.quantize(k, ks), fp8_cache.quantize(v, vs))
                   for item, w, k, v in decoded]
        kv_cache = fp8_cache.as_e4m3(kv_cache)
    for item, window, k, v in decoded:
        old_k, old_v = layout.gather(kv_cache, item.block_ids, item.token_start, k.shape[0])
        dst = slice(window.dst_start, window.dst_start + window.count)
        old_k[:, dst] = k.to(device=old_k.device, dtype=old_k.dtype)
        old_v[:, dst] = v.to(device=old_v.device, dtype=old_v.dtype)
        layout.scatter(kv_cache, item.block_ids, item.token_start, old_k, old_v)
