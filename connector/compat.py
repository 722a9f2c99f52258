"""Compatibility record exchanged at the handshake: two engines may only move KV if it matches.

A mismatch is refused with a message naming the field and both values, so an operator sees
"block_size differs: prefill 32, decode 64" instead of garbage tokens.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any

from turbowire.connector.geometry import KVGeometry
from turbowire.errors import TurboWireError

if TYPE_CHECKING:
    from vllm.config import VllmConfig

FORMAT_VERSION = 1  # turbowire transfer protocol (slot layout, params); the codec has its own


class IncompatiblePeerError(TurboWireError, RuntimeError):
    """The peer engine's KV geometry, codec or parallel config differs from ours."""

    reason = "incompatible"

    def __init__(
        self,
        field_name: str,
        ours: Any,
        theirs: Any,
        *,
        sides: tuple[str, str] = ("this engine", "peer"),
        message: str | None = None,
    ) -> None:
        self.field_name = field_name
        self.ours = ours
        self.theirs = theirs
        super().__init__(
            message
            or f"incompatible peer: {field_name} differs ({sides[0]} {ours!r}, {sides[1]} "
            f"{theirs!r}); start both engines with the same {field_name}"
        )


@dataclass(frozen=True)
class CompatibilityRecord:
    """Everything that must be equal on both sides for the staged bytes to decode correctly."""

    model: str
    num_layers: int
    num_draft_layers: int
    kv_heads: tuple[int, ...]
    head_dim: int
    block_size: int
    dtype: str
    preset: str
    format_version: int
    codec_format_version: int
    tp_size: int
    speculative_config: str  # canonical JSON, "" without speculative decoding

    def mismatch(
        self, other: CompatibilityRecord, sides: tuple[str, str] = ("this engine", "peer")
    ) -> IncompatiblePeerError | None:
        """The first differing field as an error, or None when compatible."""
        for f in fields(self):
            ours, theirs = getattr(self, f.name), getattr(other, f.name)
            if ours != theirs:
                return IncompatiblePeerError(f.name, ours, theirs, sides=sides)
        return None

    def check(
        self, other: CompatibilityRecord, sides: tuple[str, str] = ("this engine", "peer")
    ) -> None:
        err = self.mismatch(other, sides)
        if err is not None:
            raise err

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["kv_heads"] = list(self.kv_heads)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CompatibilityRecord:
        names = {f.name for f in fields(cls)}
        missing = names - set(data)
        if missing:
            raise ValueError(f"compatibility record misses fields {sorted(missing)}")
        values = {k: data[k] for k in names}
        values["kv_heads"] = tuple(int(h) for h in values["kv_heads"])
        return cls(**values)

    @classmethod
    def build(
        cls,
        *,
        model: str,
        geometry: KVGeometry,
        preset: str,
        codec_format_version: int,
        tp_size: int,
        speculative_config: dict[str, Any] | None,
    ) -> CompatibilityRecord:
        return cls(
            model=model,
            num_layers=geometry.num_layers,
            num_draft_layers=geometry.num_draft_layers,
            kv_heads=tuple(layer.num_kv_heads for layer in geometry.layers),
            head_dim=geometry.head_dim,
            block_size=geometry.block_size,
            dtype=geometry.dtype,
            preset=preset,
            format_version=FORMAT_VERSION,
            codec_format_version=codec_format_version,
            tp_size=tp_size,
            speculative_config=(
                json.dumps(speculative_config, sort_keys=True) if speculative_config else ""
            ),
        )


def speculative_factors(vllm_config: VllmConfig) -> dict[str, Any] | None:
    """The speculative-decoding settings that change which layers hold KV (None without SD)."""
    spec = vllm_config.speculative_config
    if spec is None:
        return None
    method = getattr(spec, "method", None)
    if method in (None, "ngram", "suffix"):
        return None  # no draft KV: prefill and decode may differ here (vLLM does the same)
    draft = getattr(spec, "draft_model_config", None)
    return {
        "method": str(method),
        "draft_model": str(getattr(draft, "model", "")) if draft is not None else "",
        "draft_kv_cache_dtype": str(getattr(spec, "kv_cache_dtype", None) or ""),
    }


def model_identity(vllm_config: VllmConfig) -> str:
    """The model as both peers name it: the served name if given, else the model path's tail."""
    model_config = vllm_config.model_config
    served = getattr(model_config, "served_model_name", None)
    if isinstance(served, (list, tuple)):
        served = served[0] if served else None
    name = served or model_config.model
    return str(name).rstrip("/").rsplit("/", 1)[-1]
