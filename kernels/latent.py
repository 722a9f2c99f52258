"""An MLA layer's paged cache and its latent chunks (gather+encode, decode+scatter).

vLLM allocates an MLA layer's cache as ``[num_blocks, block_size, kv_lora_rank + rope_dim]``
(``MLAAttentionSpec``, one row per token shared by every head; a connector is handed it as
``[num_blocks, 1, block_size, width]``, the same memory) and every backend writes token
``t``'s row at ``[block, slot]`` as ``kv_c | k_pe``: ``concat_and_cache_mla`` on CUDA, the
CPU_MLA backend's ``do_kv_cache_update`` and the AMX_MLA backend's ``amx_mla_concat_and_cache``
(vLLM's tests/kernels/test_cpu_mla_amx.py reads it back as ``flat[slot] = cat(kv_c, k_pe)``).
So one layout serves CPU and GPU caches; only bf16/fp16 caches are served (vLLM's fp8_ds_mla
packs a row differently). The codec is the reference (``turbowire.codec.latent``) on either
device: torch gather/scatter, no Triton or C kernel yet.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from turbowire.codec import Codec
from turbowire.codec.latent import decode_latent, encode_latent
from turbowire.kernels.items import DecodeItem, EncodeItem, check_range
from turbowire.kernels.paged import BlockIndexError, CacheLayoutError, block_slots


@dataclass(frozen=True)
class LatentPages:
    """Where an MLA layer keeps token rows: ``[num_blocks, block_size, latent_dim + rope_dim]``."""

    num_blocks: int
    block_size: int
    latent_dim: int
    rope_dim: int

    @classmethod
    def from_cache(cls, cache: torch.Tensor, latent_dim: int, rope_dim: int) -> LatentPages:
        shape = tuple(cache.shape)
        if cache.dim() == 4 and shape[1] == 1:  # as vLLM registers it: one "head"
            cache = cache[:, 0]
            shape = tuple(cache.shape)
        if cache.dim() != 3 or shape[2] != latent_dim + rope_dim:
            raise CacheLayoutError(
                f"an MLA cache is [num_blocks, (1,) block_size, {latent_dim} + {rope_dim}], "
                f"got {tuple(cache.shape)}")
        if cache.dtype not in (torch.bfloat16, torch.float16):
            raise CacheLayoutError(
                f"MLA caches of {cache.dtype} are not served (bf16 or fp16; run vLLM with "
                "--kv-cache-dtype auto)")
        if cache.stride(2) != 1:
            raise CacheLayoutError("an MLA cache row is not contiguous")
        return cls(shape[0], shape[1], latent_dim, rope_dim)

    @staticmethod
    def rows(cache: torch.Tensor) -> torch.Tensor:
        """The cache as ``[num_blocks, block_size, width]`` (a view)."""
        return cache[:, 0] if cache.dim() == 4 else cache

    def token_index(self, block_ids: Sequence[int] | torch.Tensor, token_start: int,
                    num_tokens: int, device: torch.device | None = None,
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        return block_slots(block_ids, token_start, num_tokens, self.num_blocks,
                           self.block_size, device)

    def gather(self, cache: torch.Tensor, block_ids: Sequence[int] | torch.Tensor,
               token_start: int, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(latent [T, L], rope [T, R]) of the tokens, contiguous."""
        blocks, slots = self.token_index(block_ids, token_start, num_tokens, cache.device)
        rows = self.rows(cache)[blocks, slots]
        return rows[:, :self.latent_dim].contiguous(), rows[:, self.latent_dim:].contiguous()

    def scatter(self, cache: torch.Tensor, block_ids: Sequence[int] | torch.Tensor,
                token_start: int, latent: torch.Tensor, rope: torch.Tensor) -> None:
        """Write the tokens' rows (only those rows change)."""
        blocks, slots = self.token_index(block_ids, token_start, latent.shape[0], cache.device)
        self.rows(cache)[blocks, slots] = torch.cat([latent, rope], dim=-1).to(cache.device,
                                                                                 cache.dtype)

    def zero_blocks(self, cache: torch.Tensor, block_ids: Sequence[int]) -> None:
        if not block_ids:
            return
        ids = torch.as_tensor(list(block_ids), dtype=torch.int64)
        if bool(((ids < 0) | (ids >= self.num_blocks)).any()):
            raise BlockIndexError(f"blocks {block_ids} outside the cache's {self.num_blocks}")
        cache[ids.to(cache.device)] = 0


def encode_latent_into(codec: Codec, layer: int, cache: torch.Tensor, pages: LatentPages,
                       items: Sequence[EncodeItem], staging: torch.Tensor) -> list[int]:
    """Each item's rows as one latent chunk at its offset; bytes written per item."""
    written = []
    for item in items:
        latent, rope = pages.gather(cache, item.block_ids, item.token_start, item.num_tokens)
        enc = encode_latent(codec, layer, latent, rope, tag=item.tag,
                            token_offset=item.token_start)
        check_range(staging, item.out_offset, enc.nbytes, "staging")
        staging[item.out_offset:item.out_offset + enc.nbytes] = enc.data.to(staging.device)
        written.append(enc.nbytes)
    return written


def decode_latent_into(codec: Codec, layer: int, cache: torch.Tensor, pages: LatentPages,
                       items: Sequence[DecodeItem], source: torch.Tensor,
                       skip_tokens: int = 0) -> None:
    """Verify every item, then write them (nothing is written if one is refused); with
    ``skip_tokens`` (one item) only its rows from there on are written."""
    decoded = []
    for item in items:
        check_range(source, item.in_offset, item.nbytes, "source")
        latent, rope = decode_latent(
            codec, layer, source[item.in_offset:item.in_offset + item.nbytes],
            pages.latent_dim, pages.rope_dim, expected_tag=item.expected_tag,
            expected_tokens=item.num_tokens, expected_offset=item.token_start)
        start = item.token_start + skip_tokens
        latent, rope = latent[skip_tokens:], rope[skip_tokens:]
        pages.token_index(item.block_ids, start, latent.shape[0])  # validate before writing
        decoded.append((item, start, latent, rope))
    for item, start, latent, rope in decoded:
        pages.scatter(cache, item.block_ids, start, latent, rope)
