"""turbowire.kernels: the codec fused with vLLM's paged KV layouts (gather+encode, decode+scatter).

``encode_into`` / ``decode_into`` pick the implementation: Triton kernels for CUDA caches, the
reference codec with vectorised torch gather/scatter elsewhere.
"""

from turbowire.kernels.dispatch import DecodeItem, EncodeItem, decode_into, encode_into
from turbowire.kernels.fp8_cache import KVScales
from turbowire.kernels.paged import BlockIndexError, CacheLayoutError, PagedKVLayout

__all__ = [
    "PagedKVLayout", "EncodeItem", "DecodeItem", "encode_into", "decode_into",
    "BlockIndexError", "CacheLayoutError", "KVScales",
]
