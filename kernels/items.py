"""The work items of the front door (``turbowire.kernels.encode_into`` / ``decode_into``) and the
buffer range check every implementation applies to them.

A leaf module: it imports only ``kernels/paged.py`` and the codec's errors, so the front door
(``dispatch``) and the implementations (``triton_launch``, ``cpu_binding``) all import the items
from here and none of them imports another.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from turbowire.codec.errors import GeometryError
from turbowire.kernels.paged import BlockIndexError


@dataclass(frozen=True)
class EncodeItem:
    """Encode tokens [token_start, token_start + num_tokens) of a request as one chunk (of the
    cache's heads ``[head_start, head_start + head_count)`` only when ``head_count`` is set: a
    prefill rank staging a chunk per decode rank's heads, ``connector/tp_plan.py``)."""

    block_ids: Sequence[int] | torch.Tensor
    token_start: int
    num_tokens: int
    out_offset: int
    tag: int = 0
    head_start: int = 0
    head_count: int = 0  # 0: every head of the cache

    def __post_init__(self) -> None:
        if self.head_start < 0 or self.head_count < 0 or (self.head_start and
                                                          not self.head_count):
            raise ValueError(f"bad head run {self.head_start}+{self.head_count}")


@dataclass(frozen=True)
class HeadWindow:
    """Of a chunk holding ``src_heads`` KV heads, keep ``[src_start, src_start + count)`` and
    write them at the cache's head ``dst_start`` (a decode rank of another TP size than the
    prefill rank that staged the chunk: ``connector/tp_plan.py``)."""

    src_heads: int
    src_start: int
    count: int
    dst_start: int

    def __post_init__(self) -> None:
        if not (self.src_heads > 0 and self.count > 0 and self.src_start >= 0
                and self.dst_start >= 0 and self.src_start + self.count <= self.src_heads):
            raise ValueError(f"bad head window {self}")


@dataclass(frozen=True)
class DecodeItem:
    """Decode the chunk at source[in_offset : in_offset + nbytes] into those tokens' slots
    (``heads``: only a window of the chunk's heads, at an offset of the cache's)."""

    block_ids: Sequence[int] | torch.Tensor
    token_start: int
    num_tokens: int
    in_offset: int
    nbytes: int
    expected_tag: int | None = None
    heads: HeadWindow | None = None


def check_chunk_heads(layer: int, heads: int, window: HeadWindow) -> None:
    """A chunk read through ``window`` must hold the heads the window was planned for: a peer's
    chunk of other heads is refused, never sliced."""
    if heads != window.src_heads:
        raise GeometryError(f"chunk of layer {layer} holds {heads} KV heads, the prefill "
                            f"rank's chunks hold {window.src_heads}")


def check_range(buf: torch.Tensor, offset: int, nbytes: int, what: str) -> None:
    """Refuse (BlockIndexError) a byte range [offset, offset + nbytes) outside ``buf``."""
    if offset < 0 or nbytes < 0 or offset + nbytes > buf.numel():
        raise BlockIndexError(
            f"{what} range {offset}..{offset + nbytes} is outside the {buf.numel()}-byte buffer"
        )
