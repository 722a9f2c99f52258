"""What the worker and the store path ask of a cache coder, and the pieces both coders share.

A coder encodes a worker's paged KV caches into wire chunks (prefill staging, store blobs) and
decodes landed chunks back into them (a P2P load's layer groups, a stored chunk). Two exist:
``cuda.CudaCoder`` (Triton plans on a side stream, decodes as CUDA graphs) and
``host.HostCoder`` (the kernels' per-layer calls, C codec or reference); ``make_coder`` picks
one per worker, once.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    import torch

    from turbowire.connector.metadata import LoadRequest
    from turbowire.connector.tp_plan import ChunkCut


class PendingDecode(Protocol):
    """A layer group's decode that may still be running on the device."""

    def done(self) -> bool:
        """Whether it ran (its verdict is known); never waits."""
        ...

    def result(self) -> None:
        """Wait for it; raise the decode's refusal (a refused chunk is never written into the
        cache; valid chunks launched with it may be: they are blocks of the same load, which
        fails as a whole, so vLLM recomputes them)."""
        ...

    def abandon(self) -> None:
        """The load failed: run nothing more of it, wait for what reads the receive range."""
        ...


class DoneDecode:
    """A decode that ran inline (the host coder): its verdict is already known."""

    def __init__(self, layers: range) -> None:
        self.layers = layers

    def done(self) -> bool:
        return True

    def result(self) -> None:
        return None

    def abandon(self) -> None:
        return None


class ChunkOffsets(Mapping[tuple[int, int], tuple[int, int]]):
    """Where each chunk of a load lies in its receive range: ``(block position, layer) ->
    (offset, bytes)``, backed by two ``[layers, blocks]`` arrays (``offsets``, ``sizes``) that a
    decode takes whole; ``groups``: the layers of each READ, in the order they are handed over;
    ``runs``: the runs of groups the loader is likely to hand over in one call besides single
    groups (the CUDA coder prepares one launch for each)."""

    def __init__(self, offsets: np.ndarray, sizes: np.ndarray,
                 groups: Sequence[range] | None = None,
                 runs: Sequence[range] = ()) -> None:
        self.offsets = offsets
        self.sizes = sizes
        self.groups: list[range] = list(groups) if groups else [range(sizes.shape[0])]
        self.runs: list[range] = list(runs)

    @classmethod
    def from_mapping(cls, chunks: Mapping[tuple[int, int], tuple[int, int]], n_layers: int,
                     n_blocks: int) -> ChunkOffsets:
        """The arrays of any ``(block, layer) -> (offset, bytes)`` mapping (tests, tools)."""
        if isinstance(chunks, ChunkOffsets):
            return chunks
        offsets = np.zeros((n_layers, n_blocks), np.int64)
        sizes = np.zeros((n_layers, n_blocks), np.int64)
        for (bi, layer), (off, size) in chunks.items():
            offsets[layer, bi], sizes[layer, bi] = off, size
        return cls(offsets, sizes)

    def __getitem__(self, key: tuple[int, int]) -> tuple[int, int]:
        bi, layer = key
        if not (0 <= layer < self.sizes.shape[0] and 0 <= bi < self.sizes.shape[1]):
            raise KeyError(key)
        return int(self.offsets[layer, bi]), int(self.sizes[layer, bi])

    def __iter__(self) -> Iterator[tuple[int, int]]:
        for layer in range(self.sizes.shape[0]):
            for bi in range(self.sizes.shape[1]):
                yield (bi, layer)

    def __len__(self) -> int:
        return int(self.sizes.size)


@dataclass
class BlobPlan:
    """The store's chunks of one step, one blob each: which tokens of which request, where each
    layer's chunk lies in the blob (after the blob header, which the store writes) and the sizes
    the codec promised (``layer_nbytes``, [chunks][layers])."""

    block_ids: list[list[int]]  # per request
    request: list[int]  # request of each chunk
    token_start: list[int]
    num_tokens: int
    tags: list[int]
    layer_offsets: list[list[int]]  # [chunks][layers], in the chunk's blob
    layer_nbytes: list[list[int]]
    blob_nbytes: list[int]


class EncodedBlobs(Protocol):
    """A step's store blobs on their way to host memory."""

    background: bool  # True: still on the device, ``wait`` blocks (the store's thread waits)

    def wait(self) -> list[tuple[bytes | BaseException, float]]:
        """Per chunk: its blob's bytes (the header's room left for the store to fill) or why
        it was not encoded, and the encode seconds to report; may wait for the device (call it
        off the engine thread when ``background``)."""
        ...


class CacheCoder(Protocol):
    """One worker's encoder/decoder of its paged caches (see the module)."""

    device: torch.device

    def save_layer(self, layer: int, meta: Any) -> None:
        """vLLM's ``save_kv_layer``: encode ``layer``'s saves of this step into staging."""
        ...

    def finish_save(self, meta: Any) -> tuple[int, int]:
        """``wait_for_save``: encode what is left; (tokens, wire bytes) of the step's saves."""
        ...

    def encode_seconds(self) -> list[float]:
        """Encode time of earlier steps that is known by now; never waits."""
        ...

    def prepare_load(self, load: LoadRequest, recv_offset: int, chunks: ChunkOffsets,
                     cut: ChunkCut | None = None) -> None:
        """A load's READs are posted: get its decode ready while the bytes move (``cut``: as
        ``decode``'s)."""
        ...

    def decode(self, load: LoadRequest, layers: range, recv_offset: int,
               chunks: ChunkOffsets, cut: ChunkCut | None = None) -> PendingDecode:
        """Verify and decode the landed chunks of ``layers`` into the cache (``cut``: each
        chunk's bytes are staged runs of heads, each kept through its head window: a prefill
        rank of another TP size, or one that cuts its chunks per decode rank's heads)."""
        ...

    def encode_chunks(self, plan: BlobPlan) -> EncodedBlobs:
        """Encode the store's chunks of a step into blobs."""
        ...

    def decode_chunks(self, block_ids: Sequence[int], token_start: int, num_tokens: int,
                      chunks: Sequence[tuple[int, int]], tag: int, source: torch.Tensor,
                      skip: int) -> int:
        """Decode one stored chunk's layer chunks (``(offset, bytes)`` in ``source``, every one
        verified by the caller) into the caches, but for its first ``skip`` tokens (vLLM's
        own); the tokens written. Bytes final on return."""
        ...


def check_sizes(written: Any, promised: Any, room: int | None, layer: int) -> None:
    """The one check of what the codec wrote: never more than the slot room (it would spill into
    the next layer's chunk), always exactly what ``encoded_nbytes`` promised (the READ and the
    blob header are sized from it). ``room`` None: no slot (store blobs are sized exactly)."""
    n_arr, want = (a.reshape(-1) for a in np.broadcast_arrays(
        np.asarray(written, dtype=np.int64), np.asarray(promised, dtype=np.int64)))
    if room is not None:
        over = n_arr > room
        if over.any():
            i = int(np.argmax(over))
            raise RuntimeError(f"codec wrote {int(n_arr[i])} bytes for a block of layer {layer}, "
                               f"slot room is {int(room)}")
    wrong = n_arr != want
    if wrong.any():
        i = int(np.argmax(wrong))
        raise RuntimeError(f"codec wrote {int(n_arr[i])} bytes, encoded_nbytes promised "
                           f"{int(want[i])}")
