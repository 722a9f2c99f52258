"""KV geometry of one engine and the staging-slot layout derived from it.

A staging *slot* holds one KV block of one request, for every transferred layer (draft layers
included), each layer as one self-describing encoded chunk at a fixed offset inside the slot. The
scheduler (which allocates slots) and the worker (which writes and reads them) both derive the
same layout from the same ``KVCacheConfig`` and codec, so only slot indices travel in
``kv_transfer_params``.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from turbowire.errors import TurboWireError

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

SLOT_ALIGN = 64  # bytes; keeps every chunk cache-line aligned inside the staging pool
_INT_RE = re.compile(r"\d+")


class GeometryError(TurboWireError, ValueError):
    """The model's KV cache cannot be transferred by this connector as configured."""


def layer_sort_key(name: str) -> tuple[int, str]:
    """Model order: the first integer in the layer name (``model.layers.12.self_attn.attn``)."""
    match = _INT_RE.search(name)
    return (int(match.group()) if match else 1 << 30, name)


@dataclass(frozen=True)
class LayerSpec:
    """One attention layer whose KV moves: its cache name, KV heads and head size."""

    name: str
    num_kv_heads: int
    head_dim: int
    is_draft: bool = False
    #: the KV cache group whose block table holds this layer's blocks (vLLM's hybrid KV cache
    #: manager gives sliding-window and full-attention layers separate tables)
    group: int = 0
    #: a Mamba / linear-attention layer's state bytes per request (its cache page); 0 for an
    #: attention layer. Such a layer moves raw, one state chunk per request
    #: (``turbowire.codec.state``), from the block that holds the state at the prompt's end.
    state_bytes: int = 0
    #: an MLA layer's raw RoPE key width; 0 for a K/V or state layer. Such a layer caches one
    #: row per token, ``latent_dim`` (``num_kv_heads`` vectors of ``head_dim``: the codec's
    #: vectors) then ``rope_dim``, moved as latent chunks (``turbowire.codec.latent``).
    rope_dim: int = 0

    @property
    def is_state(self) -> bool:
        return self.state_bytes > 0

    @property
    def is_latent(self) -> bool:
        return self.rope_dim > 0

    @property
    def latent_dim(self) -> int:
        return self.num_kv_heads * self.head_dim if self.is_latent else 0


@dataclass(frozen=True)
class KVGeometry:
    """What both peers must agree on to exchange blocks (checked at the handshake)."""

    layers: tuple[LayerSpec, ...]
    block_size: int
    dtype: str
    # every layer slides (a SlidingWindowSpec group): vLLM frees the blocks the window leaves,
    # so a request's block table holds NO_BLOCK there and only the blocks still held move
    frees_out_of_window: bool = False

    def __post_init__(self) -> None:
        if not self.attention_layers:
            raise GeometryError("the model has no attention layers with a KV cache to transfer")
        if self.block_size <= 0:
            raise GeometryError(f"block_size must be positive (got {self.block_size})")
        if any(layer.is_state for layer in self.layers[:self.num_attention_layers]):
            raise GeometryError("state layers come after every attention layer")
        head_dims = {layer.head_dim for layer in self.attention_layers}
        if len(head_dims) != 1:
            raise GeometryError(
                f"layers have different head sizes {sorted(head_dims)}; turbowire needs one "
                "head_dim per model"
            )

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def attention_layers(self) -> tuple[LayerSpec, ...]:
        """The layers whose K/V the codec codes (indices 0..n-1: the codec's layer index)."""
        return tuple(layer for layer in self.layers if not layer.is_state)

    @property
    def num_attention_layers(self) -> int:
        return len(self.attention_layers)

    @property
    def state_groups(self) -> frozenset[int]:
        """The KV cache groups of state layers: their tables hold one block per request, the
        one with the state at the prompt's end (``keep_state_blocks``)."""
        return frozenset(layer.group for layer in self.layers if layer.is_state)

    @property
    def num_groups(self) -> int:
        """KV cache groups, each with its own block table (1 without the hybrid manager)."""
        return max(layer.group for layer in self.layers) + 1

    @property
    def head_dim(self) -> int:
        return self.attention_layers[0].head_dim

    @property
    def num_draft_layers(self) -> int:
        return sum(layer.is_draft for layer in self.layers)

    @property
    def max_kv_heads(self) -> int:
        return max(layer.num_kv_heads for layer in self.attention_layers)

    def layer_index(self) -> dict[str, int]:
        return {layer.name: i for i, layer in enumerate(self.layers)}

    @property
    def has_latent(self) -> bool:
        """An MLA model: its attention layers cache latent rows (``LayerSpec.rope_dim``)."""
        return any(layer.is_latent for layer in self.layers)

    def dense_bytes_per_token(self, element_size: int = 2) -> int:
        """Bytes of KV per token over all layers in the engine's own dtype (K and V, or an
        MLA layer's latent row)."""
        return sum((layer.latent_dim + layer.rope_dim if layer.is_latent
                    else 2 * layer.num_kv_heads * layer.head_dim) * element_size
                   for layer in self.attention_layers)

    @classmethod
    def from_kv_cache_config(
        cls,
        kv_cache_config: KVCacheConfig,
        is_draft: Callable[[str], bool] = lambda name: False,
        mla_rope_dim: int = 0,
    ) -> KVGeometry:
        """Collect the layers of every KV cache group: attention layers in model order, then
        the state layers of a hybrid model in model order.

        Served: full attention; sliding-window layers beside full ones, either in one group
        (the hybrid KV cache manager off: vLLM promotes them to full-attention allocation, every
        block is kept, so every block moves) or in groups of their own (the manager on: each
        layer takes its blocks from its group's table, and a sliding window's freed blocks do
        not move); a model whose every layer slides (a ``SlidingWindowSpec`` group: vLLM frees
        the blocks the window leaves, ``frees_out_of_window``); Mamba / gated-delta-net layers
        beside attention (``MambaSpec`` groups: their state moves raw); MLA layers
        (``MLAAttentionSpec``, bf16/fp16: the latent coded, the ``mla_rope_dim``-wide RoPE part
        raw). Refused with the reason: speculative decoding on a hybrid or with draft KV on an
        MLA model, fp8 MLA caches and other cache kinds."""
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            MambaSpec,
            MLAAttentionSpec,
            SlidingWindowSpec,
        )

        groups = kv_cache_config.kv_cache_groups
        layers: list[LayerSpec] = []
        block_sizes: set[int] = set()
        dtypes: set[str] = set()
        frees = False
        for group_index, group in enumerate(groups):
            spec: Any = group.kv_cache_spec
            if type(spec) is MambaSpec:
                # a state is per request: its group's block size (the attention one with
                # prefix caching, else the model length) does not place it
                state_bytes = _served_state_bytes(spec, group.layer_names)
                layers.extend(LayerSpec(name=name, num_kv_heads=0, head_dim=0,
                                        is_draft=is_draft(name), group=group_index,
                                        state_bytes=state_bytes)
                              for name in group.layer_names)
                continue
            if type(spec) is MLAAttentionSpec:
                vectors, width = _served_latent(spec, group.layer_names, mla_rope_dim)
                block_sizes.add(spec.block_size)
                dtypes.add(str(spec.dtype).removeprefix("torch."))
                layers.extend(LayerSpec(name=name, num_kv_heads=vectors, head_dim=width,
                                        is_draft=is_draft(name), group=group_index,
                                        rope_dim=mla_rope_dim)
                              for name in group.layer_names)
                continue
            # exact types: subclasses (sparse MLA, sinks, R-SWA's middle gap) lay out or free
            # blocks in ways this connector does not follow
            if type(spec) not in (FullAttentionSpec, SlidingWindowSpec):
                raise GeometryError(
                    f"KV cache group of {type(spec).__name__} (layers {group.layer_names[:3]}...) "
                    "is not supported: turbowire transfers standard K/V attention caches "
                    "(full or sliding-window attention), MLA latents and Mamba / "
                    "linear-attention state"
                )
            frees = frees or type(spec) is SlidingWindowSpec
            block_sizes.add(spec.block_size)
            dtypes.add(str(spec.dtype).removeprefix("torch."))
            for name in group.layer_names:
                layers.append(
                    LayerSpec(
                        name=name,
                        num_kv_heads=spec.num_kv_heads,
                        head_dim=spec.head_size,
                        is_draft=is_draft(name),
                        group=group_index,
                    )
                )
        if not dtypes:
            raise GeometryError("the model has no attention layers with a KV cache to transfer")
        if len(block_sizes) != 1 or len(dtypes) > 1:
            raise GeometryError(
                f"KV cache groups disagree on block size {sorted(block_sizes)} or dtype "
                f"{sorted(dtypes)}; turbowire needs one of each (with the hybrid KV cache "
                "manager on, --disable-hybrid-kv-cache-manager puts every layer in one group)"
            )
        if any(layer.is_latent for layer in layers) and any(layer.is_draft for layer in layers):
            raise GeometryError(
                "speculative decoding with draft KV (MTP / EAGLE) on an MLA model is not served "
                "yet; serve it without a drafter that keeps KV, or with ngram speculation")
        layers.sort(key=lambda layer: (layer.is_state, layer_sort_key(layer.name)))
        return cls(layers=tuple(layers), block_size=block_sizes.pop(), dtype=dtypes.pop(),
                   frees_out_of_window=frees)


LATENT_VECTOR_WIDTHS = (128, 64)  # the codec's vector width for an MLA latent, first that tiles


def _served_latent(spec: Any, layer_names: list[str], rope_dim: int) -> tuple[int, int]:
    """An MLA group's latent as (vectors, width) of the codec, or why it is not served."""
    where = f"MLA layers {layer_names[:3]}..."
    if str(spec.dtype).removeprefix("torch.") not in ("bfloat16", "float16") or (
            spec.cache_dtype_str not in (None, "auto", "bfloat16", "float16")):
        raise GeometryError(f"{where}: an MLA cache of {spec.cache_dtype_str or spec.dtype} is "
                            "not served (bf16 or fp16: run vLLM with --kv-cache-dtype auto)")
    if getattr(spec, "model_version", None) or spec.alignment:
        raise GeometryError(f"{where}: this MLA variant ({spec.model_version or 'padded'}) "
                            "lays out its cache in a way turbowire does not follow")
    latent = int(spec.head_size) - rope_dim
    if rope_dim <= 0 or latent <= 0:
        raise GeometryError(f"{where}: the model config names no RoPE width "
                            "(qk_rope_head_dim) that splits the cache row of "
                            f"{spec.head_size} into latent and RoPE parts")
    for width in LATENT_VECTOR_WIDTHS:
        if latent % width == 0:
            return latent // width, width
    raise GeometryError(f"{where}: a latent of {latent} is not a multiple of "
                        f"{' or '.join(map(str, LATENT_VECTOR_WIDTHS))}")


def _served_state_bytes(spec: Any, layer_names: list[str]) -> int:
    """A Mamba / linear-attention group's state bytes per request, or why it is not served."""
    where = f"Mamba / linear-attention layers {layer_names[:3]}..."
    if getattr(spec, "num_speculative_blocks", 0):
        raise GeometryError(
            f"{where}: speculative decoding on a hybrid model is not served yet (its state "
            "keeps scratch blocks per draft); serve it without --speculative-config"
        )
    return int(spec.state_content_size_bytes)


def keep_state_blocks(tables: list[list[int]], state_groups: frozenset[int],
                      num_blocks: int, final: bool = True) -> list[list[int]]:
    """A request's group tables with each state group's table replaced by the one block that
    moves, at the position of the prompt's last block (``num_blocks - 1``): the group's last
    block, where vLLM keeps the running state (its rule, ``clip_ssm_state_blocks``: in mamba
    cache mode 'align' the block of the last computed token, in mode 'none' the request's one
    block), and only once the prompt's tokens are ``final`` (the step that finishes it). Every
    other position is ``NO_BLOCK``, so no other state block is staged, read or written."""
    from turbowire.kernels import NO_BLOCK

    if not state_groups:
        return tables
    out = []
    for group, table in enumerate(tables):
        if group in state_groups:
            kept = [NO_BLOCK] * num_blocks
            if final and num_blocks > 0 and table:
                kept[-1] = table[-1]
            table = kept
        out.append(table)
    return out


def _align(n: int, a: int = SLOT_ALIGN) -> int:
    return (n + a - 1) // a * a


ChunkSizer = Callable[[int, int, int], int]  # (layer, num_tokens, num_heads) -> encoded bytes


@dataclass(frozen=True)
class StagingLayout:
    """Byte layout of a staging pool made of equal slots (one KV block x all layers each)."""

    layer_offsets: tuple[int, ...]
    full_chunk_bytes: tuple[int, ...]
    slot_bytes: int
    num_slots: int
    block_size: int
    #: a K/V layer's chunk is staged as this many chunks of consecutive heads, back to back
    #: (``decode_tp_size``; ``tp_plan.staged_head_groups``); MLA and state layers: whole
    head_groups: int = 1

    @classmethod
    def build(cls, geometry: KVGeometry, sizer: ChunkSizer, pool_bytes: int,
              head_groups: int = 1) -> StagingLayout:
        offsets: list[int] = []
        sizes: list[int] = []
        cursor = 0
        for i, layer in enumerate(geometry.layers):
            size = int(sizer(i, geometry.block_size, layer.num_kv_heads))
            if size <= 0:
                raise GeometryError(f"codec reported {size} bytes for a block of layer {i}")
            offsets.append(cursor)
            sizes.append(size)
            cursor = _align(cursor + size)
        slot_bytes = cursor
        num_slots = pool_bytes // slot_bytes
        if num_slots < 1:
            raise GeometryError(
                f"staging pool of {pool_bytes} bytes cannot hold one slot of {slot_bytes} bytes "
                f"(one block x {geometry.num_layers} layers); raise staging_bytes/recv_bytes"
            )
        return cls(tuple(offsets), tuple(sizes), slot_bytes, num_slots, geometry.block_size,
                   head_groups)

    @property
    def pool_bytes(self) -> int:
        return self.slot_bytes * self.num_slots

    def state_note(self, geometry: KVGeometry) -> str | None:
        """What a hybrid model's state costs the pool, when it is most of every slot: each slot
        reserves room for every state layer's chunk, though only a request's last block moves
        one (None when the state takes less than half of a slot)."""
        state = sum(size for size, layer in zip(self.full_chunk_bytes, geometry.layers,
                                                strict=True) if layer.is_state)
        if 2 * state < self.slot_bytes:
            return None
        layers = sum(layer.is_state for layer in geometry.layers)
        mib = 1 << 20
        return (f"each staging slot reserves {state / mib:.1f} of its {self.slot_bytes / mib:.1f} "
                f"MiB for the state of {layers} Mamba / linear-attention layers, which moves once "
                f"per request (with its last block): the {self.pool_bytes / mib:.0f} MiB pool "
                f"holds {self.num_slots} blocks ({self.num_slots * self.block_size} tokens of "
                "prompts awaiting their decode engine); raise staging_bytes for longer prompts "
                "or more of them")

    def chunk_offset(self, slot: int, layer: int) -> int:
        """Byte offset of (slot, layer) in the pool; raises on out-of-range input from peers."""
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"staging slot {slot} out of range [0, {self.num_slots})")
        if not 0 <= layer < len(self.layer_offsets):
            raise IndexError(f"layer {layer} out of range [0, {len(self.layer_offsets)})")
        return slot * self.slot_bytes + self.layer_offsets[layer]


def block_tag(request_id: str, block_index: int) -> int:
    """32-bit tag written in every chunk header: which request and block the bytes belong to.

    The decode side passes it as ``expected_tag``; a slot reused after a lease expired (or any
    mix-up) is then refused instead of decoded into the wrong request.
    """
    return zlib.crc32(f"{request_id}\x00{block_index}".encode()) & 0x7FFFFFFF


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    return (num_tokens + block_size - 1) // block_size


def tokens_in_block(block_index: int, num_tokens: int, block_size: int) -> int:
    """Valid tokens in block ``block_index`` of a sequence of ``num_tokens`` tokens."""
    return max(0, min(block_size, num_tokens - block_index * block_size))
