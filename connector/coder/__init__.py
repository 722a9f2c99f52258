"""One cache coder per worker, chosen once (``make_coder``), shared by the P2P path (the
worker's saves into staging and the loader's decodes) and the store path (blobs).

* ``base``: what a coder is (``CacheCoder``), the loader's ``PendingDecode`` handles, the
  ``ChunkOffsets`` of a load, the store's ``BlobPlan`` and ``check_sizes``;
* ``cuda`` (+ ``cuda_load``, ``cuda_graphs``): Triton plans on side streams, decodes captured
  into CUDA graphs, no host synchronisation on the save path;
* ``host``: the kernels' per-layer calls (C codec, reference), bytes final on return.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Literal

from turbowire.connector.codecs import chunk_nbytes as exact_chunk_nbytes
from turbowire.connector.coder.base import (
    BlobPlan,
    CacheCoder,
    ChunkOffsets,
    EncodedBlobs,
    PendingDecode,
    check_sizes,
)
from turbowire.connector.coder.cuda import CudaCoder
from turbowire.connector.coder.host import HostCoder
from turbowire.kernels import cuda_serves

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    import torch

    from turbowire.codec import Codec
    from turbowire.connector.caches import EngineCaches
    from turbowire.connector.geometry import KVGeometry, StagingLayout

__all__ = [
    "BlobPlan",
    "CacheCoder",
    "ChunkOffsets",
    "CudaCoder",
    "EncodedBlobs",
    "HostCoder",
    "PendingDecode",
    "check_sizes",
    "make_coder",
]


def make_coder(
    codec: Codec,
    geometry: KVGeometry,
    caches: EngineCaches,
    *,
    layout: StagingLayout | None = None,
    staging: torch.Tensor | None = None,
    recv: torch.Tensor | None = None,
    chunk_nbytes: Any = None,
    save_schedule: str = "layerwise",
    kernel_config: Any = "auto",
    kind: Literal["auto", "cuda", "host"] = "auto",
) -> CudaCoder | HostCoder:
    """The coder of one worker's caches: the CUDA coder where the Triton plans serve every cache
    (``turbowire.kernels.cuda_serves``), else the host coder. ``kind`` forces one (tests run the
    CUDA coder on CPU under Triton's interpreter: launched inline, no streams).
    ``save_schedule``: ``layerwise`` encodes each layer from ``save_layer``, ``after_forward``
    every layer in ``finish_save``. ``chunk_nbytes(layer, tokens, block_index)``: the exact
    size of a chunk (``encoded_nbytes``, cached by the caller)."""
    if chunk_nbytes is None:
        def chunk_nbytes(layer: int, tokens: int, block_index: int,
                         heads: int | None = None) -> int:
            return exact_chunk_nbytes(codec, geometry, layer, tokens, block_index, heads)
    if kind == "auto":
        # a hybrid model's state layers are copied raw and an MLA model's latent rows coded by
        # the host coder's per-layer calls (Triton for the K/V layers of CUDA caches): the
        # CUDA coder's plans code K/V only (whole chunks, or runs of heads: decode_tp_size)
        cuda = (not geometry.state_groups and not geometry.has_latent
                and cuda_serves(codec, caches.tensors))
        kind = "cuda" if cuda else "host"
        if not cuda and any(t.is_cuda for t in caches.tensors) and not (
                geometry.state_groups or geometry.has_latent):
            logger.warning(
                "turbowire: the Triton kernels do not serve these caches (head_dim %d, %s: "
                "they code head_dim 64, 128, 256); the reference codec codes them chunk by "
                "chunk with torch ops on the GPU, orders of magnitude slower (seconds for a "
                "long prompt)", codec.head_dim, caches.tensors[0].dtype)
    if kind == "cuda" and (geometry.state_groups or geometry.has_latent):
        raise ValueError("the CUDA coder serves K/V attention layers only; this model has "
                         "Mamba / linear-attention state layers or MLA latents (the host "
                         "coder moves them)")
    if kind == "cuda":
        return CudaCoder(codec, geometry, caches, layout, staging, recv, chunk_nbytes,
                         mode="layer" if save_schedule == "layerwise" else "batched",
                         kernel_config=kernel_config)
    if kind != "host":
        raise ValueError(f"kind must be auto, cuda or host, got {kind!r}")
    return HostCoder(codec, geometry, caches, layout, staging, recv, chunk_nbytes)
