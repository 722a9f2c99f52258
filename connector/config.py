"""The connector's configuration: ``kv_connector_extra_config`` keys, validated at start.

``CONFIG_KEYS`` is the one declaration of every key (type, bounds, default, doc). The parsing of
``kv_connector_extra_config``, the checks of ``TurboWireConfig``, the error messages and the
table of docs/configuration.md are all derived from it, so a key cannot be documented, bounded
or defaulted differently in two places; tests/unit/connector/test_config_table.py keeps the page
in sync (regenerate with ``python -m turbowire.connector.config --write docs/configuration.md``).
Validation happens once, when vLLM builds the connector, and each error says which key is wrong,
what was given and what to put there, so a mistyped config stops the engine at start instead of
failing the first transfer.
"""

from __future__ import annotations

import difflib
import ipaddress
import os
import re
import socket
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from turbowire.connector.config_keys import *  # noqa: F403 (the bounds and defaults, re-exported)
from turbowire.connector.config_keys import (
    CONFIG_KEYS,
    CONFIG_KEYS_BY_NAME,
    KNOWN_KEYS,
    ConfigKey,
)
from turbowire.connector.config_kinds import *  # noqa: F403 (the value kinds, re-exported)
from turbowire.connector.config_kinds import ConnectorConfigError
from turbowire.connector.config_tls import *  # noqa: F403 (the TLS checks, re-exported)
from turbowire.connector.config_tls import check_side_channel_tls

TABLE_BEGIN = "<!-- config-table -->"
TABLE_END = "<!-- /config-table -->"


def _default(name: str) -> Any:
    """The dataclass field of ``name`` with the table's default (defaults live in one place);
    a secret (``auth_token``) is kept out of the config's repr, so no log line or traceback that
    shows the config shows it."""
    key = CONFIG_KEYS_BY_NAME[name]
    shown = not getattr(key.kind, "secret", False)
    if key.factory is not None:
        return field(default_factory=key.factory, repr=shown)
    return field(default=key.default, repr=shown)


def unknown_key_message(unknown: Sequence[str]) -> str:
    """The error for keys not in the table: each named, with the closest known key if any."""
    hints = []
    for name in unknown:
        close = difflib.get_close_matches(str(name), sorted(KNOWN_KEYS), n=1)
        if close:
            hints.append(f"{name!r} -> {close[0]!r}")
    did_you_mean = f" (did you mean {', '.join(hints)}?)" if hints else ""
    return (
        f"unknown kv_connector_extra_config key(s) {list(unknown)}{did_you_mean}; known keys: "
        f"{sorted(KNOWN_KEYS)} (see docs/configuration.md)"
    )


@dataclass(frozen=True)
class TurboWireConfig:
    """Validated connector settings; defaults, bounds and docs come from ``CONFIG_KEYS``."""

    preset: str = _default("preset")
    staging_bytes: int = _default("staging_bytes")
    recv_bytes: int = _default("recv_bytes")
    lease_seconds: float = _default("lease_seconds")
    claim_timeout_seconds: float = _default("claim_timeout_seconds")
    lease_max_seconds: float = _default("lease_max_seconds")
    staging_request_share: float = _default("staging_request_share")
    decode_tp_size: int = _default("decode_tp_size")
    side_channel_host: str = _default("side_channel_host")
    side_channel_bind: str = _default("side_channel_bind")
    side_channel_port: int = _default("side_channel_port")
    nixl_backends: tuple[str, ...] = _default("nixl_backends")
    nixl_backend_params: Mapping[str, Mapping[str, str]] = _default("nixl_backend_params")
    auth_token: str | None = _default("auth_token")
    side_channel_tls_cert: str | None = _default("side_channel_tls_cert")
    side_channel_tls_key: str | None = _default("side_channel_tls_key")
    side_channel_tls_ca: str | None = _default("side_channel_tls_ca")
    load_failure_policy: str | None = _default("load_failure_policy")
    handshake_timeout_seconds: float = _default("handshake_timeout_seconds")
    prefill_peers: tuple[str, ...] = _default("prefill_peers")
    max_peers: int = _default("max_peers")
    transfer_timeout_seconds: float = _default("transfer_timeout_seconds")
    min_transfer_tokens: int = _default("min_transfer_tokens")
    recompute_recent_tokens: int = _default("recompute_recent_tokens")
    decode_pipeline_groups: int = _default("decode_pipeline_groups")
    save_schedule: str = _default("save_schedule")
    nixl_progress_delay_us: int = _default("nixl_progress_delay_us")
    connector_thread_cpus: str = _default("connector_thread_cpus")
    transport: str = _default("transport")
    store_url: str | None = _default("store_url")
    directory_url: str | None = _default("directory_url")
    store_local_cpu_bytes: int = _default("store_local_cpu_bytes")
    store_local_disk: str | None = _default("store_local_disk")
    store_ttl_seconds: float = _default("store_ttl_seconds")
    store_namespace: str = _default("store_namespace")
    store_chunk_tokens: int = _default("store_chunk_tokens")

    def __post_init__(self) -> None:
        """Every field is checked here, so a directly built config is as safe as a parsed one."""
        for key in CONFIG_KEYS:
            if key.stored:
                key.kind.check(key.name, getattr(self, key.name))
        check_side_channel_tls(
            self.side_channel_tls_cert, self.side_channel_tls_key, self.side_channel_tls_ca
        )
        for backend in self.nixl_backend_params:
            if backend not in self.nixl_backends:
                raise ConnectorConfigError(
                    f"nixl_backend_params names backend {backend!r} that is not in "
                    f"nixl_backends {list(self.nixl_backends)}"
                )
        if self.uses_store:
            if not (self.store_url or self.store_local_cpu_bytes or self.store_local_disk):
                raise ConnectorConfigError(
                    f"transport={self.transport!r} needs somewhere to store chunks: set store_url "
                    "(redis://HOST:PORT), store_local_cpu_bytes or store_local_disk"
                )
            if self.load_failure_policy == "fail":
                raise ConnectorConfigError(
                    f"load_failure_policy='fail' cannot be used with transport={self.transport!r}: "
                    "a store miss must recompute, never fail the request; use 'recompute' or "
                    "transport='nixl'"
                )

    @property
    def claim_deadline_seconds(self) -> float:
        """How long a lease waits for its first claim or heartbeat."""
        return min(self.claim_timeout_seconds, self.lease_seconds)

    @property
    def lease_age_cap_seconds(self) -> float:
        """The most a lease can live, heartbeats included."""
        return max(self.lease_max_seconds, self.lease_seconds)

    @property
    def uses_store(self) -> bool:
        """Whether this engine saves to and loads from the store."""
        return self.transport in ("store", "both")

    @property
    def uses_nixl(self) -> bool:
        """Whether this engine takes part in the NIXL P/D hand-off."""
        return self.transport in ("nixl", "both")

    @classmethod
    def from_extra_config(
        cls,
        extra: Mapping[str, Any] | None,
        environ: Mapping[str, str] | None = None,
        known_presets: list[str] | None = None,
    ) -> TurboWireConfig:
        """Build from ``kv_connector_extra_config``; unknown keys are an error (typos)."""
        if extra is not None and not isinstance(extra, Mapping):
            raise ConnectorConfigError(
                f"kv_connector_extra_config must be a JSON object of keys (got {extra!r})"
            )
        given = dict(extra or {})
        env = os.environ if environ is None else environ
        unknown = sorted((k for k in given if k not in KNOWN_KEYS), key=str)
        if unknown:
            raise ConnectorConfigError(unknown_key_message(unknown))
        if given.get("auth_token") and given.get("auth_token_file"):
            raise ConnectorConfigError(
                "auth_token and auth_token_file are both set: give the token one way (prefer "
                "auth_token_file: vLLM logs kv_connector_extra_config)"
            )
        if known_presets is not None and "preset" in given and given["preset"] not in known_presets:
            raise ConnectorConfigError(
                f"preset={given['preset']!r} is unknown: use one of {known_presets}"
            )
        values: dict[str, Any] = {}
        for key in CONFIG_KEYS:
            if key.name in given:
                values[key.name] = key.kind.parse(key.name, given[key.name])
            elif key.derive is None:
                values[key.name] = key.default_value()
        for key in CONFIG_KEYS:  # derived defaults read the keys resolved above
            if key.name not in values and key.derive is not None:
                values[key.name] = key.derive(values, env)
        return cls(**{k.name: values[k.name] for k in CONFIG_KEYS if k.stored})

    def check_resolvable(self) -> None:
        """Fail early when the advertised side-channel host cannot be resolved."""
        try:
            socket.getaddrinfo(self.side_channel_host, self.side_channel_port)
        except OSError as exc:
            raise ConnectorConfigError(
                f"side_channel_host={self.side_channel_host!r} does not resolve ({exc}); set it "
                "to the address the peer engine should connect to"
            ) from exc


# -- start-up warnings ----------------------------------------------------------------------------


def security_warnings(
    config: TurboWireConfig, extra: Mapping[str, Any] | None, *, producer: bool, consumer: bool,
    port: int | None = None,
) -> list[str]:
    """What this engine exposes with its configuration, one WARNING line each (secrets never
    in them): no token on a side channel or on params, a non-loopback bind without TLS, a token
    given inline in ``kv_connector_extra_config`` (vLLM prints its non-default arguments)."""
    out: list[str] = []
    if isinstance(extra, Mapping) and extra.get("auth_token"):
        out.append(
            "auth_token is given inline in kv_connector_extra_config, which vLLM prints among "
            "its non-default arguments at start: put it in a file (auth_token_file, e.g. a "
            "mounted Secret) or in the environment variable named by auth_token_env"
        )
    if not config.uses_nixl:
        return out
    bind = f"{config.side_channel_bind}:{port if port is not None else config.side_channel_port}"
    if producer and config.auth_token is None:
        out.append(
            f"the side channel on {bind} serves without auth_token: anyone who reaches it gets "
            "this engine's NIXL agent metadata (the addresses of its staging pool) and can READ "
            "every staged prompt's KV over UCX; set auth_token (auth_token_file) on every engine"
        )
    if producer and config.side_channel_tls_cert is None and not _is_loopback(
            config.side_channel_bind):
        out.append(
            f"the side channel binds {bind} (not loopback) without TLS: the auth token and the "
            "NIXL metadata cross the network in plaintext; set side_channel_tls_cert, "
            "side_channel_tls_key and side_channel_tls_ca"
        )
    if consumer and config.auth_token is None:
        out.append(
            "kv_transfer_params are not authenticated (no auth_token): whoever can post to this "
            "engine's API can make it dial any host:port named in remote_host/remote_port and "
            "load another prompt's KV; set auth_token on every engine (the params' MAC is then "
            "checked before anything is dialed)"
            + ("" if config.prefill_peers else " and/or prefill_peers")
        )
    return out


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


# -- README ----------------------------------------------------------------------------------------


def render_markdown_table(keys: Sequence[ConfigKey] = CONFIG_KEYS) -> str:
    """The docs/configuration.md key table (test_config_table.py keeps the page in sync)."""
    lines = ["| key | default | values | meaning |", "|---|---|---|---|"]
    for key in keys:
        cells = (f"`{key.name}`", key.default_cell(), key.kind.describe(), key.rendered_doc())
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


_TABLE_RE = re.compile(re.escape(TABLE_BEGIN) + r"\n(.*?)\n" + re.escape(TABLE_END), re.DOTALL)


def readme_table(readme: str) -> str | None:
    """The table between the page's markers, or None when the markers are missing."""
    m = _TABLE_RE.search(readme)
    return m.group(1) if m else None


def update_readme(readme: str) -> str:
    """``readme`` with the marked table replaced by the generated one."""
    if readme_table(readme) is None:
        raise ValueError(f"README lacks the {TABLE_BEGIN} ... {TABLE_END} markers")
    table = render_markdown_table()
    return _TABLE_RE.sub(lambda _: f"{TABLE_BEGIN}\n{table}\n{TABLE_END}", readme, count=1)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m turbowire.connector.config [--write docs/configuration.md]``: print or refresh
    the table."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        sys.stdout.write(render_markdown_table() + "\n")
        return 0
    if len(args) == 2 and args[0] == "--write":
        with open(args[1], encoding="utf-8") as f:
            old = f.read()
        new = update_readme(old)
        if new != old:
            with open(args[1], "w", encoding="utf-8") as f:
                f.write(new)
        return 0
    sys.stderr.write(
        "usage: python -m turbowire.connector.config [--write docs/configuration.md]\n"
    )
    return 2


if __name__ == "__main__":
    sys.exit(main())
