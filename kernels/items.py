"""The work items of the front door (``turbowire.kernels.encode_into`` / ``decode_into``) and the
buffer range check every implementation applies to them.

A leaf module: it imports only ``kernels/paged.py``, so the front door (``dispatch``) and the
implementations (``triton_launch``, ``cpu_binding``) all import the items from here and none of
them imports another.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from turbowire.kernels.paged import BlockIndexError


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


def check_range(buf: torch.Tensor, offset: int, nbytes: int, what: str) -> None:
    """Refuse (BlockIndexError) a byte range [offset, offset + nbytes) outside ``buf``."""
    if offset < 0 or nbytes < 0 or offset + nbytes > buf.numel():
        raise BlockIndexError(
            f"{what} range {offset}..{offset + nbytes} is outside the {buf.numel()}-byte buffer"
        )
