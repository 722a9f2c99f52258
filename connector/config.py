"""The connector's configuration: ``kv_connector_extra_config`` keys, validated at start.

``CONFIG_KEYS`` is the one declaration of every key (type, bounds, default, doc). The parsing of
``kv_connector_extra_config``, the checks of ``TurboWireConfig``, the error messages and the
README table ("Connector configuration") are all derived from it, so a key cannot be documented,
bounded or defaulted differently in two places; tests/unit/connector/test_config_table.py keeps
the README in sync (regenerate with ``python -m turbowire.connector.config --write README.md``).
Validation happens once, when vLLM builds the connector, and each error says which key is wrong,
what was given and what to put there, so a mistyped config stops the engine at start instead of
failing the first transfer.
"""

from __future__ import annotations

import abc
import difflib
import ipaddress
import json
import math
import os
import re
import socket
import ssl
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from turbowire.errors import TurboWireError
from turbowire.secret_file import read_secret_file

AUTH_TOKEN_ENV = "TURBOWIRE_AUTH_TOKEN"
LOAD_FAILURE_POLICIES = ("fail", "recompute")
DEFAULT_PRESET = "tq4"
DEFAULT_STAGING_BYTES = 256 << 20
MIN_BUFFER_BYTES = 64 << 10
DEFAULT_SIDE_CHANNEL_PORT = 5700
DEFAULT_DECODE_PIPELINE_GROUPS = 8
MAX_DECODE_PIPELINE_GROUPS = 256
DEFAULT_NIXL_PROGRESS_DELAY_US = 100
#: The lease's bounds and default: the config enforces them and the decode side's params parser
#: (params.py) accepts what they allow, so a lease one engine may configure the other accepts.
MIN_LEASE_SECONDS = 1.0
MAX_LEASE_SECONDS = 86400.0
DEFAULT_LEASE_SECONDS = 30.0
#: A lease token (``secrets`` hex) as the params and the side channel accept it.
MAX_LEASE_TOKEN_CHARS = 128
DEFAULT_CLAIM_TIMEOUT_SECONDS = 10.0
DEFAULT_LEASE_MAX_SECONDS = 120.0
DEFAULT_MAX_PEERS = 64
MAX_MAX_PEERS = 4096
MIN_AUTH_TOKEN_CHARS = 8
TRANSPORTS = ("nixl", "store", "both")
SAVE_SCHEDULES = ("layerwise", "after_forward")
STORE_URL_SCHEMES = ("redis://", "rediss://")
DEFAULT_STORE_LOCAL_CPU_BYTES = 1 << 30
DEFAULT_STORE_TTL_SECONDS = 3600.0
DEFAULT_STORE_CHUNK_TOKENS = 256
STORE_NAME_RE = re.compile(r"^[A-Za-z0-9_.:\-]{1,64}$")

TABLE_BEGIN = "<!-- config-table -->"
TABLE_END = "<!-- /config-table -->"


class ConnectorConfigError(TurboWireError, ValueError):
    """A ``kv_connector_extra_config`` value is missing or invalid."""


# -- sizes -----------------------------------------------------------------------------------------

_SIZE_UNITS: tuple[tuple[str, int], ...] = (
    ("gib", 1 << 30), ("gb", 10**9), ("g", 1 << 30),
    ("mib", 1 << 20), ("mb", 10**6), ("m", 1 << 20),
    ("kib", 1 << 10), ("kb", 10**3), ("k", 1 << 10),
    ("b", 1),
)


def parse_size(key: str, value: Any) -> int:
    """Bytes from an int or a string such as "256MiB", "1GiB", "64M" (bare K/M/G are binary)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        text = value.strip().lower().replace(" ", "")
        if text.isdigit():
            return int(text)
        for suffix, mult in _SIZE_UNITS:
            if text.endswith(suffix):
                try:
                    return int(float(text[: -len(suffix)]) * mult)
                except (ValueError, OverflowError):
                    break
    raise ConnectorConfigError(
        f"{key}={value!r} is not a byte count: use an integer (268435456) or a string "
        "with a unit ('256MiB', '1GiB')"
    )


def format_size(n: int) -> str:
    """The shortest exact binary-unit spelling of ``n`` ("256MiB"), as the README shows sizes."""
    for suffix, mult in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n and n % mult == 0:
            return f"{n // mult}{suffix}"
    return str(n)


# -- value kinds: parse (JSON-ish extra config), check (a typed value), describe (README) ----------


class ValueKind(abc.ABC):
    """How one key's value is read, bounded and documented."""

    def parse(self, key: str, raw: Any) -> Any:
        """The typed value of ``raw`` as given in ``kv_connector_extra_config`` (checked)."""
        self.check(key, raw)
        return raw

    def check(self, key: str, value: Any) -> None:
        """Raise ``ConnectorConfigError`` naming ``key`` when ``value`` is out of bounds."""

    @abc.abstractmethod
    def describe(self) -> str:
        """The README "values" cell: the type and what is allowed."""

    def show(self, value: Any) -> str:
        """A value as the README default column spells it (inside backticks)."""
        return json.dumps(value) if isinstance(value, (list, tuple, dict)) else str(value)


@dataclass(frozen=True)
class Size(ValueKind):
    """A byte count, an int or a string with a unit."""

    minimum: int
    why: str = ""

    def parse(self, key: str, raw: Any) -> int:
        n = parse_size(key, raw)
        self.check(key, n)
        return n

    def check(self, key: str, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConnectorConfigError(
                f"{key} must be a byte count such as 268435456 or '256MiB' (got {value!r})"
            )
        if value < self.minimum:
            raise ConnectorConfigError(
                f"{key}={value} is too small: use at least {format_size(self.minimum)}{self.why}"
            )

    def describe(self) -> str:
        return f'bytes >= `{format_size(self.minimum)}`: integer or `"64MiB"`, `"1GiB"`'

    def show(self, value: Any) -> str:
        return format_size(value)


def _number(key: str, raw: Any, convert: Any, accepted: tuple[type, ...], what: str) -> Any:
    """``convert(raw)`` for a JSON number or a numeric string, else the config error."""
    if isinstance(raw, bool) or not isinstance(raw, accepted):
        raise ConnectorConfigError(f"{key} must be {what} (got {raw!r})")
    try:
        return convert(raw)
    except ValueError as exc:
        raise ConnectorConfigError(f"{key} must be {what} (got {raw!r})") from exc


@dataclass(frozen=True)
class Seconds(ValueKind):
    """A finite duration in seconds with a lower and an optional upper bound."""

    minimum: float
    maximum: float = math.inf

    def parse(self, key: str, raw: Any) -> float:
        number = _number(key, raw, float, (int, float, str), "a number of seconds")
        self.check(key, number)
        return number

    def check(self, key: str, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
            raise ConnectorConfigError(f"{key} must be a number of seconds (got {value!r})")
        if not math.isfinite(value):
            raise ConnectorConfigError(
                f"{key}={value} is not a finite number of seconds: use {self.describe_range()}"
            )
        if value < self.minimum:
            raise ConnectorConfigError(f"{key}={value} is too small: use at least {self.minimum}")
        if value > self.maximum:
            raise ConnectorConfigError(
                f"{key}={value} is too large: use at most {self.maximum:g}"
            )

    def describe_range(self) -> str:
        """The allowed values in words (errors)."""
        if math.isfinite(self.maximum):
            return f"{self.minimum:g}..{self.maximum:g}"
        return f"at least {self.minimum:g}"

    def describe(self) -> str:
        if math.isfinite(self.maximum):
            return f"seconds `{self.minimum:g}`..`{self.maximum:g}`"
        return f"seconds >= `{self.minimum:g}`"

    def show(self, value: Any) -> str:
        return f"{value:g}"


@dataclass(frozen=True)
class Int(ValueKind):
    """An integer in ``minimum..maximum``; ``why`` explains the bounds in the error."""

    minimum: int
    maximum: int
    why: str = ""

    def parse(self, key: str, raw: Any) -> int:
        if isinstance(raw, float) and raw.is_integer():
            raw = int(raw)
        number = _number(key, raw, int, (int, str), "an integer")
        self.check(key, number)
        return number

    def check(self, key: str, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConnectorConfigError(f"{key} must be an integer (got {value!r})")
        if not self.minimum <= value <= self.maximum:
            raise ConnectorConfigError(
                f"{key}={value} is out of range: use {self.minimum}..{self.maximum}{self.why}"
            )

    def describe(self) -> str:
        return f"integer `{self.minimum}`..`{self.maximum}`"


@dataclass(frozen=True)
class Text(ValueKind):
    """A string; each rule is (predicate, error template with ``{key}`` and ``{value}``)."""

    what: str
    rules: tuple[tuple[Callable[[str], bool], str], ...] = ()
    nullable: bool = False
    secret: bool = False

    def parse(self, key: str, raw: Any) -> str | None:
        if self.nullable and (raw is None or raw == ""):
            return None  # "" and null both mean "not set"
        self.check(key, raw)
        return raw

    def check(self, key: str, value: Any) -> None:
        if value is None and self.nullable:
            return
        shown = "a non-string value" if self.secret else repr(value)
        if not isinstance(value, str):
            raise ConnectorConfigError(f"{key} must be {self.what} (got {shown})")
        for ok, template in self.rules:
            if not ok(value):
                raise ConnectorConfigError(template.format(key=key, value=value))

    def describe(self) -> str:
        return self.what


@dataclass(frozen=True)
class Choice(ValueKind):
    """One of a few words, or null (then someone else's default applies)."""

    choices: tuple[str, ...]

    def check(self, key: str, value: Any) -> None:
        if value is not None and value not in self.choices:
            raise ConnectorConfigError(
                f"{key}={value!r} is unknown: use one of {list(self.choices)}"
            )

    def describe(self) -> str:
        return " or ".join(f"`{c}`" for c in self.choices)


@dataclass(frozen=True)
class Names(ValueKind):
    """A non-empty list of names; a comma-separated string is accepted (shell-friendly)."""

    example: str

    def parse(self, key: str, raw: Any) -> tuple[str, ...]:
        if isinstance(raw, str):
            raw = [name.strip() for name in raw.split(",") if name.strip()]
        if not isinstance(raw, (list, tuple)):
            raise ConnectorConfigError(
                f"{key} must be a non-empty list such as {self.example} (got {raw!r})"
            )
        names = tuple(raw)
        self.check(key, names)
        return names

    def check(self, key: str, value: Any) -> None:
        if (
            isinstance(value, str)
            or not isinstance(value, Sequence)
            or not value
            or not all(isinstance(name, str) and name for name in value)
        ):
            raise ConnectorConfigError(
                f"{key} must be a non-empty list such as {self.example} (got {value!r})"
            )

    def describe(self) -> str:
        return 'list of names, or `"A,B"`'


@dataclass(frozen=True)
class ParamsByName(ValueKind):
    """A mapping name -> {string: string} (per-backend init parameters)."""

    example: str
    inner_example: str

    def parse(self, key: str, raw: Any) -> dict[str, dict[str, Any]]:
        if not isinstance(raw, Mapping) or not all(isinstance(v, Mapping) for v in raw.values()):
            raise ConnectorConfigError(
                f"{key} must map a backend to its init params, e.g. {self.example} (got {raw!r})"
            )
        params = {name: dict(inner) for name, inner in raw.items()}
        self.check(key, params)
        return params

    def check(self, key: str, value: Any) -> None:
        if not isinstance(value, Mapping):
            raise ConnectorConfigError(
                f"{key} must map a backend to its init params, e.g. {self.example}"
            )
        for name, inner in value.items():
            if not isinstance(inner, Mapping) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in inner.items()
            ):
                raise ConnectorConfigError(
                    f"{key}[{name!r}] must map strings to strings, e.g. {self.inner_example}"
                )

    def describe(self) -> str:
        return "object: backend -> {string: string}"


@dataclass(frozen=True)
class Fraction(ValueKind):
    """A share in (0, 1]."""

    def parse(self, key: str, raw: Any) -> float:
        number = _number(key, raw, float, (int, float, str), "a fraction in (0, 1]")
        self.check(key, number)
        return number

    def check(self, key: str, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
            raise ConnectorConfigError(f"{key} must be a fraction in (0, 1] (got {value!r})")
        if not 0 < value <= 1:
            raise ConnectorConfigError(f"{key}={value} is out of range: use a fraction in (0, 1]")

    def describe(self) -> str:
        return "a fraction in (0, `1`]"

    def show(self, value: Any) -> str:
        return f"{value:g}"


@dataclass(frozen=True)
class PeerList(ValueKind):
    """Prefill peers a decode engine may dial: CIDRs, IPs, host names, optional ports."""

    def parse(self, key: str, raw: Any) -> tuple[str, ...]:
        if isinstance(raw, str):
            raw = [entry.strip() for entry in raw.split(",") if entry.strip()]
        if not isinstance(raw, (list, tuple)):
            raise ConnectorConfigError(
                f"{key} must be a list such as [\"10.0.0.0/8\", \"prefill-0.svc:5700\"] "
                f"(got {raw!r})"
            )
        entries = tuple(raw)
        self.check(key, entries)
        return entries

    def check(self, key: str, value: Any) -> None:
        from turbowire.connector.params import PeerAllowlist, PeerAllowlistError

        if isinstance(value, str) or not isinstance(value, Sequence):
            raise ConnectorConfigError(f"{key} must be a list of CIDRs, IPs or host names")
        try:
            PeerAllowlist.parse(list(value))
        except PeerAllowlistError as exc:
            raise ConnectorConfigError(f"{key}: {exc}") from exc

    def describe(self) -> str:
        return ('list of CIDRs, IPs or host names, each with an optional `:port`, or `"A,B"`; '
                "empty: any")


def _is_thread_cpus(text: str) -> bool:
    from turbowire.connector.threads import AUTO, INHERIT, parse_cpu_list

    if text in (AUTO, INHERIT):
        return True
    try:
        return bool(parse_cpu_list(text))
    except ValueError:
        return False


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


# -- side-channel TLS: the PEM files are read and parsed at start ----------------------------------

_PEM_CERT = b"-----BEGIN CERTIFICATE-----"
_PEM_KEY_RE = re.compile(rb"-----BEGIN (RSA |EC )?PRIVATE KEY-----")
_PEM_ENCRYPTED = (b"-----BEGIN ENCRYPTED PRIVATE KEY-----", b"Proc-Type: 4,ENCRYPTED")


def pem_file(what: str) -> Text:
    """The kind of a PEM file path key: unset, or a readable regular file (checked at start)."""
    return Text(
        f"a path to a PEM file ({what})",
        (
            (bool, "{key} must be the path of a PEM file (got an empty string)"),
            (
                os.path.exists,
                "{key}={value!r} does not exist: give the path of the PEM " + what
                + " (is its Secret or volume mounted into the container?) or leave {key} unset",
            ),
            (os.path.isfile, "{key}={value!r} is not a file: give the path of the PEM " + what),
            (
                lambda s: os.access(s, os.R_OK),
                "{key}={value!r} is not readable by this process: make it readable by the "
                "engine's user",
            ),
        ),
        nullable=True,
    )


def read_pem(key: str, path: str) -> bytes:
    """The bytes of the PEM file of ``key`` (one error message for every way reading fails)."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ConnectorConfigError(
            f"{key}={path!r} cannot be read ({exc.strerror or exc}): make it a file readable by "
            "the engine's user"
        ) from exc


def _no_password() -> bytes:
    # OpenSSL would otherwise prompt on the terminal for the passphrase of an encrypted key
    raise ConnectorConfigError(
        "side_channel_tls_key is an encrypted private key: gRPC needs it unencrypted "
        "(openssl pkey -in KEY -out PLAIN); protect the file by its permissions instead"
    )


def _check_certs(key: str, path: str, what: str) -> None:
    """``path`` holds PEM certificates that OpenSSL parses, else the error naming ``key``."""
    if _PEM_CERT not in read_pem(key, path):
        raise ConnectorConfigError(
            f"{key}={path!r} holds no PEM certificate (-----BEGIN CERTIFICATE-----): give {what} "
            "in PEM"
        )
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=path)
    except ssl.SSLError as exc:
        raise ConnectorConfigError(
            f"{key}={path!r} does not parse as PEM certificates (OpenSSL: {exc}): check that the "
            "file is complete and not in DER form (openssl x509 -in FILE -noout -text)"
        ) from exc


def check_side_channel_tls(cert: str | None, key: str | None, ca: str | None) -> None:
    """Refuse a half-set certificate pair and PEM files that gRPC could not use, naming the key.

    gRPC itself reports bad credentials only at the first connection (and then vaguely), so the
    files are parsed here, with the interpreter's OpenSSL, when the engine starts.
    """
    if (cert is None) != (key is None):
        given, missing = (
            ("side_channel_tls_cert", "side_channel_tls_key")
            if key is None
            else ("side_channel_tls_key", "side_channel_tls_cert")
        )
        raise ConnectorConfigError(
            f"{given} is set but {missing} is not: set both (the PEM certificate chain and its "
            "private key) or neither"
        )
    if cert is not None and key is not None:
        _check_certs("side_channel_tls_cert", cert, "this engine's certificate chain, leaf first,")
        key_pem = read_pem("side_channel_tls_key", key)
        if any(marker in key_pem for marker in _PEM_ENCRYPTED):
            _no_password()
        if not _PEM_KEY_RE.search(key_pem):
            raise ConnectorConfigError(
                f"side_channel_tls_key={key!r} holds no PEM private key "
                "(-----BEGIN PRIVATE KEY-----): give the unencrypted private key of "
                "side_channel_tls_cert in PEM"
            )
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key, _no_password)
        except ssl.SSLError as exc:
            if exc.reason == "KEY_VALUES_MISMATCH":
                raise ConnectorConfigError(
                    f"side_channel_tls_key={key!r} is not the private key of "
                    f"side_channel_tls_cert={cert!r}: give the key the certificate was issued for"
                ) from exc
            raise ConnectorConfigError(
                f"side_channel_tls_key={key!r} does not parse as a PEM private key (OpenSSL: "
                f"{exc}): check that the file is complete and not in DER form "
                "(openssl pkey -in FILE -noout)"
            ) from exc
    if ca is not None:
        _check_certs(
            "side_channel_tls_ca", ca, "the CA certificate(s) that signed the peers' certificates"
        )


# -- the table -------------------------------------------------------------------------------------

Derive = Callable[[Mapping[str, Any], Mapping[str, str]], Any]


@dataclass(frozen=True)
class ConfigKey:
    """One ``kv_connector_extra_config`` key: everything the code and the README say about it.

    ``derive`` computes the default from the other keys' values and the environment when the key
    is absent (``default_doc`` then says so in the README); ``stored`` is False for keys that only
    steer the parsing and are not kept in ``TurboWireConfig``.
    """

    name: str
    kind: ValueKind
    doc: str
    default: Any = None
    factory: Callable[[], Any] | None = None
    default_doc: str = ""
    derive: Derive | None = None
    stored: bool = True

    def default_value(self) -> Any:
        """The default when nothing else decides it (a fresh object for mutable defaults)."""
        return self.factory() if self.factory is not None else self.default

    def default_cell(self) -> str:
        """The README default column."""
        return self.default_doc or f"`{self.kind.show(self.default_value())}`"


def default_advertise_host() -> str:
    """The address peers should use when none is configured: loopback (one-machine setups)."""
    return "127.0.0.1"


REDIS_URL = Text(
    "a redis:// or rediss:// URL",
    ((lambda s: s.startswith(STORE_URL_SCHEMES) and len(s) > len("redis://"),
      "{key}={value!r} is not supported: use redis://HOST:PORT (or rediss://)"),),
    nullable=True,
)


def read_auth_token_file(path: str) -> str | None:
    """The token in ``auth_token_file`` (surrounding whitespace stripped; empty: None). Errors
    name the file, never its content."""
    text = read_secret_file(path, key="auth_token_file", holds="the token",
                            error=ConnectorConfigError)
    return text or None


def _auth_token_from_env(values: Mapping[str, Any], env: Mapping[str, str]) -> str | None:
    """The token from ``auth_token_file`` when given, else from the ``auth_token_env``
    variable."""
    if values.get("auth_token_file"):
        return read_auth_token_file(values["auth_token_file"])
    return env.get(values["auth_token_env"]) or None


CONFIG_KEYS: tuple[ConfigKey, ...] = (
    ConfigKey(
        "preset",
        Text(
            "a preset name",
            ((bool, "{key} must be a non-empty preset name such as 'tq4' (got {value!r})"),),
        ),
        "Codec preset of the staged chunks (`turbowire presets` lists them: `raw`, `k8v4`, "
        "`tq4`, `k4v3`, `tq3`, `k3v2`, `tq2`, `k5v4`). Both engines must use the same preset "
        "(checked at the handshake).",
        default=DEFAULT_PRESET,
    ),
    ConfigKey(
        "staging_bytes",
        Size(MIN_BUFFER_BYTES, " (it must hold one block of every layer)"),
        "Size of the prefill side's compressed staging pool, registered with NIXL (device "
        "memory on GPU, DRAM on CPU). It is carved into slots of one KV block x all layers; "
        "when it is full, new requests fall back (the decode engine recomputes their prompt) and "
        '`turbowire_kv_fallbacks_total{reason="staging_full"}` counts them.',
        default=DEFAULT_STAGING_BYTES,
    ),
    ConfigKey(
        "recv_bytes",
        Size(MIN_BUFFER_BYTES),
        "Size of the decode side's receive buffer (NIXL READ target). A request larger than it "
        "fails with reason `recv_buffer_too_small`.",
        default=DEFAULT_STAGING_BYTES,
        default_doc="= `staging_bytes`",
        derive=lambda values, env: values["staging_bytes"],
    ),
    ConfigKey(
        "lease_seconds",
        Seconds(MIN_LEASE_SECONDS, MAX_LEASE_SECONDS),
        "How long the prefill engine keeps a finished request's compressed KV for the decode "
        "engine. The decode engine heartbeats while a request waits and claims the lease before "
        "reading; an unread lease expires, its slots are freed and `reason=\"lease_expired\"` is "
        "counted. The params carry it to the decode engine, which retries its handshake and "
        "claim within it.",
        default=DEFAULT_LEASE_SECONDS,
    ),
    ConfigKey(
        "claim_timeout_seconds",
        Seconds(2.0),
        "A new lease expires after this long (at most `lease_seconds`) unless the decode engine "
        "claims or heartbeats it (it does so as soon as the request arrives): params a client "
        "never hands to a decode engine hold the staging pool this long, not `lease_seconds`.",
        default=DEFAULT_CLAIM_TIMEOUT_SECONDS,
    ),
    ConfigKey(
        "lease_max_seconds",
        Seconds(MIN_LEASE_SECONDS),
        "Cap on a lease's total age (at least `lease_seconds`): heartbeats extend a lease by "
        "`lease_seconds` up to this age, then it expires (a request queued this long on an "
        "overloaded decode engine is recomputed there instead of holding staging).",
        default=DEFAULT_LEASE_MAX_SECONDS,
    ),
    ConfigKey(
        "staging_request_share",
        Fraction(),
        "Largest share of the staging pool one request may hold; a request that needs more "
        "falls back (`turbowire_kv_fallbacks_total{reason=\"staging_share\"}`, the decode engine "
        "recomputes it). `1`: no cap beyond the pool.",
        default=1.0,
    ),
    ConfigKey(
        "side_channel_host",
        Text(
            "a host name or IP address",
            (
                (
                    lambda s: bool(s) and not any(c.isspace() for c in s),
                    "{key} must be the address peers use to reach this engine (got {value!r})",
                ),
            ),
        ),
        "The address the *peer* uses to reach this engine's gRPC side channel (advertised in "
        "`kv_transfer_params.remote_host`): set it to this host's address on the link between "
        "engines.",
        factory=default_advertise_host,
    ),
    ConfigKey(
        "side_channel_bind",
        Text(
            "an IP address",
            ((_is_ip, "{key}={value!r} must be an IP address such as 0.0.0.0"),),
        ),
        "Local address the side channel listens on.",
        default="0.0.0.0",
    ),
    ConfigKey(
        "side_channel_port",
        Int(1, 65535, " (a TCP port)"),
        "Side-channel TCP port (plus the data-parallel index). Give each engine on a host its own.",
        default=DEFAULT_SIDE_CHANNEL_PORT,
    ),
    ConfigKey(
        "nixl_backends",
        Names("['UCX']"),
        "NIXL backends for the transfer agent. UCX transport settings come from the environment "
        "(`UCX_TLS=tcp,self`, `UCX_NET_DEVICES=eth1`, ...).",
        default=("UCX",),
    ),
    ConfigKey(
        "nixl_backend_params",
        ParamsByName("{'UCX': {'ucx_devices': 'veth0'}}", "{'ucx_devices': 'veth0'}"),
        'Init parameters per backend, e.g. `{"UCX": {"ucx_devices": "veth0"}}`; every backend '
        "named must be in `nixl_backends`.",
        factory=dict,
    ),
    ConfigKey(
        "auth_token",
        Text(
            f"a string of >= {MIN_AUTH_TOKEN_CHARS} characters",
            (
                (
                    lambda s: len(s) >= MIN_AUTH_TOKEN_CHARS,
                    f"{{key}} is too short: use at least {MIN_AUTH_TOKEN_CHARS} characters",
                ),
            ),
            nullable=True,
            secret=True,
        ),
        "Shared secret required on every side-channel call (`authorization: Bearer ...`); set "
        "the same on both engines. It also keys the MAC of `kv_transfer_params` "
        "(`turbowire_params_mac`): a decode engine with a token loads only params its prefill "
        "engines signed, checked before it dials anything (`reason=\"unauthenticated_params\"`). "
        "Unset (and the variable empty): no authentication and no MAC check (the engine warns "
        "at start). vLLM logs its non-default arguments, this one included: prefer "
        "`auth_token_file` or `auth_token_env` (the engine warns when it is given inline).",
        default_doc=f"`auth_token_file`, else env `{AUTH_TOKEN_ENV}`",
        derive=_auth_token_from_env,
    ),
    ConfigKey(
        "auth_token_file",
        Text("a path to a file", ((bool, "{key} must be the path of a file"),), nullable=True),
        "File holding the token (e.g. a mounted Secret; surrounding whitespace ignored), read "
        "once at start when `auth_token` is not given; its content is never logged.",
        stored=False,
    ),
    ConfigKey(
        "auth_token_env",
        Text("an environment variable name", ((bool, "{key} must name an environment variable"),)),
        "Name of the environment variable to read the token from when `auth_token` is not given.",
        default=AUTH_TOKEN_ENV,
        stored=False,
    ),
    ConfigKey(
        "side_channel_tls_cert",
        pem_file("certificate chain"),
        "This engine's side-channel certificate chain, leaf first. With `side_channel_tls_key` "
        "the side channel serves TLS only, and the engine presents it as its client certificate "
        "to peers that require mTLS. Its subject alternative names must cover the address peers "
        "dial, `side_channel_host` (an IP SAN for an IP). Unset: the side channel serves "
        "plaintext.",
    ),
    ConfigKey(
        "side_channel_tls_key",
        pem_file("private key"),
        "The unencrypted private key of `side_channel_tls_cert`; set both or neither.",
    ),
    ConfigKey(
        "side_channel_tls_ca",
        pem_file("CA bundle"),
        "CA bundle that signed the peers' side-channel certificates. Set: this engine's calls to "
        "peers use TLS and verify the peer's certificate and host name with it, and its own "
        "side channel (with `side_channel_tls_cert`) requires client certificates signed by it "
        "(mTLS). Unset: calls to peers are plaintext. `auth_token` is still checked over TLS.",
    ),
    ConfigKey(
        "load_failure_policy",
        Choice(LOAD_FAILURE_POLICIES),
        "What a failed load does on the decode engine: `fail` the request or `recompute` its "
        "prompt locally. Overrides the `KVTransferConfig` field.",
        default_doc="vLLM's `kv_load_failure_policy` (`fail`)",
    ),
    ConfigKey(
        "handshake_timeout_seconds",
        Seconds(0.1),
        "Timeout of side-channel calls (handshake, claim, release, heartbeat). A handshake or "
        "claim that times out is sent again while the lease may still hold (`lease_seconds` "
        "from the load's start): a CPU-starved prefill engine answers late, a hung one fails "
        "the load as `peer_unreachable` after that window.",
        default=5.0,
    ),
    ConfigKey(
        "prefill_peers",
        PeerList(),
        "The prefill engines a decode engine may dial: CIDRs (`10.0.0.0/8`), IPs, host names "
        "(`prefill-0.prefill.svc`), each with an optional `:port`. Params naming another "
        "`remote_host`/`remote_port` are refused before anything is dialed or resolved "
        "(`reason=\"peer_not_allowed\"`, recomputed); a host name matches only a listed name. "
        "Empty: any.",
        factory=tuple,
    ),
    ConfigKey(
        "max_peers",
        Int(1, MAX_MAX_PEERS),
        "Prefill engines a decode engine keeps a side-channel connection, handshake, NIXL "
        "agent and call threads for; the least recently used beyond it are closed (and "
        "handshaken again when named again).",
        default=DEFAULT_MAX_PEERS,
    ),
    ConfigKey(
        "transfer_timeout_seconds",
        Seconds(0.1),
        "A load not finished after this long fails with reason `timeout`.",
        default=120.0,
    ),
    ConfigKey(
        "min_transfer_tokens",
        Int(0, 1 << 30),
        "Prompts whose remote part is shorter than this are recomputed on the decode engine "
        "instead of transferred.",
        default=0,
    ),
    ConfigKey(
        "decode_pipeline_groups",
        Int(1, MAX_DECODE_PIPELINE_GROUPS, " (1 = one READ, decode after it)"),
        "The decode engine READs a request's chunks in this many groups of layers (one NIXL READ "
        "each, two on the wire at a time) and decodes each group into the cache as soon as it "
        "lands, while the next group is on the wire. When a poll (one per engine step) finds "
        "both landed, the link is faster than the steps: every group left goes out in one READ. "
        "`1` = one READ, decode after it.",
        default=DEFAULT_DECODE_PIPELINE_GROUPS,
    ),
    ConfigKey(
        "save_schedule",
        Choice(SAVE_SCHEDULES),
        "When a prefill engine encodes a step's KV into the staging pool. `layerwise`: each "
        "layer from `save_kv_layer` (on GPUs on a side stream, while the next layers compute: "
        "the cheapest, bench/RESULTS.md 'GPU connector path'); vLLM then runs PIECEWISE CUDA "
        "graphs only (the connector asks for it: a FULL graph would capture `save_kv_layer` once "
        "and skip it on replay). `after_forward`: every layer in `wait_for_save`, after the "
        "forward (one launch on GPUs); `save_kv_layer` does nothing, so vLLM keeps FULL CUDA "
        "graphs (its default FULL_AND_PIECEWISE). Use it on decode engines (`kv_consumer`: they "
        "stage nothing for NIXL; the Helm chart sets it there), or where FULL graphs are worth "
        "more than the overlap.",
        default="layerwise",
    ),
    ConfigKey(
        "nixl_progress_delay_us",
        Int(0, 1_000_000, " (0 = NIXL's busy-polling progress thread)"),
        "Sleep of the NIXL agent's progress thread between polls, in microseconds. NIXL's Python "
        "API uses `0`, a thread that never sleeps and keeps a whole core busy; on CPU engines "
        "pinned to one core that halved the codec's speed. `0` restores NIXL's behaviour.",
        default=DEFAULT_NIXL_PROGRESS_DELAY_US,
    ),
    ConfigKey(
        "connector_thread_cpus",
        Text(
            "`auto`, `inherit` or a CPU list such as `2,3` or `4-7`",
            ((_is_thread_cpus, "{key}={value!r}: use auto, inherit or a CPU list such as 2,3 "
              "or 4-7"),),
        ),
        "Cores of the connector's background threads (NIXL progress and UCX threads, the "
        "worker's thread pool). `auto`: the cores of the engine process that started the worker "
        "(vLLM's EngineCore), so the kernel can move them off the core vLLM binds the worker's "
        "main thread to. `inherit`: vLLM's placement (on CPU engines, the OpenMP master's one "
        "core). A list: those cores. No effect where the platform has no thread affinity.",
        default="auto",
    ),
    ConfigKey(
        "transport",
        Choice(TRANSPORTS),
        "`nixl`: P/D hand-off peer to peer over NIXL. `store`: every engine saves the compressed "
        "full chunks of the prompts it computes into the store (LMCache tiers, Redis) and loads "
        "any stored prefix of a new prompt instead of computing it. `both`: the NIXL hand-off, "
        "and every computed chunk also stored. A request opts out of saving with "
        '`kv_transfer_params: {"turbowire_store": false}`.',
        default="nixl",
    ),
    ConfigKey(
        "store_url",
        REDIS_URL,
        "Where the store's bytes live, shared by engines: `redis://HOST:PORT[/DB]` (or "
        "`rediss://`), reached through LMCache's remote backend with turbowire's Redis plugin. "
        "Unset: only this engine's local tiers. With only `store_url` set, the directory lives "
        "in the same Redis.",
    ),
    ConfigKey(
        "directory_url",
        REDIS_URL,
        "The chunk directory and engine registry (Redis): which chunks are stored, which engines "
        "serve them. The scheduler answers lookups from it without reading the bytes.",
        default_doc="= `store_url`",
        derive=lambda values, env: values["store_url"],
    ),
    ConfigKey(
        "store_local_cpu_bytes",
        Size(0),
        "LMCache local CPU tier of this engine (compressed chunks in host memory); `0` = off.",
        default=DEFAULT_STORE_LOCAL_CPU_BYTES,
    ),
    ConfigKey(
        "store_local_disk",
        Text("a directory path", ((bool, "{key} must be a directory path"),), nullable=True),
        "LMCache local disk tier (a directory, one per engine); unset = off. LMCache keeps its "
        "disk index in memory only; turbowire rebuilds it from the files at start, so chunks "
        "survive an engine restart.",
    ),
    ConfigKey(
        "store_ttl_seconds",
        Seconds(1.0),
        "Lifetime of a stored chunk and its directory entry in Redis, refreshed when an engine "
        "loads the chunk (lookups, the proxy's included, never refresh it).",
        default=DEFAULT_STORE_TTL_SECONDS,
    ),
    ConfigKey(
        "store_namespace",
        Text(
            "1-64 of letters, digits and `_.:-`",
            ((lambda s: bool(STORE_NAME_RE.match(s)),
              "{key}={value!r} must be 1-64 characters of letters, digits and _.:-"),),
        ),
        "Prefix of every store and directory key: deployments sharing a Redis never see each "
        "other's chunks.",
        default="turbowire",
    ),
    ConfigKey(
        "store_chunk_tokens",
        Int(1, 1 << 16, " (a multiple of the KV block size)"),
        "Tokens per stored chunk (a multiple of the block size). Only full chunks are stored; "
        "a chunk is reused only after the identical prefix "
        "under the same `cache_salt`, LoRA adapter and images.",
        default=DEFAULT_STORE_CHUNK_TOKENS,
    ),
)

CONFIG_KEYS_BY_NAME: Mapping[str, ConfigKey] = {k.name: k for k in CONFIG_KEYS}
KNOWN_KEYS = frozenset(CONFIG_KEYS_BY_NAME)


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
        f"{sorted(KNOWN_KEYS)} (see README 'Connector configuration')"
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
    """The README "Connector configuration" table (test_config_table.py keeps README in sync)."""
    lines = ["| key | default | values | meaning |", "|---|---|---|---|"]
    for key in keys:
        lines.append(
            f"| `{key.name}` | {key.default_cell()} | {key.kind.describe()} | {key.doc} |"
        )
    return "\n".join(lines)


_TABLE_RE = re.compile(re.escape(TABLE_BEGIN) + r"\n(.*?)\n" + re.escape(TABLE_END), re.DOTALL)


def readme_table(readme: str) -> str | None:
    """The table between the README markers, or None when the markers are missing."""
    m = _TABLE_RE.search(readme)
    return m.group(1) if m else None


def update_readme(readme: str) -> str:
    """``readme`` with the marked table replaced by the generated one."""
    if readme_table(readme) is None:
        raise ValueError(f"README lacks the {TABLE_BEGIN} ... {TABLE_END} markers")
    table = render_markdown_table()
    return _TABLE_RE.sub(lambda _: f"{TABLE_BEGIN}\n{table}\n{TABLE_END}", readme, count=1)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m turbowire.connector.config [--write README.md]``: print or refresh the table."""
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
    sys.stderr.write("usage: python -m turbowire.connector.config [--write README.md]\n")
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
