"""Named presets: which stream spec K and V get in each layer.

A preset has a body policy for most layers and an optional boundary policy for the first and last
``boundary_layers`` layers (where quantization error hurts most at low bit widths). Preset ids
are part of the wire format: never renumber, only add.
"""

from __future__ import annotations

from dataclasses import dataclass

from turbowire.codec.errors import UnknownPresetError
from turbowire.codec.streams import StreamSpec

RAW = StreamSpec("raw")
FP8 = StreamSpec("fp8", bits=8)
SINK_TOKENS = 1


def lloyd_k(bits: int) -> StreamSpec:
    """Keys: chunk mean removed (outlier channels are near-constant offsets), sink kept exact."""
    return StreamSpec("lloyd", bits=bits, center=True, sink_tokens=SINK_TOKENS)


def lloyd_v(bits: int) -> StreamSpec:
    """Values: rotated Lloyd-Max per vector (beats a per-vector uniform quantizer at equal bits),
    sink kept exact (it receives most attention weight, so its value error reaches every output)."""
    return StreamSpec("lloyd", bits=bits, sink_tokens=SINK_TOKENS)


@dataclass(frozen=True)
class LayerPolicy:
    k: StreamSpec
    v: StreamSpec


@dataclass(frozen=True)
class Preset:
    name: str
    preset_id: int
    description: str
    body: LayerPolicy
    boundary: LayerPolicy | None = None
    boundary_layers: int = 0

    def policy(self, layer: int, num_layers: int) -> LayerPolicy:
        if not 0 <= layer < num_layers:
            raise IndexError(f"layer {layer} out of range for a model with {num_layers} layers")
        if self.boundary is not None and (
            layer < self.boundary_layers or layer >= num_layers - self.boundary_layers
        ):
            return self.boundary
        return self.body


_PRESETS: list[Preset] = [
    Preset("raw", 0, "bf16/fp16 passthrough in the checksummed container",
           LayerPolicy(RAW, RAW)),
    Preset("k8v4", 1, "fp8 keys with a per-vector scale, 4-bit Lloyd-Max values",
           LayerPolicy(FP8, lloyd_v(4))),
    Preset("tq4", 2, "4-bit keys (chunk mean + rotation + Lloyd-Max) and 4-bit values",
           LayerPolicy(lloyd_k(4), lloyd_v(4))),
    Preset("k4v3", 3, "4-bit keys, 3-bit values",
           LayerPolicy(lloyd_k(4), lloyd_v(3))),
    Preset("tq3", 4, "3-bit keys and values",
           LayerPolicy(lloyd_k(3), lloyd_v(3))),
    Preset("k3v2", 5, "3-bit keys, 2-bit values",
           LayerPolicy(lloyd_k(3), lloyd_v(2))),
    Preset("tq2", 6, "2-bit keys and values",
           LayerPolicy(lloyd_k(2), lloyd_v(2))),
    Preset("k5v4", 7, "5-bit keys, 4-bit values (near-lossless)",
           LayerPolicy(lloyd_k(5), lloyd_v(4))),
    # safer asymmetric: keys, whose errors go through the softmax, cross untouched
    Preset("k16v4", 8, "raw keys, 4-bit Lloyd-Max values",
           LayerPolicy(RAW, lloyd_v(4))),
    Preset("k16v3", 9, "raw keys, 3-bit Lloyd-Max values",
           LayerPolicy(RAW, lloyd_v(3))),
    Preset("k8v8", 10, "fp8 keys and values, per-vector scales (the 8-bit class)",
           LayerPolicy(FP8, FP8)),
]
_BY_NAME = {p.name: p for p in _PRESETS}
_BY_ID = {p.preset_id: p for p in _PRESETS}


def list_presets() -> list[str]:
    """Names of every preset, in id order."""
    return [p.name for p in _PRESETS]


def get_preset(name_or_id: str | int) -> Preset:
    table = _BY_ID if isinstance(name_or_id, int) else _BY_NAME
    try:
        return table[name_or_id]  # type: ignore[index]
    except KeyError:
        raise UnknownPresetError(
            f"unknown preset {name_or_id!r}; known presets: {', '.join(list_presets())}"
        ) from None
