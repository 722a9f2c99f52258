"""vLLM paged KV cache layouts and token-level gather/scatter (the CPU reference path).

A layer's cache as vLLM allocates it is presented as two logical views K and V of shape
[num_blocks, block_size, H, D] (strided views, no copies), whatever the physical layout:
- CPU (CPU_ATTN): one tensor [num_blocks, H, block_size, 2*D], K|V packed in the last dim (LBHNC).
- GPU backends: [2, num_blocks, block_size, H, D] (LBNHC) or a permuted view of it whose memory is
  [2, num_blocks, H, block_size, D] (LBHNC); FlashInfer's [num_blocks, 2, block_size, H, D].
Token t of a request lives in block ``block_ids[t // block_size]`` at slot ``t % block_size``.
A block list may hold ``NO_BLOCK`` where the request holds no block (vLLM's null block for the
tokens a sliding window left): such entries are never read or written, and a token range that
falls in one is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

import torch

from turbowire.errors import TurboWireError

CacheKind = Literal["cpu_packed", "kv_first", "block_first"]
NO_BLOCK = -1  # a block-list entry the request does not hold (never addressed)


class BlockIndexError(TurboWireError, IndexError):
    """A block id or token range (possibly sent by a peer) falls outside the cache or request."""

    reason = "bounds"


class CacheLayoutError(TurboWireError, ValueError):
    """The tensor does not look like a vLLM paged KV cache this code understands."""


@dataclass(frozen=True)
class PagedKVLayout:
    kind: CacheKind
    num_blocks: int
    block_size: int
    num_heads: int
    head_dim: int
    physical: str  # "LBHNC" or "LBNHC": the memory order of one block

    @classmethod
    def from_cache(
        cls, kv_cache: torch.Tensor, kv_layout: str | None = None, head_dim: int | None = None
    ) -> "PagedKVLayout":
        """Recognise a cache tensor. ``kv_layout``/``head_dim`` settle ambiguous shapes."""
        shape = tuple(kv_cache.shape)
        if kv_cache.dim() == 4:
            nb, heads, bs, packed = shape
            if packed % 2 or (head_dim is not None and packed != 2 * head_dim):
                raise CacheLayoutError(
                    f"4-D cache {shape}: last dim must be 2*head_dim (K|V packed)"
                )
            return cls("cpu_packed", nb, bs, heads, packed // 2, "LBHNC")
        if kv_cache.dim() != 5:
            raise CacheLayoutError(f"a paged KV cache is 4-D (CPU) or 5-D (GPU), got shape {shape}")
        if shape[0] == 2:
            kind: CacheKind = "kv_first"
            _, nb, bs, heads, dim = shape
        elif shape[1] == 2:
            kind = "block_first"
            nb, _, bs, heads, dim = shape
        else:
            raise CacheLayoutError(f"5-D cache {shape} has no K/V axis of size 2 at dim 0 or 1")
        if head_dim is not None and dim != head_dim:
            raise CacheLayoutError(f"cache head_dim {dim} != expected {head_dim}")
        layout = cls(kind, nb, bs, heads, dim, "LBNHC")
        k, _ = layout.views(kv_cache)
        physical = "LBHNC" if k.stride(2) > k.stride(1) else "LBNHC"
        if kv_layout is not None and kv_layout != physical:
            raise CacheLayoutError(f"cache memory is {physical}, caller said {kv_layout}")
        return cls(kind, nb, bs, heads, dim, physical)

    def views(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V as [num_blocks, block_size, H, D] views of the cache (writes go through)."""
        if self.kind == "cpu_packed":
            d = self.head_dim
            return kv_cache[..., :d].permute(0, 2, 1, 3), kv_cache[..., d:].permute(0, 2, 1, 3)
        if self.kind == "kv_first":
            return kv_cache[0], kv_cache[1]
        return kv_cache[:, 0], kv_cache[:, 1]

    def zero_blocks(self, kv_cache: torch.Tensor, block_ids: Sequence[int]) -> None:
        """Zero every K/V element of these blocks (every slot, head and dim, whatever the
        placement inside a block). Why: vLLM zeroes a hybrid model's freshly allocated blocks
        (another group may have left state bytes there, NaN once read as K/V) but not the
        blocks a connector loads, so the slots past a partial block's loaded tokens are the
        connector's to clear."""
        if not block_ids:
            return
        ids = torch.as_tensor(list(block_ids), dtype=torch.int64)
        if bool(((ids < 0) | (ids >= self.num_blocks)).any()):
            raise BlockIndexError(f"blocks {block_ids} outside the cache's {self.num_blocks}")
        ids = ids.to(kv_cache.device)
        bits = kv_cache.view(torch.uint8) if kv_cache.element_size() == 1 else kv_cache  # fp8
        if self.kind == "kv_first":
            bits[:, ids] = 0
        else:  # block-first: CPU caches, GPU [num_blocks, 2, ...]
            bits[ids] = 0

    def token_index(
        self, block_ids: Sequence[int] | torch.Tensor, token_start: int, num_tokens: int,
        device: torch.device | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(block, slot) index tensors of tokens [token_start, token_start + num_tokens).

        Everything is bounds-checked: ids may come from a remote peer.
        """
        return block_slots(block_ids, token_start, num_tokens, self.num_blocks,
                           self.block_size, device)

    def gather(
        self, kv_cache: torch.Tensor, block_ids: Sequence[int] | torch.Tensor, token_start: int,
        num_tokens: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the tokens as contiguous [T, H, D] tensors."""
        blocks, slots = self.token_index(block_ids, token_start, num_tokens, kv_cache.device)
        k, v = self.views(kv_cache)
        return k[blocks, slots].contiguous(), v[blocks, slots].contiguous()

    def scatter(
        self, kv_cache: torch.Tensor, block_ids: Sequence[int] | torch.Tensor, token_start: int,
        k: torch.Tensor, v: torch.Tensor,
    ) -> None:
        """Write [T, H, D] K and V into the tokens' slots (only those slots change)."""
        blocks, slots = self.token_index(block_ids, token_start, k.shape[0], kv_cache.device)
        if k.shape[1:] != (self.num_heads, self.head_dim) or v.shape != k.shape:
            raise CacheLayoutError(
                f"scatter of {tuple(k.shape)}/{tuple(v.shape)} into a cache of "
                f"{self.num_heads} heads x {self.head_dim}"
            )
        kc, vc = self.views(kv_cache)
        kc[blocks, slots] = k.to(kv_cache.dtype)
        vc[blocks, slots] = v.to(kv_cache.dtype)


def block_slots(
    block_ids: Sequence[int] | torch.Tensor, token_start: int, num_tokens: int, num_blocks: int,
    block_size: int, device: torch.device | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(block, slot) index tensors of tokens [token_start, token_start + num_tokens) of a
    request whose blocks are ``block_ids`` in a cache of ``num_blocks`` blocks; every id and
    the range are bounds-checked (they may come from a remote peer)."""
    ids = torch.as_tensor(block_ids, dtype=torch.int64).reshape(-1).cpu()
    if num_tokens <= 0 or token_start < 0:
        raise BlockIndexError(f"bad token range start={token_start} count={num_tokens}")
    last = token_start + num_tokens - 1
    if last // block_size >= ids.numel():
        raise BlockIndexError(
            f"tokens up to {last} need {last // block_size + 1} blocks, "
            f"{ids.numel()} block ids given"
        )
    held = ids[ids != NO_BLOCK]
    if held.numel() and (int(held.min()) < 0 or int(held.max()) >= num_blocks):
        raise BlockIndexError(
            f"block ids must be in 0..{num_blocks - 1}, "
            f"got {int(held.min())}..{int(held.max())}"
        )
    if torch.unique(held).numel() != held.numel():
        raise BlockIndexError("repeated block ids in one request")
    t = torch.arange(token_start, token_start + num_tokens)
    blocks = ids[t // block_size]
    if bool((blocks == NO_BLOCK).any()):
        raise BlockIndexError(
            f"tokens {token_start}..{last} fall in a block the request does not hold"
        )
    slots = t % block_size
    if device is not None:
        blocks, slots = blocks.to(device), slots.to(device)
    return blocks, slots
