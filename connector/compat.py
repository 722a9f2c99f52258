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

#: turbowire transfer protocol (slot layout, params, side-channel lease calls); the codec has its
#: own. 2: leases carry a capability (``turbowire_lease_token``) that releases and heartbeats must
#: present; engines of different versions refuse each other at the handshake and in the params.
FORMAT_VERSION = 2


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
    #: the served weights' fingerprint (turbowire.store.fingerprint): one served name over other
    #: weights (a rolling update, a fine-tune under the base's name) must not exchange KV
    weights: str = ""
    #: the model's KV heads per layer over all TP ranks (``tp_plan.model_kv_heads``; 0: a layer
    #: no other TP size reads); engines of different TP sizes compare these instead of
    #: ``kv_heads``. Empty from older engines: equal TP only.
    model_kv_heads: tuple[int, ...] = ()
    #: an MLA model's raw RoPE width per cache row (0: no latent layers); 0 from older engines,
    #: which refused MLA models
    rope_dim: int = 0

    def mismatch(
        self, other: CompatibilityRecord, sides: tuple[str, str] = ("this engine", "peer")
    ) -> IncompatiblePeerError | None:
        """The first differing field as an error, or None when compatible (the speculative
        config first: a drafter on one side also changes the layer counts). Engines of other
        TP sizes compare the model's heads, not one rank's (``tp_plan.tp_refusal``)."""
        from turbowire.connector.tp_plan import tp_refusal

        names = sorted((f.name for f in fields(self)), key=lambda n: n != "speculative_config")
        skip = {"model_kv_heads"} if not (self.model_kv_heads and other.model_kv_heads) else set()
        if self.tp_size != other.tp_size:
            why = tp_refusal(self, other)
            if why is not None:
                return IncompatiblePeerError(
                    "tp_size", self.tp_size, other.tp_size, sides=sides,
                    message=f"incompatible peer: tp_size differs ({sides[0]} {self.tp_size}, "
                    f"{sides[1]} {other.tp_size}) and {why}")
            skip |= {"tp_size", "kv_heads"}
        for name in names:
            if name in skip:
                continue
            ours, theirs = getattr(self, name), getattr(other, name)
            if ours != theirs:
                if name == "speculative_config":
                    return _speculative_mismatch(ours, theirs, sides)
                return IncompatiblePeerError(name, ours, theirs, sides=sides)
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
        data["model_kv_heads"] = list(self.model_kv_heads)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CompatibilityRecord:
        names = {f.name for f in fields(cls)}
        missing = names - set(data) - {"weights", "model_kv_heads", "rope_dim"}  # older engines
        if missing:
            raise ValueError(f"compatibility record misses fields {sorted(missing)}")
        values = {k: data[k] for k in names if k in data}
        values["kv_heads"] = tuple(int(h) for h in values["kv_heads"])
        values["model_kv_heads"] = tuple(int(h) for h in values.get("model_kv_heads", ()))
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
        weights: str = "",
        model_kv_heads: tuple[int, ...] = (),
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
            weights=weights,
            model_kv_heads=tuple(model_kv_heads),
            rope_dim=max((layer.rope_dim for layer in geometry.layers), default=0),
        )


def speculative_factors(vllm_config: VllmConfig) -> dict[str, Any] | None:
    """The speculative settings both peers must share (None: no draft KV, e.g. ngram/suffix).

    The same factors vLLM's NixlConnector hashes for hidden-state-based drafts (EAGLE family,
    MTP, draft models): their attention layers are entries of ``kv_caches`` and move with the
    target's, so the drafter, its weights and its KV dtype must match on both sides.
    """
    spec = vllm_config.speculative_config
    if spec is None or not has_draft_kv(spec):
        return None  # ngram, suffix, medusa: no draft KV; prefill and decode may differ here
    draft = spec.draft_model_config
    aux = getattr(getattr(draft, "hf_config", None), "eagle_aux_hidden_state_layer_ids", None)
    return {
        "method": str(spec.method),
        "model": str(getattr(draft, "model", "")) if draft is not None else "",
        "revision": str(getattr(draft, "revision", None) or ""),
        "code_revision": str(getattr(draft, "code_revision", None) or ""),
        "parallel_drafting": bool(getattr(spec, "parallel_drafting", False)),
        "num_speculative_tokens": int(spec.num_speculative_tokens or 0)
        if spec.use_multi_module_mtp() else 0,  # multi-module MTP: K sets the prefill backoff
        "kv_cache_dtype": str(spec.kv_cache_dtype or vllm_config.cache_config.cache_dtype),
        "auxiliary_layer_ids": [int(i) for i in aux] if aux is not None else None,
    }


def has_draft_kv(spec: Any) -> bool:
    check = getattr(spec, "uses_draft_kv_cache", None)
    if callable(check):
        return bool(check())
    return getattr(spec, "method", None) not in (None, "ngram", "suffix", "medusa")


def _json_object(text: str) -> dict[str, Any] | None:
    """A record's speculative config: {} when empty, None when it is not a JSON object."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def _speculative_mismatch(ours: str, theirs: str, sides: tuple[str, str]) -> IncompatiblePeerError:
    """Name the speculative setting that differs (``speculative_config.method``, ...)."""
    mine, peer = _json_object(ours), _json_object(theirs)
    if mine is None or peer is None:
        return IncompatiblePeerError(
            "speculative_config", ours[:80] or "none", theirs[:80] or "none", sides=sides,
            message="incompatible peer: speculative_config differs and one side's is not a JSON "
            "object (a peer of another turbowire version?)",
        )
    if not mine or not peer:
        def runs(record: dict[str, Any]) -> str:
            return f"runs {record.get('method', '?')!r} with draft KV" if record else "has none"

        return IncompatiblePeerError(
            "speculative_config", ours or "none", theirs or "none", sides=sides,
            message=(
                f"incompatible peer: speculative_config differs ({sides[0]} {runs(mine)}, "
                f"{sides[1]} {runs(peer)}); a drafter's KV moves with the target's, so start "
                "both engines with the same model-based --speculative-config"
            ),
        )
    for key in sorted(set(mine) | set(peer)):
        if mine.get(key) != peer.get(key):
            return IncompatiblePeerError(
                f"speculative_config.{key}", mine.get(key), peer.get(key), sides=sides
            )
    return IncompatiblePeerError("speculative_config", ours, theirs, sides=sides)


def model_identity(vllm_config: VllmConfig) -> str:
    """The model as both peers name it: the served name if given, else the model path's tail."""
    model_config = vllm_config.model_config
    served = getattr(model_config, "served_model_name", None)
    if isinstance(served, (list, tuple)):
        served = served[0] if served else None
    name = served or model_config.model
    return str(name).rstrip("/").rsplit("/", 1)[-1]
