"""The connector's configuration: ``kv_connector_extra_config`` keys, validated at start.

Every key is documented in README.md ("Connector configuration"). Validation happens once, when
vLLM builds the connector, and each error says which key is wrong and what to put there, so a
mistyped config stops the engine at start instead of failing the first transfer.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

AUTH_TOKEN_ENV = "TURBOWIRE_AUTH_TOKEN"
LOAD_FAILURE_POLICIES = ("fail", "recompute")
DEFAULT_PRESET = "tq4"
DEFAULT_STAGING_BYTES = 256 << 20
DEFAULT_SIDE_CHANNEL_PORT = 5700
DEFAULT_DECODE_PIPELINE_GROUPS = 8
MAX_DECODE_PIPELINE_GROUPS = 256
DEFAULT_NIXL_PROGRESS_DELAY_US = 100
MIN_LEASE_SECONDS = 1.0

KNOWN_KEYS = frozenset(
    {
        "preset",
        "staging_bytes",
        "recv_bytes",
        "lease_seconds",
        "side_channel_host",
        "side_channel_bind",
        "side_channel_port",
        "nixl_backends",
        "nixl_backend_params",
        "auth_token",
        "auth_token_env",
        "load_failure_policy",
        "handshake_timeout_seconds",
        "transfer_timeout_seconds",
        "min_transfer_tokens",
        "decode_pipeline_groups",
        "nixl_progress_delay_us",
    }
)


class ConnectorConfigError(ValueError):
    """A ``kv_connector_extra_config`` value is missing or invalid."""


def _parse_size(key: str, value: Any) -> int:
    """Accept ints or strings such as "256MiB", "1GiB", "64M"."""
    if isinstance(value, bool):
        raise ConnectorConfigError(f"{key} must be a byte count such as 268435456 or '256MiB'")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        text = value.strip().lower().replace(" ", "")
        units = {
            "gib": 1 << 30, "gb": 10**9, "g": 1 << 30,
            "mib": 1 << 20, "mb": 10**6, "m": 1 << 20,
            "kib": 1 << 10, "kb": 10**3, "k": 1 << 10,
            "b": 1,
        }
        for suffix, mult in units.items():
            if text.endswith(suffix):
                number = text[: -len(suffix)]
                try:
                    return int(float(number) * mult)
                except ValueError:
                    break
        if text.isdigit():
            return int(text)
    raise ConnectorConfigError(
        f"{key}={value!r} is not a byte count: use an integer (268435456) or a string "
        "with a unit ('256MiB', '1GiB')"
    )


def _parse_float(key: str, value: Any, minimum: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ConnectorConfigError(f"{key} must be a number of seconds (got {value!r})")
    try:
        number = float(value)
    except ValueError as exc:
        raise ConnectorConfigError(f"{key} must be a number of seconds (got {value!r})") from exc
    if number < minimum:
        raise ConnectorConfigError(f"{key}={number} is too small: use at least {minimum}")
    return number


def _parse_int(key: str, value: Any, minimum: int, maximum: int) -> int:
    if isinstance(value, bool):
        raise ConnectorConfigError(f"{key} must be an integer (got {value!r})")
    try:
        number = int(value)
    except (TypeError, ValueError) as exc:
        raise ConnectorConfigError(f"{key} must be an integer (got {value!r})") from exc
    if not minimum <= number <= maximum:
        raise ConnectorConfigError(f"{key}={number} is out of range: use {minimum}..{maximum}")
    return number


def default_advertise_host() -> str:
    """The address peers should use when none is configured: loopback (one-machine setups)."""
    return "127.0.0.1"


@dataclass(frozen=True)
class TurboWireConfig:
    """Validated connector settings (see README "Connector configuration")."""

    preset: str = DEFAULT_PRESET
    staging_bytes: int = DEFAULT_STAGING_BYTES
    recv_bytes: int = DEFAULT_STAGING_BYTES
    lease_seconds: float = 30.0
    side_channel_host: str = field(default_factory=default_advertise_host)
    side_channel_bind: str = "0.0.0.0"
    side_channel_port: int = DEFAULT_SIDE_CHANNEL_PORT
    nixl_backends: tuple[str, ...] = ("UCX",)
    nixl_backend_params: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    auth_token: str | None = None
    load_failure_policy: str | None = None
    handshake_timeout_seconds: float = 5.0
    transfer_timeout_seconds: float = 120.0
    min_transfer_tokens: int = 0
    decode_pipeline_groups: int = DEFAULT_DECODE_PIPELINE_GROUPS
    nixl_progress_delay_us: int = DEFAULT_NIXL_PROGRESS_DELAY_US

    def __post_init__(self) -> None:
        if not isinstance(self.preset, str) or not self.preset:
            raise ConnectorConfigError("preset must be a non-empty preset name such as 'tq4'")
        if self.staging_bytes < 1 << 16:
            raise ConnectorConfigError(
                f"staging_bytes={self.staging_bytes} is too small: use at least 64KiB "
                "(it must hold one block of every layer)"
            )
        if self.recv_bytes < 1 << 16:
            raise ConnectorConfigError(f"recv_bytes={self.recv_bytes} is too small: use >= 64KiB")
        if self.lease_seconds < MIN_LEASE_SECONDS:
            raise ConnectorConfigError(
                f"lease_seconds={self.lease_seconds} is too small: use at least {MIN_LEASE_SECONDS}"
            )
        if not 1 <= self.side_channel_port <= 65535:
            raise ConnectorConfigError(
                f"side_channel_port={self.side_channel_port} is not a TCP port (1..65535)"
            )
        if not self.side_channel_host or any(c.isspace() for c in self.side_channel_host):
            raise ConnectorConfigError(
                "side_channel_host must be the address peers use to reach this engine "
                f"(got {self.side_channel_host!r})"
            )
        if not self.nixl_backends or not all(
            isinstance(b, str) and b for b in self.nixl_backends
        ):
            raise ConnectorConfigError("nixl_backends must be a non-empty list such as ['UCX']")
        for backend, params in self.nixl_backend_params.items():
            if backend not in self.nixl_backends:
                raise ConnectorConfigError(
                    f"nixl_backend_params names backend {backend!r} that is not in "
                    f"nixl_backends {list(self.nixl_backends)}"
                )
            if not all(isinstance(k, str) and isinstance(v, str) for k, v in params.items()):
                raise ConnectorConfigError(
                    f"nixl_backend_params[{backend!r}] must map strings to strings, "
                    "e.g. {'ucx_devices': 'veth0'}"
                )
        if self.load_failure_policy is not None and (
            self.load_failure_policy not in LOAD_FAILURE_POLICIES
        ):
            raise ConnectorConfigError(
                f"load_failure_policy={self.load_failure_policy!r} is unknown: use one of "
                f"{list(LOAD_FAILURE_POLICIES)}"
            )
        if not 1 <= self.decode_pipeline_groups <= MAX_DECODE_PIPELINE_GROUPS:
            raise ConnectorConfigError(
                f"decode_pipeline_groups={self.decode_pipeline_groups} is out of range: use "
                f"1 (one READ, decode after it) to {MAX_DECODE_PIPELINE_GROUPS}"
            )
        if not 0 <= self.nixl_progress_delay_us <= 1_000_000:
            raise ConnectorConfigError(
                f"nixl_progress_delay_us={self.nixl_progress_delay_us} is out of range: use 0 "
                "(NIXL's busy-polling progress thread) to 1000000"
            )
        if self.auth_token is not None and len(self.auth_token) < 8:
            raise ConnectorConfigError("auth_token is too short: use at least 8 characters")

    @classmethod
    def from_extra_config(
        cls,
        extra: Mapping[str, Any] | None,
        environ: Mapping[str, str] | None = None,
        known_presets: list[str] | None = None,
    ) -> TurboWireConfig:
        """Build from ``kv_connector_extra_config``; unknown keys are an error (typos)."""
        extra = dict(extra or {})
        env = os.environ if environ is None else environ
        unknown = sorted(set(extra) - KNOWN_KEYS)
        if unknown:
            raise ConnectorConfigError(
                f"unknown kv_connector_extra_config key(s) {unknown}; known keys: "
                f"{sorted(KNOWN_KEYS)} (see README 'Connector configuration')"
            )
        kwargs: dict[str, Any] = {}
        if "preset" in extra:
            kwargs["preset"] = extra["preset"]
            if known_presets is not None and extra["preset"] not in known_presets:
                raise ConnectorConfigError(
                    f"preset={extra['preset']!r} is unknown: use one of {known_presets}"
                )
        if "staging_bytes" in extra:
            kwargs["staging_bytes"] = _parse_size("staging_bytes", extra["staging_bytes"])
        if "recv_bytes" in extra:
            kwargs["recv_bytes"] = _parse_size("recv_bytes", extra["recv_bytes"])
        elif "staging_bytes" in extra:
            kwargs["recv_bytes"] = kwargs["staging_bytes"]
        if "lease_seconds" in extra:
            kwargs["lease_seconds"] = _parse_float(
                "lease_seconds", extra["lease_seconds"], MIN_LEASE_SECONDS
            )
        for key in ("handshake_timeout_seconds", "transfer_timeout_seconds"):
            if key in extra:
                kwargs[key] = _parse_float(key, extra[key], 0.1)
        if "min_transfer_tokens" in extra:
            kwargs["min_transfer_tokens"] = _parse_int(
                "min_transfer_tokens", extra["min_transfer_tokens"], 0, 1 << 30
            )
        if "decode_pipeline_groups" in extra:
            kwargs["decode_pipeline_groups"] = _parse_int(
                "decode_pipeline_groups", extra["decode_pipeline_groups"], 1,
                MAX_DECODE_PIPELINE_GROUPS,
            )
        if "nixl_progress_delay_us" in extra:
            kwargs["nixl_progress_delay_us"] = _parse_int(
                "nixl_progress_delay_us", extra["nixl_progress_delay_us"], 0, 1_000_000
            )
        if "side_channel_host" in extra:
            host = extra["side_channel_host"]
            if not isinstance(host, str):
                raise ConnectorConfigError("side_channel_host must be a string address")
            kwargs["side_channel_host"] = host
        if "side_channel_bind" in extra:
            bind = extra["side_channel_bind"]
            if not isinstance(bind, str):
                raise ConnectorConfigError("side_channel_bind must be a string address")
            try:
                ipaddress.ip_address(bind)
            except ValueError as exc:
                raise ConnectorConfigError(
                    f"side_channel_bind={bind!r} must be an IP address such as 0.0.0.0"
                ) from exc
            kwargs["side_channel_bind"] = bind
        if "side_channel_port" in extra:
            kwargs["side_channel_port"] = _parse_int(
                "side_channel_port", extra["side_channel_port"], 1, 65535
            )
        if "nixl_backends" in extra:
            backends = extra["nixl_backends"]
            if isinstance(backends, str):
                backends = [b.strip() for b in backends.split(",") if b.strip()]
            if not isinstance(backends, (list, tuple)):
                raise ConnectorConfigError("nixl_backends must be a list such as ['UCX']")
            kwargs["nixl_backends"] = tuple(backends)
        if "nixl_backend_params" in extra:
            params = extra["nixl_backend_params"]
            if not isinstance(params, Mapping) or not all(
                isinstance(v, Mapping) for v in params.values()
            ):
                raise ConnectorConfigError(
                    "nixl_backend_params must map a backend to its init params, e.g. "
                    "{'UCX': {'ucx_devices': 'veth0'}}"
                )
            kwargs["nixl_backend_params"] = {k: dict(v) for k, v in params.items()}
        token_env = extra.get("auth_token_env", AUTH_TOKEN_ENV)
        if not isinstance(token_env, str):
            raise ConnectorConfigError("auth_token_env must name an environment variable")
        if "auth_token" in extra:
            token = extra["auth_token"]
            if token is not None and not isinstance(token, str):
                raise ConnectorConfigError("auth_token must be a string")
            kwargs["auth_token"] = token or None
        elif env.get(token_env):
            kwargs["auth_token"] = env[token_env]
        if "load_failure_policy" in extra:
            kwargs["load_failure_policy"] = extra["load_failure_policy"]
        return cls(**kwargs)

    def check_resolvable(self) -> None:
        """Fail early when the advertised side-channel host cannot be resolved."""
        try:
            socket.getaddrinfo(self.side_channel_host, self.side_channel_port)
        except OSError as exc:
            raise ConnectorConfigError(
                f"side_channel_host={self.side_channel_host!r} does not resolve ({exc}); set it "
                "to the address the peer engine should connect to"
            ) from exc
