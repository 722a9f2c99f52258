"""A fingerprint of a model's weights, computed once when an engine starts.

Why: the store scope and the compatibility record named a model by its served name and dtype
only, so a rolling update to new weights (or a fine-tune served under the base model's name)
kept exchanging KV with engines of the old weights, and the store kept serving KV the old
weights computed. The fingerprint goes into the store scope (``StoreScope.weights``), so chunks
of other weights are other keys, and into the compatibility record, so peers with other weights
refuse the handshake.

What it covers, cheaply enough to run at every start (a few hundred KiB read, whatever the model
size): ``config.json`` and the safetensors index (parsed, keys sorted), every weight file's name
and size, its first :data:`HEAD_BYTES` (a safetensors file's header: every tensor's name, dtype,
shape and offsets) and :data:`SAMPLES_PER_FILE` windows of :data:`SAMPLE_BYTES` spread evenly over
the file (a fine-tune of the same architecture changes these bytes with overwhelming probability,
even where names and sizes are equal), plus the runtime settings that change what the weights
compute (quantization, ``hf_overrides``, load format). Paths are not covered: the same files
mounted elsewhere give the same fingerprint. A model whose files cannot be found (a hub id not in
the local cache) is fingerprinted by its id and revision only, and that is logged.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

FINGERPRINT_VERSION = 1
FINGERPRINT_HEX_CHARS = 16
HEAD_BYTES = 64 << 10
SAMPLE_BYTES = 4 << 10
SAMPLES_PER_FILE = 64
MAX_WEIGHT_FILES = 4096
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
CONFIG_FILES = ("config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json",
                "params.json")


def _canonical_json(path: Path) -> bytes:
    """The file's JSON with sorted keys (formatting does not change the fingerprint); the raw
    bytes when it is not JSON."""
    raw = path.read_bytes()
    try:
        return json.dumps(json.loads(raw), sort_keys=True, separators=(",", ":")).encode()
    except (ValueError, RecursionError):
        return raw


def _sample_file(h: Any, path: Path) -> None:
    """Name, size, head and evenly spread windows of one weight file."""
    size = path.stat().st_size
    h.update(f"file:{path.name}:{size}\n".encode())
    with open(path, "rb") as f:
        h.update(f.read(min(size, HEAD_BYTES)))
        last = size - SAMPLE_BYTES  # the last window's offset
        if last <= HEAD_BYTES:
            h.update(f.read())
            return
        for i in range(SAMPLES_PER_FILE):
            f.seek(HEAD_BYTES + (last - HEAD_BYTES) * i // (SAMPLES_PER_FILE - 1))
            h.update(f.read(SAMPLE_BYTES))


def _model_files(model_dir: Path) -> tuple[list[Path], list[Path]]:
    configs = [model_dir / name for name in CONFIG_FILES if (model_dir / name).is_file()]
    weights = sorted(p for p in model_dir.iterdir()
                     if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))[:MAX_WEIGHT_FILES]
    return configs, weights


def resolve_model_dir(model: str, revision: str | None = None) -> Path | None:
    """The local folder (or single file) of ``model``: the path itself, or the snapshot of a hub
    id in the local Hugging Face cache (never downloads)."""
    path = Path(model)
    if path.exists():
        return path
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(model, "config.json", revision=revision)
    except Exception as exc:  # noqa: BLE001 - not a hub id, or no hub library: no folder
        logger.debug("model %s is not in the local hub cache: %s", model, exc)
        return None
    return Path(found).parent if isinstance(found, str) else None


def weights_fingerprint(model: str, *, revision: str | None = None,
                        settings: dict[str, Any] | None = None) -> str:
    """The fingerprint (16 hex characters) of ``model`` (a folder, a file or a hub id) under
    ``settings`` (JSON-able runtime settings that change what the weights compute)."""
    return _fingerprint(model, revision,
                        json.dumps(settings or {}, sort_keys=True, default=_stable_repr))


def _stable_repr(value: Any) -> str:
    """A repr that is equal across processes (a function's default repr holds its address)."""
    if callable(value):
        return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', '?')}"
    return type(value).__name__


@functools.lru_cache(maxsize=16)
def _fingerprint(model: str, revision: str | None, settings_json: str) -> str:
    h = hashlib.sha256(f"turbowire/weights/v{FINGERPRINT_VERSION}\n".encode())
    h.update(f"settings:{settings_json}\n".encode())
    where = resolve_model_dir(model, revision)
    try:
        if where is not None and where.is_file():
            _sample_file(h, where)
        elif where is not None:
            configs, weights = _model_files(where)
            for path in configs:
                h.update(f"config:{path.name}\n".encode())
                h.update(_canonical_json(path))
            for path in weights:
                _sample_file(h, path)
            if not weights:
                logger.warning("model %s: no weight files found in %s; its fingerprint covers "
                               "the configuration only", model, where)
        else:
            logger.warning("model %s: files not found locally; its fingerprint covers the name "
                           "and revision only (engines must serve identical weights under it)",
                           model)
            h.update(f"id:{model}@{revision}\n".encode())
    except OSError as exc:
        logger.warning("model %s: reading its files for the weights fingerprint failed (%s); "
                       "the fingerprint covers the name and revision only", model, exc)
        h = hashlib.sha256(f"turbowire/weights/v{FINGERPRINT_VERSION}/unread\n".encode())
        h.update(f"settings:{settings_json}\nid:{model}@{revision}\n".encode())
    return h.hexdigest()[:FINGERPRINT_HEX_CHARS]


def vllm_config_fingerprint(vllm_config: Any) -> str:
    """The fingerprint of the model a vLLM engine serves (``VllmConfig``, read by attribute:
    no vLLM import): ``model_config.model`` and ``.revision``, with ``.quantization``,
    ``.hf_overrides`` and ``load_config.load_format`` as settings. The connector's store scope
    and compatibility record both use this value."""
    model_config = getattr(vllm_config, "model_config", None)
    load = getattr(getattr(vllm_config, "load_config", None), "load_format", None)
    settings = {
        "quantization": getattr(model_config, "quantization", None),
        "hf_overrides": getattr(model_config, "hf_overrides", None),
        "load_format": str(load) if load is not None else None,
    }
    model = str(getattr(model_config, "model", "") or "")
    return weights_fingerprint(model, revision=getattr(model_config, "revision", None),
                               settings=settings)


__all__ = ["vllm_config_fingerprint", "resolve_model_dir", "weights_fingerprint"]
