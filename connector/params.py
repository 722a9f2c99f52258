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

``turbowire_params_mac`` authenticates the params: HMAC-SHA256 under a key derived from the
engines' shared ``auth_token`` (:func:`params_mac_key`) of the canonical encoding of every field
the decode engine acts on (:data:`MAC_FIELDS`, :func:`canonical_params`). A decode engine with an
``auth_token`` refuses params without a valid MAC before it dials or resolves anything, so a
client that reaches its HTTP port cannot point it at a host of its choosing (the bearer token
would go there) or at another prompt's lease. The canonical encoding is JSON of exactly the
:data:`MAC_FIELDS`, keys sorted, no spaces, ASCII only, values as the decode engine reads them
(``remote_block_ids`` one flat list of ints, ``tp_size`` 1 when absent,
``turbowire_lease_seconds`` a float, 30.0 when absent; absent optional strings ``null``).

Everything here comes from the network (through the proxy), so parsing validates every field's
type and range and raises :class:`TransferParamsError` with a message that names the field.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from turbowire.connector.config import (
    DEFAULT_LEASE_SECONDS,
    MAX_LEASE_SECONDS,
    MAX_LEASE_TOKEN_CHARS,
    MAX_TP_SIZE,
)
from turbowire.connector.geometry import blocks_for_tokens
from turbowire.connector.peers import is_valid_host
from turbowire.errors import TurboWireError

MAX_TOKENS = 1 << 24
MAX_BLOCKS = 1 << 20
MAX_ID_CHARS = 512  # engine and request ids, hosts, presets, hashes
#: Transfer format from which prefill engines issue ``turbowire_lease_token`` (compat.py's
#: FORMAT_VERSION; older peers send none and are refused as incompatible).
LEASE_TOKEN_FORMAT = 2
LEASE_TOKEN_BYTES = 16  # 128 bits from ``secrets``: 32 hex characters
_LEASE_TOKEN_RE = re.compile(r"[0-9a-f]{32,128}")
#: The params' MAC field (HMAC-SHA256, 64 lowercase hex characters).
PARAMS_MAC_FIELD = "turbowire_params_mac"
#: Label of the MAC key derivation: K = HMAC-SHA256(auth_token, PARAMS_MAC_CONTEXT).
PARAMS_MAC_CONTEXT = b"turbowire/params-mac/v1"
_PARAMS_MAC_RE = re.compile(r"[0-9a-f]{64}")
#: Every field the decode engine acts on, in the names of the params: all of them are MACed.
MAC_FIELDS: tuple[str, ...] = (
    "remote_engine_id",
    "remote_request_id",
    "remote_host",
    "remote_port",
    "remote_block_ids",
    "remote_num_tokens",
    "tp_size",
    "turbowire_preset",
    "turbowire_format_version",
    "turbowire_prompt_hash",
    "turbowire_lease_seconds",
    "turbowire_lease_token",
    "turbowire_fallback",
)


class TransferParamsError(TurboWireError, ValueError):
    """Malformed ``kv_transfer_params`` from a proxy or peer."""

    reason = "bad_params"


class UnauthenticatedParamsError(TransferParamsError):
    """Params without a valid ``turbowire_params_mac`` on a decode engine with an ``auth_token``:
    altered, forged, or signed by an engine without (or with another) token. Refused before
    anything is dialed or resolved."""

    reason = "unauthenticated_params"


class PeerNotAllowedError(TransferParamsError):
    """Params naming a prefill engine outside the decode engine's ``prefill_peers``."""

    reason = "peer_not_allowed"


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
    # HMAC of the fields above by the prefill engine (None: unsigned params)
    params_mac: str | None = field(default=None, repr=False)

    @classmethod
    def parse(cls, params: Mapping[str, Any], block_size: int) -> RemotePrefill:
        """Validate the prefill's ``kv_transfer_params`` (types, ranges, slot count)."""
        if not isinstance(params, Mapping):
            raise TransferParamsError("kv_transfer_params must be a JSON object")
        engine_id = _get(params, "remote_engine_id", str)
        request_id = _get(params, "remote_request_id", str)
        host = _get(params, "remote_host", str)
        if not is_valid_host(host):
            raise TransferParamsError(
                "kv_transfer_params.remote_host must be a host name or an IP address (no scheme, "
                "port, path or spaces)"
            )
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
        if not isinstance(tp_size, int) or isinstance(tp_size, bool) or \
                not 1 <= tp_size <= MAX_TP_SIZE:
            raise TransferParamsError(
                f"kv_transfer_params.tp_size must be an integer in 1..{MAX_TP_SIZE}")
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
            params_mac=_params_mac(params.get(PARAMS_MAC_FIELD)),
        )

    def mac_fields(self) -> dict[str, Any]:
        """The :data:`MAC_FIELDS` as this engine read them (the MAC's input)."""
        return mac_fields(
            engine_id=self.engine_id, request_id=self.request_id, host=self.host,
            port=self.port, slots=self.slots, num_tokens=self.num_tokens, tp_size=self.tp_size,
            preset=self.preset, format_version=self.format_version, prompt_hash=self.prompt_hash,
            lease_seconds=self.lease_seconds, lease_token=self.lease_token,
            fallback=self.fallback,
        )

    def verify_mac(self, key: bytes) -> None:
        """Raise :class:`UnauthenticatedParamsError` unless ``turbowire_params_mac`` is the MAC
        of these params under ``key`` (constant-time compare; nothing else is touched)."""
        if self.params_mac is None:
            raise UnauthenticatedParamsError(
                f"kv_transfer_params carry no {PARAMS_MAC_FIELD}: this decode engine has an "
                "auth_token and loads only params its prefill engines signed (give the prefill "
                "engine the same auth_token; forward its kv_transfer_params unchanged)"
            )
        want = params_mac(key, self.mac_fields())
        if not hmac.compare_digest(want.encode("ascii"), self.params_mac.encode("ascii")):
            raise UnauthenticatedParamsError(
                f"kv_transfer_params.{PARAMS_MAC_FIELD} does not match the params: they were "
                "altered after the prefill engine signed them (or signed with another "
                "auth_token); nothing is dialed"
            )


def _params_mac(value: Any) -> str | None:
    """A params MAC: exactly 64 lowercase hex characters (absent: None)."""
    if value is None:
        return None
    if not isinstance(value, str) or not _PARAMS_MAC_RE.fullmatch(value):
        raise TransferParamsError(
            f"kv_transfer_params.{PARAMS_MAC_FIELD} must be 64 lowercase hex characters"
        )
    return value


def mac_fields(
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
    lease_token: str | None,
    fallback: str | None,
) -> dict[str, Any]:
    """The MAC's input in its canonical types (both engines build it with this function)."""
    return {
        "remote_engine_id": str(engine_id),
        "remote_request_id": str(request_id),
        "remote_host": str(host),
        "remote_port": int(port),
        "remote_block_ids": [int(s) for s in slots],
        "remote_num_tokens": int(num_tokens),
        "tp_size": int(tp_size),
        "turbowire_preset": str(preset),
        "turbowire_format_version": int(format_version),
        "turbowire_prompt_hash": None if prompt_hash is None else str(prompt_hash),
        "turbowire_lease_seconds": float(lease_seconds),
        "turbowire_lease_token": lease_token or None,
        "turbowire_fallback": None if fallback is None else str(fallback),
    }


def canonical_params(fields: Mapping[str, Any]) -> bytes:
    """The bytes the MAC covers: JSON of exactly :data:`MAC_FIELDS` (all required), keys sorted,
    no spaces, ASCII (non-ASCII escaped), no NaN/Infinity."""
    missing = [k for k in MAC_FIELDS if k not in fields]
    if missing:
        raise ValueError(f"canonical params lack {missing}")
    return json.dumps(
        {k: fields[k] for k in MAC_FIELDS}, sort_keys=True, separators=(",", ":"),
        ensure_ascii=True, allow_nan=False,
    ).encode("ascii")


def params_mac_key(auth_token: str) -> bytes:
    """K = HMAC-SHA256(auth_token, "turbowire/params-mac/v1"): the params MAC's key, never the
    bearer token itself (a MAC then reveals nothing usable on the side channel)."""
    return hmac.new(auth_token.encode("utf-8"), PARAMS_MAC_CONTEXT, hashlib.sha256).digest()


def params_mac(key: bytes, fields: Mapping[str, Any]) -> str:
    """HMAC-SHA256(key, canonical_params(fields)) as 64 lowercase hex characters."""
    return hmac.new(key, canonical_params(fields), hashlib.sha256).hexdigest()


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


def is_remote_prefill(params: Any) -> bool:
    """The decode side of a P/D pair: load the prompt's KV from a prefill engine (anything but
    a mapping is no P/D request: ``vllm_xargs`` can smuggle a string in)."""
    return isinstance(params, Mapping) and bool(params.get("do_remote_prefill"))


def is_remote_decode(params: Any) -> bool:
    """The prefill side: stage the prompt's KV for a decode engine."""
    return isinstance(params, Mapping) and bool(params.get("do_remote_decode"))


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
    mac_key: bytes | None = None,
) -> dict[str, Any]:
    """The ``kv_transfer_params`` a prefill engine returns for the decode engine, signed
    (``turbowire_params_mac``) when ``mac_key`` is given (the engine has an ``auth_token``)."""
    mac = None
    if mac_key is not None:
        mac = params_mac(mac_key, mac_fields(
            engine_id=engine_id, request_id=request_id, host=host, port=port, slots=slots,
            num_tokens=num_tokens, tp_size=tp_size, preset=preset,
            format_version=format_version, prompt_hash=prompt_hash,
            lease_seconds=lease_seconds, lease_token=lease_token, fallback=fallback,
        ))
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
        PARAMS_MAC_FIELD: mac,
    }
