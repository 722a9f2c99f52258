"""The ``turbowire`` serde of LMCache's multi-process (MP) storage: KV compressed for L2.

LMCache's MP server (``lmcache server``) keeps KV chunks in L1 (CPU memory) and writes them to L2
adapters (``fs``, ``resp``, ``s3``, ...). An adapter may name a *serde* that turns each dense chunk
into bytes on store and back on load. This module registers turbowire's codec as one, named
``turbowire``: every layer of a chunk is encoded with a turbowire preset (``tq4`` stores about a
quarter of the dense bytes) and checked on load (container and per-chunk checksums), so a damaged
object is refused (a cache miss), never decoded into wrong KV.

Enabling it (LMCache 0.5.6)
---------------------------
1. Register the serde in the process that runs LMCache's storage manager. Either start the
   server through this module, which registers and then runs ``lmcache`` with the same
   arguments::

       python -m turbowire.integrations.lmcache_serde server --l1-size-gb 20 \\
           --eviction-policy LRU \\
           --l2-adapter '{"type": "fs", "base_path": "/kvcache",
                          "serde": {"type": "turbowire", "preset": "tq4", "head_dim": 128}}'

   or ``import turbowire.integrations.lmcache_serde`` wherever your own code runs in that process
   before the adapters are built: in your startup code, or at the top of a ``"type": "plugin"``
   L2 adapter module (LMCache imports that module while creating the adapter, then looks up the
   adapter's serde, so the plugin adapter itself and every later adapter can use ``turbowire``).
2. Name it in the adapter's JSON:
   ``"serde": {"type": "turbowire", "preset": ..., "head_dim": ...}``.

Serde options (everything in the ``"serde"`` object except ``"type"``):

- ``head_dim`` (int, required): the model's head size (a multiple of 8 up to 1024); the number
  of KV heads is the chunk's hidden size divided by it. A wrong value is not always detectable,
  so there is no default.
- ``preset`` (str, default ``"tq4"``): a turbowire preset (``turbowire presets`` lists them;
  ``raw`` keeps the bytes exact).
- ``max_workers`` (int, default 1): threads serializing/deserializing in parallel.
- ``bind_key`` (bool, default true): stamp each object with a tag derived from its LMCache key
  and refuse, on load, an object whose tag is another key's (a misplaced or renamed file).

What it stores
--------------
The objects are LMCache's dense K/V chunks, ``[2, L, T, hidden]`` (``KV_2LTD``) in bf16 or fp16,
one object group per object. Other layouts (MLA's ``[L, T, hidden]``, several kernel groups in
one object, fp32) are refused with :class:`SerdeConfigError`. Each object becomes a container::

    off  size  field (little-endian)
    0    4     magic b"TWLC"
    4    1     container version (1)
    5    1     KV dtype (1 = bfloat16, 2 = float16, the codec's codes)
    6    2     preset id
    8    2     layers L
    10   2     KV heads H
    12   2     head_dim D
    14   2     flags (bit 0: the tag is bound to the key)
    16   4     tokens T
    20   4     token offset the chunks were encoded at (0)
    24   8     payload bytes (sum of the layer chunks)
    32   8     tag (0 when not bound to the key)
    40   4     checksum: wsum32 of bytes 0..(48 + 4 L) with this field zeroed
    44   4     reserved, 0
    48   4 L   size of each layer's chunk (u32)
    ...        zero padding to a multiple of 16
               the L turbowire chunks (codec/FORMAT.md), layer 0 first
               zero padding up to the estimated size (none today: the estimate is exact)

``estimate_serialized_size`` is an exact function of the layout (the codec's ``encoded_nbytes``),
and ``serialize`` always emits exactly that many bytes: LMCache's MP loads read an object into a
buffer of the estimated size, so an object of any other size is never a hit.

An LMCache chunk does not know where it sits in its sequence, so every chunk is encoded as a
sequence start (token offset 0): the first token of each chunk is kept exact (the attention sink
of the real first chunk among them): 1.5-2 % more bytes for the 3- and 4-bit presets at 256
tokens per chunk.

What LMCache does with a refused object
---------------------------------------
``AsyncSerdeProcessor`` logs the exception and fails the deserialize task, and the serde wrapper
then reports every key of that load batch as not loaded (its failure policy is all-or-nothing per
batch); the prefetch counts them as misses and the engine recomputes. The object stays in L2 and
is refused again on the next lookup.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import struct
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.serde import (
    AsyncSerdeProcessor,
    Deserializer,
    SerdeProcessor,
    Serializer,
    get_registered_serde_types,
    register_serde_factory,
)
from lmcache.v1.memory_management import MemoryObj

from turbowire.codec import MAX_HEAD_DIM, Codec, Preset, check_head_dim, get_preset
from turbowire.codec.errors import CodecError
from turbowire.codec.wire import CODE_DTYPES, DTYPE_CODES, align_up, wsum32
from turbowire.errors import TurboWireError

logger = logging.getLogger(__name__)

SERDE_NAME = "turbowire"
MAGIC = b"TWLC"
CONTAINER_VERSION = 1
HEADER_BYTES = 48
FLAG_KEY_BOUND = 1
TOKEN_OFFSET = 0  # every LMCache chunk is encoded as a sequence start (module doc)
_HEADER = struct.Struct("<4sBBHHHHHIIQQII")
_CHECKSUM_AT = 40
assert _HEADER.size == HEADER_BYTES

_KWARGS = {"preset", "head_dim", "max_workers", "bind_key"}
_MAX_U16 = (1 << 16) - 1
_MAX_TOKENS = 1 << 16


class SerdeConfigError(TurboWireError, ValueError):
    """The serde's options, or the KV layout LMCache hands it, are not something it can code."""

    reason = "bad_params"


class SerdeFormatError(TurboWireError, ValueError):
    """The bytes are not a turbowire LMCache container (magic, version, sizes, padding)."""

    reason = "format"


class SerdeTruncatedError(SerdeFormatError):
    """The buffer is shorter than the container the layout calls for."""


class SerdeChecksumError(SerdeFormatError):
    """The container header or size table does not match its checksum (corrupted at rest)."""

    reason = "checksum"


class SerdeMismatchError(SerdeFormatError):
    """A valid container, but not the one expected here (preset, geometry, dtype or key)."""

    reason = "incompatible"


@dataclass(frozen=True)
class KVGeometry:
    """What one LMCache KV object holds: ``[2, layers, tokens, heads * head_dim]`` of ``dtype``."""

    layers: int
    tokens: int
    heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return torch.Size([2, self.layers, self.tokens, self.heads * self.head_dim])


@dataclass(frozen=True)
class SerdeOptions:
    preset: Preset
    head_dim: int
    max_workers: int = 1
    bind_key: bool = True

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, object]) -> SerdeOptions:
        """Parse the adapter JSON's ``"serde"`` object (without ``"type"``)."""
        unknown = sorted(set(kwargs) - _KWARGS)
        if unknown:
            raise SerdeConfigError(
                f"unknown turbowire serde option(s) {', '.join(unknown)}; "
                f"known: {', '.join(sorted(_KWARGS))}"
            )
        if "head_dim" not in kwargs:
            raise SerdeConfigError(
                "the turbowire serde needs \"head_dim\" (the model's head size: a multiple "
                f"of 8 up to {MAX_HEAD_DIM})"
            )
        head_dim = _int_option(kwargs, "head_dim")
        preset_name = kwargs.get("preset", "tq4")
        if not isinstance(preset_name, str):
            raise SerdeConfigError(f"preset must be a preset name, got {preset_name!r}")
        try:
            check_head_dim(head_dim)
            preset = get_preset(preset_name)
        except CodecError as exc:
            raise SerdeConfigError(str(exc)) from None
        max_workers = _int_option(kwargs, "max_workers", 1)
        if max_workers < 1:
            raise SerdeConfigError(f"max_workers must be at least 1, got {max_workers}")
        bind_key = kwargs.get("bind_key", True)
        if not isinstance(bind_key, bool):
            raise SerdeConfigError(f"bind_key must be true or false, got {bind_key!r}")
        return cls(preset, head_dim, max_workers, bind_key)


def _int_option(kwargs: Mapping[str, object], name: str, default: int | None = None) -> int:
    value = kwargs.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise SerdeConfigError(f"{name} must be an integer, got {value!r}")
    return value


def key_tag(key: ObjectKey) -> int:
    """A non-zero 64-bit tag naming ``key`` (every field of it), stamped into the object."""
    h = hashlib.blake2b(digest_size=8, person=b"turbowire-lmc")
    h.update(bytes(key.chunk_hash))
    for part in (key.model_name, str(key.kv_rank), str(key.object_group_id), key.cache_salt):
        h.update(b"\x00" + part.encode())
    return int.from_bytes(h.digest(), "little") or 1


class _Layout:
    """Everything about a container that follows from the KV geometry and the options."""

    def __init__(self, geometry: KVGeometry, codec: Codec) -> None:
        self.geometry = geometry
        g = geometry
        self.chunk_sizes = [
            codec.encoded_nbytes(layer, g.tokens, g.heads, TOKEN_OFFSET)
            for layer in range(g.layers)
        ]
        self.prefix_bytes = HEADER_BYTES + 4 * g.layers
        self.chunks_at = align_up(self.prefix_bytes)
        self.payload_bytes = sum(self.chunk_sizes)
        self.nbytes = self.chunks_at + self.payload_bytes


class _TurboWireCodecs:
    """The options plus a codec per model depth, shared by the serializer and the deserializer."""

    def __init__(self, options: SerdeOptions) -> None:
        self.options = options

    @functools.lru_cache(maxsize=64)
    def codec(self, layers: int) -> Codec:
        return Codec(self.options.preset, self.options.head_dim, layers)

    @functools.lru_cache(maxsize=256)
    def layout(self, geometry: KVGeometry) -> _Layout:
        return _Layout(geometry, self.codec(geometry.layers))

    def geometry(self, shapes: Sequence[torch.Size], dtypes: Sequence[torch.dtype]) -> KVGeometry:
        """The KV geometry of an object's layout; refuses what the codec cannot code."""
        if len(shapes) != 1 or len(dtypes) != 1:
            raise SerdeConfigError(
                f"the turbowire serde codes objects of one K/V group, got {len(shapes)} groups"
            )
        shape, dtype = tuple(int(d) for d in shapes[0]), dtypes[0]
        if len(shape) != 4 or shape[0] != 2:
            raise SerdeConfigError(
                "the turbowire serde codes K/V objects [2, layers, tokens, hidden] (KV_2LTD); "
                f"got {list(shape)} (MLA and fused K/V layouts are not supported)"
            )
        _, layers, tokens, hidden = shape
        head_dim = self.options.head_dim
        if dtype not in DTYPE_CODES:
            raise SerdeConfigError(f"KV dtype {dtype} is not supported (bfloat16 or float16)")
        if hidden % head_dim:
            raise SerdeConfigError(
                f"hidden size {hidden} is not a multiple of head_dim {head_dim}: check the "
                "serde's head_dim"
            )
        heads = hidden // head_dim
        if not (0 < layers <= _MAX_U16 and 0 < tokens <= _MAX_TOKENS and 0 < heads <= _MAX_U16):
            raise SerdeConfigError(
                f"layout {list(shape)} is outside what the codec codes (1..{_MAX_U16} layers, "
                f"1..{_MAX_TOKENS} tokens, 1..{_MAX_U16} heads)"
            )
        return KVGeometry(layers, tokens, heads, head_dim, dtype)

    def tag(self, key: ObjectKey) -> int:
        return key_tag(key) if self.options.bind_key else 0


def _flat_bytes(obj: MemoryObj, role: str) -> torch.Tensor:
    tensor = obj.tensor
    if tensor is None:
        raise SerdeConfigError(f"the {role} memory object has no tensor (invalid or a byte buffer)")
    if tensor.dtype != torch.uint8:
        raise SerdeConfigError(f"the {role} byte buffer must be uint8, got {tensor.dtype}")
    return tensor.reshape(-1)


def _pack_prefix(geometry: KVGeometry, preset_id: int, layout: _Layout, tag: int) -> bytes:
    g = geometry
    flags = FLAG_KEY_BOUND if tag else 0
    head = _HEADER.pack(
        MAGIC, CONTAINER_VERSION, DTYPE_CODES[g.dtype], preset_id, g.layers, g.heads,
        g.head_dim, flags, g.tokens, TOKEN_OFFSET, layout.payload_bytes, tag, 0, 0,
    )
    prefix = bytearray(head + struct.pack(f"<{g.layers}I", *layout.chunk_sizes))
    check = wsum32(torch.frombuffer(prefix, dtype=torch.uint8))
    struct.pack_into("<I", prefix, _CHECKSUM_AT, check)
    return bytes(prefix)


class TurboWireSerializer(Serializer):
    """Encodes each layer of a dense K/V chunk with the turbowire codec into one container."""

    def __init__(self, codecs: _TurboWireCodecs) -> None:
        self._codecs = codecs

    def estimate_serialized_size(self, layout_desc: MemoryLayoutDesc) -> int:
        """Exactly the number of bytes ``serialize`` writes for objects of this layout."""
        geometry = self._codecs.geometry(layout_desc.shapes, layout_desc.dtypes)
        return self._codecs.layout(geometry).nbytes

    def serialize(self, src: MemoryObj, dst: MemoryObj, key: ObjectKey) -> int:
        codecs = self._codecs
        geometry = codecs.geometry(src.get_shapes(), src.get_dtypes())
        layout = codecs.layout(geometry)
        kv = src.tensor
        if kv is None or kv.shape != geometry.shape or kv.dtype != geometry.dtype:
            raise SerdeConfigError(
                f"source tensor {None if kv is None else (list(kv.shape), kv.dtype)} does not "
                f"match its layout {list(geometry.shape)} {geometry.dtype}"
            )
        out = _flat_bytes(dst, "destination")
        if out.numel() < layout.nbytes:
            raise SerdeConfigError(
                f"destination buffer has {out.numel()} bytes, the container needs {layout.nbytes}"
            )
        codec = codecs.codec(geometry.layers)
        tag = codecs.tag(key)
        g = geometry
        offset = layout.chunks_at
        for layer in range(g.layers):
            k = kv[0, layer].view(g.tokens, g.heads, g.head_dim)
            v = kv[1, layer].view(g.tokens, g.heads, g.head_dim)
            chunk = codec.encode(layer, k, v, tag=tag, token_offset=TOKEN_OFFSET)
            if chunk.nbytes != layout.chunk_sizes[layer]:
                raise TurboWireError(  # a codec bug: encoded_nbytes must be exact
                    f"layer {layer} encoded to {chunk.nbytes} bytes, encoded_nbytes said "
                    f"{layout.chunk_sizes[layer]}"
                )
            out[offset : offset + chunk.nbytes].copy_(chunk.data.to(out.device))
            offset += chunk.nbytes
        assert offset == layout.nbytes, (offset, layout.nbytes)
        prefix = _pack_prefix(g, codecs.options.preset.preset_id, layout, tag)
        out[: len(prefix)].copy_(torch.frombuffer(bytearray(prefix), dtype=torch.uint8))
        out[len(prefix) : layout.chunks_at].zero_()
        return layout.nbytes


class TurboWireDeserializer(Deserializer):
    """Checks a container and decodes its layers into LMCache's dense K/V object."""

    def __init__(self, codecs: _TurboWireCodecs) -> None:
        self._codecs = codecs

    def deserialize(self, src: MemoryObj, dst: MemoryObj, key: ObjectKey) -> None:
        codecs = self._codecs
        geometry = codecs.geometry(dst.get_shapes(), dst.get_dtypes())
        layout = codecs.layout(geometry)
        out = dst.tensor
        if out is None or out.shape != geometry.shape or out.dtype != geometry.dtype:
            raise SerdeConfigError("destination tensor does not match its layout")
        data = _flat_bytes(src, "source")
        if data.numel() < layout.nbytes:
            raise SerdeTruncatedError(
                f"object has {data.numel()} bytes, a {geometry} container has {layout.nbytes}"
            )
        tag = codecs.tag(key)
        self._check_prefix(data, geometry, layout, tag)
        if (
            data[layout.prefix_bytes : layout.chunks_at].any()
            or data[layout.nbytes : data.numel()].any()
        ):
            raise SerdeFormatError("non-zero bytes in the container's padding")
        codec = codecs.codec(geometry.layers)
        g = geometry
        want = (g.tokens, g.heads, g.head_dim)
        decoded: list[tuple[torch.Tensor, torch.Tensor]] = []
        offset = layout.chunks_at
        for layer, size in enumerate(layout.chunk_sizes):
            k, v = codec.decode(
                layer, data[offset : offset + size], expected_tag=tag,
                expected_tokens=g.tokens, expected_offset=TOKEN_OFFSET,
            )
            if tuple(k.shape) != want or k.dtype != g.dtype:
                raise SerdeMismatchError(
                    f"layer {layer} decoded to {list(k.shape)} {k.dtype}, expected "
                    f"{list(want)} {g.dtype}"
                )
            decoded.append((k, v))
            offset += size
        # Written only once every layer verified: a refused object leaves ``dst`` untouched.
        for layer, (k, v) in enumerate(decoded):
            out[0, layer].view(want).copy_(k)
            out[1, layer].view(want).copy_(v)

    def _check_prefix(
        self, data: torch.Tensor, g: KVGeometry, layout: _Layout, tag: int
    ) -> None:
        prefix = bytearray(data[: layout.prefix_bytes].cpu().numpy().tobytes())
        (magic, version, dtype_code, preset_id, layers, heads, head_dim, flags, tokens,
         token_offset, payload, stored_tag, check, reserved) = _HEADER.unpack_from(prefix)
        if magic != MAGIC:
            raise SerdeFormatError(
                f"not a turbowire LMCache object (magic {bytes(magic)!r}, expected {MAGIC!r})"
            )
        if version != CONTAINER_VERSION:
            raise SerdeFormatError(
                f"container version {version}; this build reads version {CONTAINER_VERSION}"
            )
        struct.pack_into("<I", prefix, _CHECKSUM_AT, 0)
        actual = wsum32(torch.frombuffer(prefix, dtype=torch.uint8))
        if actual != check:
            raise SerdeChecksumError(
                f"container checksum {check:#010x} != computed {actual:#010x}"
            )
        if reserved or flags & ~FLAG_KEY_BOUND or bool(flags & FLAG_KEY_BOUND) != bool(stored_tag):
            raise SerdeFormatError(f"flags {flags:#x} / reserved field not what version 1 defines")
        problems = []
        preset = self._codecs.options.preset
        if preset_id != preset.preset_id:
            try:
                other = get_preset(preset_id).name
            except CodecError:
                other = f"id {preset_id}"
            problems.append(f"preset {other} (serde uses {preset.name})")
        stored_dtype = CODE_DTYPES.get(dtype_code, f"code {dtype_code}")
        if stored_dtype != g.dtype:
            problems.append(f"dtype {stored_dtype} (expected {g.dtype})")
        stored = (layers, tokens, heads, head_dim)
        if stored != (g.layers, g.tokens, g.heads, g.head_dim):
            problems.append(
                f"{layers} layers x {tokens} tokens x {heads} heads x {head_dim} (expected "
                f"{g.layers} x {g.tokens} x {g.heads} x {g.head_dim})"
            )
        if token_offset != TOKEN_OFFSET:
            problems.append(f"token offset {token_offset} (expected {TOKEN_OFFSET})")
        if stored_tag != tag:
            problems.append(
                "tag of another key" if tag and stored_tag else
                f"key binding {'on' if stored_tag else 'off'} (serde has bind_key="
                f"{'true' if tag else 'false'})"
            )
        if problems:
            raise SerdeMismatchError("object refused: " + "; ".join(problems))
        sizes = list(struct.unpack_from(f"<{g.layers}I", prefix, HEADER_BYTES))
        if sizes != layout.chunk_sizes or payload != layout.payload_bytes:
            raise SerdeFormatError(
                f"layer chunk sizes / payload {payload} disagree with the geometry "
                f"({layout.payload_bytes})"
            )


def create_serde(kwargs: Mapping[str, object]) -> SerdeProcessor:
    """LMCache serde factory: ``kwargs`` is the adapter's ``"serde"`` object minus ``"type"``."""
    options = SerdeOptions.from_kwargs(kwargs)
    codecs = _TurboWireCodecs(options)
    logger.info(
        "turbowire LMCache serde: preset %s, head_dim %d, max_workers %d, bind_key %s",
        options.preset.name, options.head_dim, options.max_workers, options.bind_key,
    )
    return AsyncSerdeProcessor(
        TurboWireSerializer(codecs), TurboWireDeserializer(codecs),
        max_workers=options.max_workers,
    )


_register_lock = threading.Lock()


def register() -> bool:
    """Register ``create_serde`` as LMCache serde ``turbowire``; False if the name was taken."""
    with _register_lock:
        if SERDE_NAME in get_registered_serde_types():
            logger.debug("LMCache serde %r is already registered", SERDE_NAME)
            return False
        register_serde_factory(SERDE_NAME, create_serde)
        logger.debug("registered LMCache serde %r", SERDE_NAME)
        return True


def main(argv: Sequence[str] | None = None) -> None:
    """Run the ``lmcache`` command line (e.g. ``server ...``) with the serde registered."""
    register()
    from lmcache.cli.main import main as lmcache_main

    lmcache_main(list(sys.argv[1:] if argv is None else argv))


register()

if __name__ == "__main__":
    main()
