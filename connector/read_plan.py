"""A load's READs: which layer groups go out, where every chunk lands in the receive range and
the NIXL descriptor rows of each READ, built as arrays (a 32k-token load is 65536 chunks; a
Python loop over them took ~1 s).

The groups cover the layers in order, so the receive range holds the chunks layer-major (each
group's chunks contiguous), blocks in load order inside a layer; a group's READ, or the READ of
every group left, is a slice of the rows (a view: nothing is copied when it is posted).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from turbowire.connector.coder.base import ChunkOffsets
from turbowire.connector.metadata import LoadBlock
from turbowire.kernels import NO_BLOCK


def layer_groups(num_layers: int, groups: int) -> list[range]:
    """Split layers 0..num_layers-1 into at most ``groups`` contiguous, near-equal ranges."""
    groups = max(1, min(groups, num_layers))
    base, extra = divmod(num_layers, groups)
    out: list[range] = []
    start = 0
    for g in range(groups):
        size = base + (1 if g < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


def chunk_sizes(blocks: Sequence[LoadBlock], num_layers: int,
                chunk_nbytes: Callable[[int, int, int], int]) -> np.ndarray:
    """Bytes of every chunk, [layers, blocks]: the size depends on the layer, the block's
    tokens and whether it is a sequence's first block (``chunk_nbytes``), so it is asked
    once per layer and distinct (tokens, first) pair."""
    tokens = np.array([b.num_tokens for b in blocks], dtype=np.int64)
    index = np.array([b.index for b in blocks], dtype=np.int64)
    _, rep, inv = np.unique(tokens * 2 + (index == 0), return_index=True, return_inverse=True)
    reps = [(int(tokens[i]), int(index[i])) for i in rep]
    sizes = np.empty((num_layers, len(blocks)), dtype=np.int64)
    for layer in range(num_layers):
        per_key = np.array([chunk_nbytes(layer, t, i) for t, i in reps], np.int64)
        sizes[layer] = per_key[inv.reshape(-1)]
    return sizes


def cut_chunk_sizes(blocks: Sequence[LoadBlock], whole: Callable[[int, int, int], int],
                    part: Callable[[int, int, int], int], cut_layers: Sequence[bool],
                    first: int, parts: int) -> tuple[np.ndarray, np.ndarray]:
    """Bytes read of every chunk and bytes skipped at its start, [layers, blocks], from a
    prefill rank that stages each K/V chunk (``cut_layers``) as runs of heads of ``part`` bytes
    each: this rank reads ``parts`` runs from the ``first``; other layers' chunks whole."""
    n_layers = len(cut_layers)
    runs = chunk_sizes(blocks, n_layers, part)
    full = chunk_sizes(blocks, n_layers, whole)
    cut = np.asarray(cut_layers, dtype=bool)[:, None]
    return np.where(cut, parts * runs, full), np.where(cut, first * runs, 0)


def held_chunks(blocks: Sequence[LoadBlock], tables: Sequence[Sequence[int]],
                layer_group: Sequence[int]) -> np.ndarray:
    """Which chunks a load needs, [layers, blocks]: with several KV cache groups a layer's
    chunk of a block is read only where its group's table holds the block (a sliding window's
    freed blocks are ``NO_BLOCK`` there, and its layers' chunks of them never move)."""
    index = np.array([b.index for b in blocks], dtype=np.int64)
    held = np.stack([np.asarray(table, dtype=np.int64)[index] != NO_BLOCK
                     for table in tables]) if index.size else np.zeros((len(tables), 0), bool)
    return held[np.asarray(layer_group, dtype=np.int64)]


@dataclass
class ReadRows:
    """The (addr, len, dev) rows of every chunk, local and remote, layer-major."""

    local: np.ndarray
    remote: np.ndarray
    group_rows: list[int]  # first row of each group, then the end

    def group(self, g: int) -> tuple[np.ndarray, np.ndarray]:
        lo, hi = self.group_rows[g], self.group_rows[g + 1]
        return self.local[lo:hi], self.remote[lo:hi]

    def rest(self, g: int) -> tuple[np.ndarray, np.ndarray]:
        """The rows of group ``g`` and every group after it (one READ)."""
        lo = self.group_rows[g]
        return self.local[lo:], self.remote[lo:]


def read_rows(offsets: ChunkOffsets, slots: Sequence[int], local_base: int, local_device: int,
              remote_base: int, slot_bytes: int, layer_offsets: Sequence[int],
              remote_device: int, skip: np.ndarray | None = None) -> ReadRows:
    """The descriptor rows of a load whose chunks land at ``local_base + offsets`` and are read
    from the peer's staging slots ``slots`` (``remote_base + slot * slot_bytes + layer
    offset``, plus ``skip[layer, block]`` bytes into the chunk: ``cut_chunk_sizes``). A chunk
    of 0 bytes (one the load does not need) gets no row."""
    flat = offsets.sizes.reshape(-1)
    n = offsets.sizes.shape[1]
    slot_arr = np.array(slots, dtype=np.int64)
    remote_addr = (remote_base + slot_arr[None, :] * slot_bytes
                   + np.array(layer_offsets, dtype=np.int64)[:, None])
    if skip is not None:
        remote_addr = remote_addr + skip
    remote_addr = remote_addr.reshape(-1)
    local_addr = local_base + offsets.offsets.reshape(-1)
    keep = flat > 0
    before = np.concatenate([[0], np.cumsum(keep)])  # rows kept before each chunk
    local = np.stack([local_addr, flat, np.full(flat.size, local_device, np.int64)],
                     axis=1)[keep].astype(np.uint64)
    remote = np.stack([remote_addr, flat, np.full(flat.size, remote_device, np.int64)],
                      axis=1)[keep].astype(np.uint64)
    rows = [int(before[layers.start * n]) for layers in offsets.groups] + [int(before[-1])]
    return ReadRows(local, remote, rows)
