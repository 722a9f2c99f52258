"""Where a Mamba / gated-delta-net layer keeps a request's state in vLLM's paged cache.

vLLM hands the connector such a layer as a list of state tensors (a conv state and an SSM state,
``MambaSpec.shapes`` / ``dtypes``), each ``[num_blocks, ...]``: views into the layer's cache
pages, so state tensor ``i`` of block ``b`` is ``tensors[i][b]``, whatever its padding or its
place inside the page. A state chunk (``turbowire.codec.state``) carries those block slices'
bytes in tensor order; the decode side writes them back into its own block. Plain tensor copies
on any device (CPU or CUDA): nothing here is coded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from turbowire.codec.state import decode_state, encode_state
from turbowire.kernels.paged import NO_BLOCK, BlockIndexError, CacheLayoutError


@dataclass(frozen=True)
class StatePages:
    """The state tensors of one layer (``[num_blocks, ...]`` each) and their bytes per block."""

    tensors: tuple[torch.Tensor, ...]

    @classmethod
    def from_cache(cls, cache: object) -> StatePages:
        tensors = tuple(cache) if isinstance(cache, (list, tuple)) else (cache,)
        if not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
            raise CacheLayoutError("a state layer's cache is a list of tensors")
        blocks = {int(t.shape[0]) for t in tensors}
        if len(blocks) != 1 or any(t.dim() < 2 for t in tensors):
            raise CacheLayoutError(
                f"state tensors {[tuple(t.shape) for t in tensors]} do not share a leading "
                "block dimension")
        if any(not t[0].is_contiguous() for t in tensors):
            raise CacheLayoutError("a state tensor's block slice is not contiguous")
        return cls(tensors)

    @property
    def num_blocks(self) -> int:
        return int(self.tensors[0].shape[0])

    @property
    def state_bytes(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in self.tensors)

    def _check(self, block_id: int) -> None:
        if block_id == NO_BLOCK or not 0 <= block_id < self.num_blocks:
            raise BlockIndexError(
                f"state block {block_id} is outside the cache's {self.num_blocks} blocks")

    def pages(self, block_id: int) -> list[torch.Tensor]:
        """The bytes of each state tensor's slice of ``block_id`` (views, 1-D uint8)."""
        self._check(block_id)
        return [t[block_id].reshape(-1).view(torch.uint8) for t in self.tensors]


def encode_state_into(pages: StatePages, layer: int, num_layers: int, block_id: int, tag: int,
                      out: torch.Tensor, offset: int) -> int:
    """The state chunk of ``block_id`` at ``out[offset:]``; bytes written."""
    return encode_state(layer, num_layers, pages.pages(block_id), tag, out[offset:])


def decode_state_into(pages: StatePages, layer: int, num_layers: int, block_id: int,
                      source: torch.Tensor, offset: int, nbytes: int,
                      expected_tag: int | None) -> None:
    """Verify the state chunk at ``source[offset:offset + nbytes]`` and write it into
    ``block_id``; a refused chunk writes nothing."""
    if offset < 0 or offset + nbytes > source.numel():
        raise BlockIndexError(f"state chunk [{offset}, {offset + nbytes}) is outside the "
                              f"{source.numel()}-byte source")
    state = decode_state(source[offset:offset + nbytes], layer, num_layers, pages.state_bytes,
                         expected_tag)
    targets: Sequence[torch.Tensor] = pages.pages(block_id)
    cursor = 0
    for target in targets:
        n = int(target.numel())
        target.copy_(state[cursor:cursor + n].to(target.device))
        cursor += n
