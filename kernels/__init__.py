"""turbowire.kernels: the codec fused with vLLM's paged KV layouts (gather+encode, decode+scatter).

This package is the only place that knows paged cache layouts and picks an implementation.

The front door (``kernels/dispatch.py``, re-exported here):

* ``encode_into`` / ``decode_into``: the items (``EncodeItem`` / ``DecodeItem``, defined in
  ``kernels/items.py``) of one layer;
* ``encode_layers_into`` / ``decode_layers_into``: several layers of one model in one call.

Each call picks the implementation for the cache at hand (``impl="auto"``); all of them write the
same bytes as the reference codec and raise the same exceptions:

* Triton (``triton_launch`` host side, ``triton_codec`` kernels) for CUDA caches; the
  multi-layer variants batch all layers in one launch per layer policy;
* the C codec (``cpu_binding`` over the extension built from ``kernels/cpu/``) for CPU
  bf16/fp16 caches when it is built and applies;
* the reference (``turbowire.codec`` with vectorised torch gather/scatter) everywhere else; on
  CPU the multi-layer variants loop over the per-layer calls.

The connector's CUDA coder takes the Triton implementation directly through the plans exported
here (``ChunkSet``, ``EncodeLayersPlan``, ``DecodeLayersPlan`` of ``kernels/triton_plans.py``):
the same chunks in every layer, built from arrays, launched per layer or batched, with no host
synchronisation before a decode's ``check``; ``cuda_serves`` says where they apply and
``block_kernel_config`` gives the launch shape of block-sized chunks. The connector imports this
package only, never a module below it (tests/unit/test_kernels_imports.py checks it).

Layouts: ``PagedKVLayout`` (``kernels/paged.py``) describes vLLM's paged caches (gather/scatter
of the reference path); ``NO_BLOCK`` marks a block-list entry the request does not hold (a
sliding window's freed blocks), which every implementation skips and refuses to address.
The CPU attention layouts module, ``kernels/cpu_attn_layout.py``
(``CpuAttnKVLayout``, ``cpu_attn_layout``), learns where vLLM's CPU attention backend really
keeps each token's K and V in a block (the ``vec`` / ``vec16`` / ``amx`` placements) by probing
vLLM's own write op; the C codec serves its strided and tiled placements, the reference any
other. ``kernels/fp8_cache.py`` handles fp8 e4m3 caches (``KVScales``); ``kernels/quant_lut.py``
holds the Triton encoder's Lloyd-Max lookup table. ``kernels/state.py`` (``StatePages``,
``encode_state_into``, ``decode_state_into``) moves a Mamba / linear-attention layer's state
block raw in its checksummed chunk (``turbowire.codec.state``); ``kernels/latent.py``
(``LatentPages``) an MLA layer's ``[num_blocks, block_size, kv_lora_rank + rope]`` cache, coded
as latent chunks (``turbowire.codec.latent``) by the reference on any device.
``kernels/heads.py`` decodes a window of a chunk's heads into other heads of a cache
(``DecodeItem.heads``, a ``HeadWindow``: prefill and decode at different TP sizes), through the
reference on any device.

Module graph: ``items`` and ``paged`` are leaves; ``dispatch`` imports the implementations, which
never import ``dispatch`` (tests/unit/test_kernels_imports.py checks it).
"""

from turbowire.kernels.cpu_attn_layout import cpu_attn_layout
from turbowire.kernels.cpu_binding import served_by
from turbowire.kernels.dispatch import (
    decode_into,
    decode_layers_into,
    decode_tail_into,
    encode_into,
    encode_layers_into,
)
from turbowire.kernels.fp8_cache import FP8_CACHE_DTYPES, KVScales, is_fp8_cache, resolve_scales
from turbowire.kernels.items import DecodeItem, EncodeItem, HeadWindow
from turbowire.kernels.latent import LatentPages
from turbowire.kernels.paged import NO_BLOCK, BlockIndexError, CacheLayoutError, PagedKVLayout
from turbowire.kernels.state import StatePages, decode_state_into, encode_state_into
from turbowire.kernels.triton_common import (
    BLOCK_ENCODE_REGISTERS,
    KernelConfig,
    block_kernel_config,
    cuda_serves,
)
from turbowire.kernels.triton_plans import ChunkSet, DecodeLayersPlan, EncodeLayersPlan

__all__ = [
    "NO_BLOCK",
    "BLOCK_ENCODE_REGISTERS",
    "FP8_CACHE_DTYPES",
    "BlockIndexError",
    "CacheLayoutError",
    "ChunkSet",
    "DecodeItem",
    "DecodeLayersPlan",
    "EncodeItem",
    "EncodeLayersPlan",
    "HeadWindow",
    "KVScales",
    "KernelConfig",
    "LatentPages",
    "PagedKVLayout",
    "StatePages",
    "block_kernel_config",
    "cpu_attn_layout",
    "cuda_serves",
    "decode_into",
    "decode_layers_into",
    "decode_state_into",
    "decode_tail_into",
    "encode_into",
    "encode_layers_into",
    "encode_state_into",
    "is_fp8_cache",
    "resolve_scales",
    "served_by",
]
