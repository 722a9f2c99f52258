"""Store chunk keys: a chunk is reused only where vLLM's own prefix cache would reuse it.

A prompt is cut into chunks of ``chunk_tokens`` tokens; chunk ``i`` is named by the chained hash
of every token up to its end (``h_i = H(h_{i-1} || tokens of chunk i || extras of chunk i)``), so
two prompts share chunk ``i`` only when their first ``(i + 1) * chunk_tokens`` tokens are equal.

Token ids alone do not name KV: vLLM keys each prefix-cache block on more
(``vllm/v1/core/kv_cache_utils.py`` ``generate_block_hash_extra_keys``): the LoRA adapter (name
and path), the request's ``cache_salt``, the hash of every multimodal item whose placeholder
tokens overlap the block (its identifier and offset in the block: placeholder ids are the same
for every image of one size) and prompt-embeds hashes. :class:`ChainInputs` carries the same
inputs: salt and adapter seed the chain's root (so every chunk of the request differs), and each
multimodal item is mixed into every chunk its placeholders overlap. Prompt embeddings are not
keyable from token ids at all: such requests never use the store (:func:`chain_inputs_of` raises
:class:`UnsupportedStoreInput`). The engines (``connector/store_scheduler.py``, from vLLM's
``Request``) and the proxy (from the request body and the engine's ``/v1/models``) name chunks
with the same :func:`chunk_hashes`.

What else must match for reuse (model and weights, preset, wire format, chunk size, TP degree,
namespace) is the :class:`StoreScope`, which prefixes every key. ``CHAIN_VERSION`` is part of
every root: entries written under older key semantics are never read.
"""

from __future__ import annotations

import hashlib
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from turbowire.errors import TurboWireError

CHUNK_HASH_BYTES = 16
#: Bumped whenever what a chunk hash covers changes (v2: salt, LoRA and multimodal items).
CHAIN_VERSION = 2
_CHAIN_TAG = f"turbowire/store/chunk-chain/v{CHAIN_VERSION}".encode()
#: The root of a request without salt, adapter or multimodal items.
ROOT_HASH = hashlib.sha256(_CHAIN_TAG).digest()[:CHUNK_HASH_BYTES]
DEFAULT_NAMESPACE = "turbowire"

_NAME_RE = re.compile(r"^[A-Za-z0-9_.:\-]{1,64}$")
_WEIGHTS_RE = re.compile(r"^[0-9a-f]{0,32}$")
#: Bounds of the key inputs (vLLM caps cache_salt at 128 characters; the rest are generous).
MAX_SALT_CHARS = 1024
MAX_LORA_FIELD_CHARS = 4096
MAX_MM_IDENTIFIER_CHARS = 1024
MAX_MM_ITEMS = 1 << 16


class StoreKeyError(TurboWireError, ValueError):
    """A scope field that would make keys ambiguous (separators, empty, too long)."""

    reason = "bad_params"


def _token_bytes(tokens: Sequence[int] | np.ndarray) -> bytes:
    arr = np.asarray(tokens, dtype=np.int64)
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= 1 << 32):
        raise StoreKeyError("token ids must be in 0 .. 2**32 - 1")
    return arr.astype("<u4").tobytes()


class UnsupportedStoreInput(StoreKeyError):
    """A request whose KV depends on inputs a chunk key cannot carry (prompt embeddings): it
    neither looks the store up nor saves to it."""

    reason = "store_unsupported_input"


@dataclass(frozen=True)
class MMSpan:
    """One multimodal item: vLLM's ``MultiModalFeatureSpec.identifier`` and the placeholder
    range it fills in the prompt (``mm_position.offset``/``length``)."""

    identifier: str
    offset: int
    length: int

    def __post_init__(self) -> None:
        if not isinstance(self.identifier, str) or not 0 < len(self.identifier) \
                <= MAX_MM_IDENTIFIER_CHARS:
            raise StoreKeyError("a multimodal identifier must be a non-empty string of at most "
                                f"{MAX_MM_IDENTIFIER_CHARS} characters")
        for name in ("offset", "length"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 32:
                raise StoreKeyError(f"multimodal {name} must be an int in 0 .. 2**32 - 1")


def _field(tag: bytes, value: str | None) -> bytes:
    """An unambiguous encoding of an optional string (absent and empty differ)."""
    if value is None:
        return tag + b"\x00"
    data = value.encode("utf-8", "surrogatepass")
    return tag + b"\x01" + struct.pack("<I", len(data)) + data


@dataclass(frozen=True)
class ChainInputs:
    """What besides the token ids a chunk's KV depends on, as vLLM's prefix cache keys it.

    ``cache_salt`` and the LoRA adapter (``lora_name`` and ``lora_path``, vLLM's
    ``_gen_lora_extra_hash_keys``; ``lora_int_id`` is a per-engine counter, never a key) seed the
    root; ``mm`` are the request's multimodal items. An empty salt is no salt (vLLM mixes only a
    non-empty one)."""

    cache_salt: str | None = None
    lora_name: str | None = None
    lora_path: str | None = None
    mm: tuple[MMSpan, ...] = ()

    def __post_init__(self) -> None:
        if self.cache_salt == "":
            object.__setattr__(self, "cache_salt", None)
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str)
                                            or len(self.cache_salt) > MAX_SALT_CHARS):
            raise StoreKeyError(f"cache_salt must be a string of at most {MAX_SALT_CHARS} "
                                "characters")
        for name in ("lora_name", "lora_path"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str)
                                      or len(value) > MAX_LORA_FIELD_CHARS):
                raise StoreKeyError(f"{name} must be a string of at most "
                                    f"{MAX_LORA_FIELD_CHARS} characters")
        if self.lora_path is not None and self.lora_name is None:
            raise StoreKeyError("a LoRA path without a LoRA name")
        if not isinstance(self.mm, tuple) or len(self.mm) > MAX_MM_ITEMS \
                or not all(isinstance(m, MMSpan) for m in self.mm):
            raise StoreKeyError(f"mm must be a tuple of at most {MAX_MM_ITEMS} MMSpan")
        object.__setattr__(self, "mm", tuple(sorted(
            self.mm, key=lambda m: (m.offset, m.length, m.identifier))))

    def root(self) -> bytes:
        """The chain's root: the version tag, the salt and the adapter."""
        if self.cache_salt is None and self.lora_name is None:
            return ROOT_HASH
        data = (_CHAIN_TAG + _field(b"salt", self.cache_salt)
                + _field(b"lora", self.lora_name) + _field(b"path", self.lora_path))
        return hashlib.sha256(data).digest()[:CHUNK_HASH_BYTES]

    def chunk_extra(self, start: int, end: int) -> bytes:
        """The multimodal items overlapping tokens ``[start, end)``, each with its offset
        relative to ``start`` (as vLLM keys a block), encoded; empty when there are none."""
        items = [m for m in self.mm if m.offset < end and m.offset + m.length > start]
        if not items:
            return b""
        out = [b"\x00mm", struct.pack("<I", len(items))]
        for m in items:
            ident = m.identifier.encode("utf-8", "surrogatepass")
            out.append(struct.pack("<IqI", len(ident), m.offset - start, m.length) + ident)
        return b"".join(out)


NO_INPUTS = ChainInputs()


def chain_inputs_of(request: Any) -> ChainInputs:
    """The key inputs of a vLLM ``Request`` (``vllm/v1/request.py``): its ``cache_salt``,
    ``lora_request`` (``lora_name``, ``lora_path``) and ``mm_features`` (``identifier``,
    ``mm_position.offset``/``length``). Raises :class:`UnsupportedStoreInput` for prompt
    embeddings (vLLM keys them by a hash of the embedding tensors, which token ids cannot name)
    and :class:`StoreKeyError` for anything malformed. Read by attribute, so this module needs
    no vLLM."""
    if getattr(request, "prompt_embeds", None) is not None:
        raise UnsupportedStoreInput("the prompt has prompt embeddings")
    if getattr(request, "prompt_token_ids", None) is None:
        raise UnsupportedStoreInput("the prompt has no token ids")
    lora = getattr(request, "lora_request", None)
    lora_name = lora_path = None
    if lora:
        lora_name = getattr(lora, "lora_name", None)
        lora_path = getattr(lora, "lora_path", None)
        if not isinstance(lora_name, str) or not isinstance(lora_path, str):
            raise UnsupportedStoreInput("a LoRA request without a name and path")
    spans = []
    for feature in getattr(request, "mm_features", None) or ():
        identifier = getattr(feature, "identifier", None)
        pos = getattr(feature, "mm_position", None)
        if identifier is None or pos is None:
            raise UnsupportedStoreInput("a multimodal item without an identifier or position")
        spans.append(MMSpan(identifier, getattr(pos, "offset", None),
                            getattr(pos, "length", None)))
    return ChainInputs(getattr(request, "cache_salt", None), lora_name, lora_path, tuple(spans))


def chunk_hashes(tokens: Sequence[int] | np.ndarray, chunk_tokens: int,
                 max_chunks: int | None = None,
                 inputs: ChainInputs = NO_INPUTS) -> list[bytes]:
    """The chained hashes of the *full* chunks of ``tokens`` (a partial tail has none), under
    ``inputs`` (salt, adapter, multimodal items)."""
    if max_chunks is not None and chunk_tokens > 0:
        tokens = tokens[: max(0, max_chunks) * chunk_tokens]
    return extend_chunk_hashes([], tokens, chunk_tokens, inputs)


def extend_chunk_hashes(hashes: list[bytes], tokens: Sequence[int] | np.ndarray,
                        chunk_tokens: int, inputs: ChainInputs = NO_INPUTS) -> list[bytes]:
    """Append to ``hashes`` (the chain of ``tokens``' first chunks, under the same ``inputs``)
    the hashes of the further full chunks of ``tokens``: a request's chain grows as its outputs
    become final."""
    if chunk_tokens <= 0:
        raise StoreKeyError(f"chunk_tokens must be positive (got {chunk_tokens})")
    start, n = len(hashes), len(tokens) // chunk_tokens
    if n <= start:
        return hashes
    data = _token_bytes(tokens[start * chunk_tokens: n * chunk_tokens])
    step = 4 * chunk_tokens
    prev = hashes[-1] if hashes else inputs.root()
    for i in range(n - start):
        first = (start + i) * chunk_tokens
        extra = inputs.chunk_extra(first, first + chunk_tokens) if inputs.mm else b""
        prev = hashlib.sha256(prev + data[i * step:(i + 1) * step] + extra).digest()[
            :CHUNK_HASH_BYTES]
        hashes.append(prev)
    return hashes


def chunk_tag(chunk_hash: bytes) -> int:
    """The codec chunk tag of every layer chunk of a stored chunk (the kernels refuse a chunk
    whose tag differs: a blob of another prefix is never decoded)."""
    tag = int.from_bytes(chunk_hash[:8], "little") & ((1 << 63) - 1)
    return tag or 1


def _check_name(field: str, value: str) -> str:
    if not isinstance(value, str) or not _NAME_RE.match(value):
        raise StoreKeyError(
            f"store {field}={value!r} must be 1-64 characters of letters, digits and _.:-"
        )
    return value


def model_slug(model: str) -> str:
    """A model identity usable inside keys (``/`` and other separators become ``_``)."""
    slug = re.sub(r"[^A-Za-z0-9_.:\-]", "_", model.strip())[-64:]
    return slug or "model"


@dataclass(frozen=True)
class StoreScope:
    """Everything besides the prefix that must match for a stored chunk to be reused."""

    namespace: str
    model: str  # a model_slug
    preset: str
    format_version: int
    chunk_tokens: int
    tp_size: int
    #: A fingerprint of the model's weights (``turbowire.store.fingerprint``): engines serving
    #: other weights under the same name never share chunks. "" = not known (no segment).
    weights: str = ""

    def __post_init__(self) -> None:
        _check_name("namespace", self.namespace)
        _check_name("model", self.model)
        _check_name("preset", self.preset)
        if not isinstance(self.weights, str) or not _WEIGHTS_RE.match(self.weights):
            raise StoreKeyError(f"store weights={self.weights!r} must be 0-32 lowercase hex "
                                "characters")
        for name in ("format_version", "chunk_tokens", "tp_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise StoreKeyError(f"store {name} must be a positive integer (got {value!r})")

    @property
    def prefix(self) -> str:
        """The key prefix of this scope; every key of the deployment starts with the namespace."""
        model = f"{self.model}.w{self.weights}" if self.weights else self.model
        return (
            f"{self.namespace}/{model}/{self.preset}/v{self.format_version}"
            f"/c{self.chunk_tokens}/tp{self.tp_size}"
        )

    def chunk_key(self, chunk_hash: bytes, rank: int = 0) -> str:
        """The name of rank ``rank``'s bytes of one chunk."""
        if len(chunk_hash) != CHUNK_HASH_BYTES:
            raise StoreKeyError(
                f"a chunk hash has {CHUNK_HASH_BYTES} bytes (got {len(chunk_hash)})"
            )
        if not 0 <= rank < self.tp_size:
            raise StoreKeyError(f"rank {rank} is outside tp_size {self.tp_size}")
        return f"{self.prefix}/{chunk_hash.hex()}/r{rank}"

    def to_dict(self) -> dict[str, object]:
        out: dict[str, object] = {
            "namespace": self.namespace, "model": self.model, "preset": self.preset,
            "format_version": self.format_version, "chunk_tokens": self.chunk_tokens,
            "tp_size": self.tp_size,
        }
        if self.weights:
            out["weights"] = self.weights
        return out

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> StoreScope:
        try:
            ints = {k: data[k] for k in ("format_version", "chunk_tokens", "tp_size")}
            bad = [k for k, v in ints.items() if type(v) is not int]
            if bad:
                raise TypeError(f"{', '.join(bad)} must be integers")
            weights = data.get("weights", "")
            if not isinstance(weights, str):
                raise TypeError("weights must be a string")
            return cls(
                namespace=str(data["namespace"]), model=str(data["model"]),
                preset=str(data["preset"]), weights=weights, **ints,  # type: ignore[arg-type]
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise StoreKeyError(f"malformed store scope {str(data)[:200]}: {exc}") from exc
