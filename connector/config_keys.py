"""``CONFIG_KEYS``: the one declaration of every ``kv_connector_extra_config`` key (type, bounds,
default, doc), and the bounds and defaults other modules import (params.py, the side channel,
the soak, the Helm chart) so none is written twice. The store path's keys are declared in
``config_store`` (and re-exported here), what a row holds in ``config_key``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from turbowire.connector.config_key import PRESET_LIST, ConfigKey, Derive
from turbowire.connector.config_kinds import (
    Choice,
    ConnectorConfigError,
    Fraction,
    Int,
    Names,
    ParamsByName,
    PeerList,
    Seconds,
    Size,
    Text,
    is_ip_address,
    is_thread_cpus,
)
from turbowire.connector.config_store import (
    DEFAULT_STORE_CHUNK_TOKENS,
    DEFAULT_STORE_LOCAL_CPU_BYTES,
    DEFAULT_STORE_TTL_SECONDS,
    REDIS_URL,
    STORE_KEYS,
    STORE_NAME_RE,
    STORE_URL_SCHEMES,
    TRANSPORTS,
)
from turbowire.connector.config_tls import pem_file
from turbowire.secret_file import read_secret_file

__all__ = [
    "AUTH_TOKEN_ENV", "CONFIG_KEYS", "CONFIG_KEYS_BY_NAME", "ConfigKey",
    "DEFAULT_CLAIM_TIMEOUT_SECONDS", "MIN_CLAIM_TIMEOUT_SECONDS", "DEFAULT_DECODE_PIPELINE_GROUPS",
    "DEFAULT_LEASE_MAX_SECONDS", "DEFAULT_LEASE_SECONDS", "DEFAULT_MAX_PEERS",
    "DEFAULT_NIXL_PROGRESS_DELAY_US", "DEFAULT_PRESET", "DEFAULT_SIDE_CHANNEL_PORT",
    "DEFAULT_STAGING_BYTES", "DEFAULT_STORE_CHUNK_TOKENS", "DEFAULT_STORE_LOCAL_CPU_BYTES",
    "DEFAULT_STORE_TTL_SECONDS", "Derive", "KNOWN_KEYS", "LOAD_FAILURE_POLICIES",
    "MAX_DECODE_PIPELINE_GROUPS", "MAX_LEASE_SECONDS", "MAX_LEASE_TOKEN_CHARS",
    "MAX_MAX_PEERS", "MAX_TP_SIZE", "MIN_AUTH_TOKEN_CHARS", "MIN_BUFFER_BYTES", "MIN_LEASE_SECONDS",
    "REDIS_URL", "SAVE_SCHEDULES", "STORE_NAME_RE", "STORE_URL_SCHEMES", "TRANSPORTS",
    "default_advertise_host", "read_auth_token_file",
]


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
#: An engine's TP size as the params and the side channel accept it (a decode rank plans a load
#: over the prefill engine's ranks)
MAX_TP_SIZE = 1024
#: A lease's first claim or heartbeat: the decode engine's first heartbeat goes out well within
#: the minimum (receiver_heartbeats.FIRST_HEARTBEAT_S)
MIN_CLAIM_TIMEOUT_SECONDS = 2.0
DEFAULT_CLAIM_TIMEOUT_SECONDS = 10.0
DEFAULT_LEASE_MAX_SECONDS = 120.0
DEFAULT_MAX_PEERS = 64
MAX_MAX_PEERS = 4096
MIN_AUTH_TOKEN_CHARS = 8
SAVE_SCHEDULES = ("layerwise", "after_forward")


def default_advertise_host() -> str:
    """The address peers should use when none is configured: loopback (one-machine setups)."""
    return "127.0.0.1"


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
        "Codec preset of the staged chunks (`turbowire presets` lists them: " + PRESET_LIST
        + "). Both engines must use the same preset (checked at the handshake). An MLA "
        "model's latent takes the preset's key stream (`k16v4` keeps it raw).",
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
        Seconds(MIN_CLAIM_TIMEOUT_SECONDS),
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
        "decode_tp_size",
        Int(0, MAX_TP_SIZE, " (0: this engine's TP size)"),
        "On a prefill engine: the TP size of the decode engines that read it, when larger than "
        "this engine's. Each staged chunk is then cut into one chunk per decode rank's KV heads, "
        "so a decode rank reads only its heads' bytes (without it, each decode rank reads the "
        "prefill rank's whole chunks: the wire carries D TP / P TP times the KV). Decode "
        "engines of any TP size still read it. `0`: this engine's TP size (chunks not cut).",
        default=0,
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
            ((is_ip_address, "{key}={value!r} must be an IP address such as 0.0.0.0"),),
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
        "recompute_recent_tokens",
        Int(0, 1 << 16),
        "The decode engine recomputes the prompt's last this many tokens instead of loading "
        "them, and the prefill engine leaves them out: the recent window, where a lossy preset "
        "costs the most, is the model's own KV, for this many tokens of prefill on the decode "
        "engine (bench/RESULTS.md, \"Recomputed recent window\"). Set the same value on "
        "both engines. A prompt no longer than this is loaded whole; 0: always.",
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
            ((is_thread_cpus, "{key}={value!r}: use auto, inherit or a CPU list such as 2,3 "
              "or 4-7"),),
        ),
        "Cores of the connector's background threads (NIXL progress and UCX threads, the "
        "worker's thread pool). `auto`: the cores of the engine process that started the worker "
        "(vLLM's EngineCore), so the kernel can move them off the core vLLM binds the worker's "
        "main thread to. `inherit`: vLLM's placement (on CPU engines, the OpenMP master's one "
        "core). A list: those cores. No effect where the platform has no thread affinity.",
        default="auto",
    ),
) + STORE_KEYS  # the store path's keys last (config_store.py)

CONFIG_KEYS_BY_NAME: Mapping[str, ConfigKey] = {k.name: k for k in CONFIG_KEYS}
KNOWN_KEYS = frozenset(CONFIG_KEYS_BY_NAME)
