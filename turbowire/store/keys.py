"""Store chunk keys: a chunk is reused only after the identical prefix.

A prompt is cut into chunks of ``chunk_tokens`` tokens; chunk ``i`` is named by the chained hash
of every token up to its end (``h_i = H(h_{i-1} || tokens of chunk i)``), so two prompts share
chunk ``i`` only when their first ``(i + 1) * chunk_tokens`` tokens are equal. The hash is pure
token arithmetic: the proxy (tokens from the engine's ``/tokenize``) and the engines compute the
same names. What else must match for reuse (model, preset, wire format, chunk size, TP degree,
namespace) is the :class:`StoreScope`, which prefixes every key.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from turbowire.errors import TurboWireError

CHUNK_HASH_BYTES = 16
ROOT_HASH = hashlib.sha256(b"turbowire/store/chunk-chain/v1").digest()[:CHUNK_HASH_BYTES]
DEFAULT_CHUNK_TOKENS = 256
DEFAULT_NAMESPACE = "turbowire"

_NAME_RE = re.compile(r"^[A-Za-z0-9_.:\-]{1,64}$")


class StoreKeyError(TurboWireError, ValueError):
    """A scope field that would make keys ambiguous (separators, empty, too long)."""

    reason = "bad_params"


def _token_bytes(tokens: Sequence[int] | np.ndarray) -> bytes:
    arr = np.asarray(tokens, dtype=np.int64)
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= 1 << 32):
        raise StoreKeyError("token ids must be in 0 .. 2**32 - 1")
    return arr.astype("<u4").tobytes()


def chunk_hashes(tokens: Sequence[int] | np.ndarray, chunk_tokens: int,
                 max_chunks: int | None = None) -> list[bytes]:
    """The chained hashes of the *full* chunks of ``tokens`` (a partial tail has none)."""
    if max_chunks is not None and chunk_tokens > 0:
        tokens = tokens[: max(0, max_chunks) * chunk_tokens]
    return extend_chunk_hashes([], tokens, chunk_tokens)


def extend_chunk_hashes(hashes: list[bytes], tokens: Sequence[int] | np.ndarray,
                        chunk_tokens: int) -> list[bytes]:
    """Append to ``hashes`` (the chain of ``tokens``' first chunks) the hashes of the further
    full chunks of ``tokens``: a request's chain grows as its outputs become final."""
    if chunk_tokens <= 0:
        raise StoreKeyError(f"chunk_tokens must be positive (got {chunk_tokens})")
    start, n = len(hashes), len(tokens) // chunk_tokens
    if n <= start:
        return hashes
    data = _token_bytes(tokens[start * chunk_tokens: n * chunk_tokens])
    step = 4 * chunk_tokens
    prev = hashes[-1] if hashes else ROOT_HASH
    for i in range(n - start):
        prev = hashlib.sha256(prev + data[i * step:(i + 1) * step]).digest()[:CHUNK_HASH_BYTES]
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

    def __post_init__(self) -> None:
        _check_name("namespace", self.namespace)
        _check_name("model", self.model)
        _check_name("preset", self.preset)
        for name in ("format_version", "chunk_tokens", "tp_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise StoreKeyError(f"store {name} must be a positive integer (got {value!r})")

    @property
    def prefix(self) -> str:
        """The key prefix of this scope; every key of the deployment starts with the namespace."""
        return (
            f"{self.namespace}/{self.model}/{self.preset}/v{self.format_version}"
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
        return {
            "namespace": self.namespace, "model": self.model, "preset": self.preset,
            "format_version": self.format_version, "chunk_tokens": self.chunk_tokens,
            "tp_size": self.tp_size,
        }

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> StoreScope:
        try:
            ints = {k: data[k] for k in ("format_version", "chunk_tokens", "tp_size")}
            bad = [k for k, v in ints.items() if type(v) is not int]
            if bad:
                raise TypeError(f"{', '.join(bad)} must be integers")
            return cls(
                namespace=str(data["namespace"]), model=str(data["model"]),
                preset=str(data["preset"]), **ints,  # type: ignore[arg-type]
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise StoreKeyError(f"malformed store scope {data!r}: {exc}") from exc
