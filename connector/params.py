"""``kv_transfer_params``: what the prefill engine returns and the decode engine receives.

Field names follow vLLM's NixlConnector (``do_remote_prefill``, ``remote_engine_id``,
``remote_request_id``, ``remote_host``, ``remote_port``, ``remote_block_ids``,
``remote_num_tokens``, ``tp_size``) so routers built for it (vLLM's toy proxy, llm-d,
production-stack) forward them unchanged. ``remote_block_ids`` are *staging slots* of the
prefill engine (one per KV block of the prompt), not its paged-cache blocks, which are freed as
soon as the request finishes. turbowire adds ``turbowire_*`` fields.

``turbowire_lease_token`` (transfer format 2) is the capability of the request's lease: an
unguessable token the prefill engine issues with the lease, which the decode engine presents on
every release, heartbeat and claim. Naming another request's ``remote_request_id`` without its
token releases, extends or reads nothing. Routers must forward the prefill engine's params
unchanged (they do: vLLM's toy proxy and turbowire's proxy pass the whole object through).

Everything here comes from the network (through the proxy), so parsing validates every field's
type and range and raises :class:`TransferParamsError` with a message that names the field.
"""

from __future__ import annotations

import hashlib
import math
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from turbowire.connector.geometry import blocks_for_tokens
from turbowire.errors import TurboWireError

MAX_TOKENS = 1 << 24
MAX_BLOCKS = 1 << 20
MAX_LEASE_SECONDS = 86400.0
MAX_ID_CHARS = 512  # engine and request ids, hosts, presets, hashes
DEFAULT_LEASE_SECONDS = 30.0
#: Transfer format from which prefill engines issue ``turbowire_lease_token`` (compat.py's
#: FORMAT_VERSION; older peers send none and are refused as incompatible).
LEASE_TOKEN_FORMAT = 2
LEASE_TOKEN_BYTES = 16  # 128 bits from ``secrets``: 32 hex characters
MAX_LEASE_TOKEN_CHARS = 128
_LEASE_TOKEN_RE = re.compile(r"[0-9a-f]{32,128}")


class TransferParamsError(TurboWireError, ValueError):
    """Malformed ``kv_transfer_params`` from a proxy or peer."""

    reason = "bad_params"


def prompt_digest(token_ids: Sequence[int], num_tokens: int) -> str:
    """Hash of the first ``num_tokens`` prompt token ids: the decode side checks it matches."""
    h = hashlib.blake2b(digest_size=12)
    for t in token_ids[:num_tokens]:
        h.update(int(t).to_bytes(4, "little", signed=False))
    return h.hexdigest()


def new_lease_token() -> str:
    """A fresh lease capability: 128 random bits as 32 lowercase hex characters."""
    return secrets.token_hex(LEASE_TOKEN_BYTES)


def _get(params: Mapping[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    if key not in params or params[key] is None:
        raise TransferParamsError(f"kv_transfer_params.{key} is missing")
    value = params[key]
    if isinstance(value, str) and len(value) > MAX_ID_CHARS:
        raise TransferParamsError(
            f"kv_transfer_params.{key} is {len(value)} characters long (at most {MAX_ID_CHARS})"
        )
    if isinstance(value, bool) and kind is not bool:
        raise TransferParamsError(f"kv_transfer_params.{key} must be {kind}, got a bool")
    if not isinstance(value, kind):
        raise TransferParamsError(
            f"kv_transfer_params.{key} must be {getattr(kind, '__name__', kind)}, got "
            f"{type(value).__name__}"
        )
    return value


@dataclass(frozen=True)
class RemotePrefill:
    """A decode-side view of a finished remote prefill (validated)."""

    engine_id: str
    request_id: str
    host: str
    port: int
    slots: tuple[int, ...]
    num_tokens: int
    tp_size: int
    preset: str
    format_version: int
    prompt_hash: str | None
    fallback: str | None
    lease_seconds: float = DEFAULT_LEASE_SECONDS
    # the lease's capability (format 2; None from older peers): never in a repr or a log line
    lease_token: str | None = field(default=None, repr=False)

    @classmethod
    def parse(cls, params: Mapping[str, Any], block_size: int) -> RemotePrefill:
        """Validate the prefill's ``kv_transfer_params`` (types, ranges, slot count)."""
        if not isinstance(params, Mapping):
            raise TransferParamsError("kv_transfer_params must be a JSON object")
        engine_id = _get(params, "remote_engine_id", str)
        request_id = _get(params, "remote_request_id", str)
        host = _get(params, "remote_host", str)
        port = _get(params, "remote_port", int)
        if not 1 <= port <= 65535:
            raise TransferParamsError(f"kv_transfer_params.remote_port={port} is not a TCP port")
        num_tokens = _get(params, "remote_num_tokens", int)
        if not 0 <= num_tokens <= MAX_TOKENS:
            raise TransferParamsError(
                f"kv_transfer_params.remote_num_tokens={num_tokens} out of range"
            )
        raw_slots = params.get("remote_block_ids")
        if raw_slots is None:
            raw_slots = []
        # NixlConnector (HMA) sends one list per KV cache group; accept [[...]] with one group.
        if (
            isinstance(raw_slots, (list, tuple))
            and len(raw_slots) == 1
            and isinstance(raw_slots[0], (list, tuple))
        ):
            raw_slots = raw_slots[0]
        if not isinstance(raw_slots, (list, tuple)) or len(raw_slots) > MAX_BLOCKS:
            raise TransferParamsError("kv_transfer_params.remote_block_ids must be a list of ints")
        if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in raw_slots):
            raise TransferParamsError(
                "kv_transfer_params.remote_block_ids must hold non-negative integers"
            )
        if len(set(raw_slots)) != len(raw_slots):
            raise TransferParamsError("kv_transfer_params.remote_block_ids holds duplicate slots")
        expected = blocks_for_tokens(num_tokens, block_size)
        if len(raw_slots) != expected:
            raise TransferParamsError(
                f"kv_transfer_params.remote_block_ids has {len(raw_slots)} slots but "
                f"remote_num_tokens={num_tokens} needs {expected} with block_size {block_size}"
            )
        tp_size = params.get("tp_size", 1)
        if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
            raise TransferParamsError("kv_transfer_params.tp_size must be a positive integer")
        preset = _get(params, "turbowire_preset", str)
        version = _get(params, "turbowire_format_version", int)
        prompt_hash = _optional_text(params, "turbowire_prompt_hash")
        if prompt_hash is None and num_tokens > 0 and raw_slots:
            # without it, params of another prompt would load that prompt's KV: a wrong answer
            raise TransferParamsError(
                "kv_transfer_params.turbowire_prompt_hash is missing (it ties the staged KV to "
                "the prompt; forward the prefill engine's kv_transfer_params unchanged)"
            )
        fallback = _optional_text(params, "turbowire_fallback")
        lease_seconds = _lease_seconds(params.get("turbowire_lease_seconds"))
        lease_token = _lease_token(params.get("turbowire_lease_token"))
        if lease_token is None and raw_slots and version >= LEASE_TOKEN_FORMAT:
            raise TransferParamsError(
                "kv_transfer_params.turbowire_lease_token is missing (the capability of the "
                "prefill engine's lease; forward the prefill engine's kv_transfer_params "
                "unchanged)"
            )
        return cls(
            engine_id=engine_id,
            request_id=request_id,
            host=host,
            port=port,
            slots=tuple(raw_slots),
            num_tokens=num_tokens,
            tp_size=tp_size,
            preset=preset,
            format_version=version,
            prompt_hash=prompt_hash,
            fallback=fallback,
            lease_seconds=lease_seconds,
            lease_token=lease_token,
        )


def _lease_token(value: Any) -> str | None:
    """A lease capability: 32..128 lowercase hex characters (absent: None)."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise TransferParamsError(
            f"kv_transfer_params.turbowire_lease_token must be a string, got "
            f"{type(value).__name__}"
        )
    if len(value) > MAX_LEASE_TOKEN_CHARS or not _LEASE_TOKEN_RE.fullmatch(value):
        raise TransferParamsError(
            "kv_transfer_params.turbowire_lease_token must be 32 to "
            f"{MAX_LEASE_TOKEN_CHARS} lowercase hex characters"
        )
    return value


def _optional_text(params: Mapping[str, Any], key: str) -> str | None:
    value = params.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise TransferParamsError(f"kv_transfer_params.{key} must be a string")
    if len(value) > MAX_ID_CHARS:
        raise TransferParamsError(
            f"kv_transfer_params.{key} is {len(value)} characters long (at most {MAX_ID_CHARS})"
        )
    return value


def _lease_seconds(value: Any) -> float:
    """The prefill lease the decode side heartbeats against (absent: the default)."""
    if value is None:
        return DEFAULT_LEASE_SECONDS
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TransferParamsError(
            f"kv_transfer_params.turbowire_lease_seconds must be a number, got "
            f"{type(value).__name__}"
        )
    if not math.isfinite(value) or not 0 < value <= MAX_LEASE_SECONDS:
        raise TransferParamsError(
            f"kv_transfer_params.turbowire_lease_seconds={value!r} is not in "
            f"(0, {MAX_LEASE_SECONDS:g}]"
        )
    return float(value)


def is_remote_prefill(params: Mapping[str, Any] | None) -> bool:
    """The decode side of a P/D pair: load the prompt's KV from a prefill engine."""
    return bool(params) and bool(params.get("do_remote_prefill"))


def is_remote_decode(params: Mapping[str, Any] | None) -> bool:
    """The prefill side: stage the prompt's KV for a decode engine."""
    return bool(params) and bool(params.get("do_remote_decode"))


def prefill_result(
    *,
    engine_id: str,
    request_id: str,
    host: str,
    port: int,
    slots: Sequence[int],
    num_tokens: int,
    tp_size: int,
    preset: str,
    format_version: int,
    prompt_hash: str | None,
    lease_seconds: float,
    dense_bytes: int,
    wire_bytes: int,
    fallback: str | None = None,
    lease_token: str | None = None,
) -> dict[str, Any]:
    """The ``kv_transfer_params`` a prefill engine returns for the decode engine."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": engine_id,
        "remote_request_id": request_id,
        "remote_host": host,
        "remote_port": port,
        "remote_block_ids": list(slots),
        "remote_num_tokens": num_tokens,
        "tp_size": tp_size,
        "turbowire_preset": preset,
        "turbowire_format_version": format_version,
        "turbowire_prompt_hash": prompt_hash,
        "turbowire_lease_seconds": lease_seconds,
        "turbowire_dense_bytes": dense_bytes,
        "turbowire_wire_bytes": wire_bytes,
        "turbowire_fallback": fallback,
        "turbowire_lease_token": lease_token,
    }
