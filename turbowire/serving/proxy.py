"""OpenAI-compatible P/D proxy: prefill on one engine, decode on another (vLLM toy-proxy flow).

For each request: send it to a prefill engine with ``max_tokens=1``, ``stream=False`` and
``kv_transfer_params={"do_remote_decode": true, ...}``; take the ``kv_transfer_params`` of the
answer and send the original request with them to a decode engine; stream (or return) the
decode engine's answer. Engines are picked round-robin; the request id travels as
``X-Request-Id`` to both. The field names are vLLM NixlConnector's, so this proxy also drives
NixlConnector engines and other routers drive turbowire engines.

Cache-aware routing (``--directory redis://...``): engines with the store transport save the KV
chunks of every prompt they compute and list them in a Redis directory
(:mod:`turbowire.store.directory`). With a directory, the proxy first asks the chosen decode
engine's own tokenizer (``POST /tokenize``) for the prompt's token ids, names its full chunks
(:func:`turbowire.store.keys.chunk_hashes`) and asks the directory how many leading chunks are
stored. When all of them are, the request goes straight to the decode engine without
``kv_transfer_params`` (it loads the prefix from the store and computes only the tail) and no
prefill engine is used; otherwise the normal P/D flow runs. The directory only ever saves work:
any failure on that path (Redis down, tokenizer error, no registered store scope) is the normal
P/D flow, never an error to the client. The decision is the record's ``route`` and the
``X-TurboWire-Route`` response header.

The lookup names chunks exactly as the engines do (:func:`turbowire.store.keys.chunk_hashes`
under :class:`turbowire.store.keys.ChainInputs`): the body's ``cache_salt`` and, when ``model``
is a LoRA adapter, its name and path (learned from the decode engine's ``/v1/models``, where an
adapter's card has a ``parent``; its ``root`` is the adapter path vLLM keys on). Requests whose
KV depends on what the proxy cannot hash (images, audio, video or embeddings in the prompt) never
take the store route (``pd_unsupported_input``), nor do requests for a model the decode engine
does not list (``pd_unknown_model``).

What clients learn (the store is a prefix cache shared by tenants, so how much of a guessed
prompt is stored must not be observable): the route header, the timing headers, the per-request
records at ``GET /turbowire/requests/{id}`` and the engine list of ``/health`` are served only to
callers presenting the admin token (``X-TurboWire-Admin-Token``, or ``Authorization: Bearer`` on
the proxy's own GET endpoints), or to everyone with ``expose_internals`` (demos, benchmarks on a
trusted host). Records never hold the lease token or the prompt hash (an allowlist of
``kv_transfer_params`` fields). Lookups never refresh a directory entry's TTL (only an engine's
real load does). With a :class:`TenantSalt` the proxy sets each request's ``cache_salt`` to
``HMAC(secret, tenant id, client salt)``: tenants never share KV (neither in vLLM's prefix cache
nor in the store), and no client can name another tenant's salt.

Client bodies never carry transfer params onward: a top-level ``kv_transfer_params`` or
``ec_transfer_params`` is dropped, and one smuggled inside ``vllm_xargs`` (which vLLM copies into
the request without a type check) is refused with HTTP 400 before any engine is asked, on every
route.

Per-request timings (prefill, decode TTFT, KV transfer when the decode engine reports it) go to
Prometheus (``/metrics``, names from ``turbowire.metrics_catalog``) and to the records.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import itertools
import json
import logging
import struct
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from turbowire.connector.config_keys import DEFAULT_STORE_TTL_SECONDS
from turbowire.errors import TurboWireError
from turbowire.store.keys import DEFAULT_NAMESPACE, ChainInputs, StoreScope, chunk_hashes

logger = logging.getLogger(__name__)

PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
DROP_FOR_PREFILL = ("stream_options", "min_tokens")
MAX_RECORDS = 1024
#: The prefill's kv_transfer_params fields a request record shows (an allowlist: never the lease
#: token, the prompt hash, a MAC or whatever secret a later version adds).
RECORD_KV_FIELDS = frozenset({
    "do_remote_prefill", "do_remote_decode", "remote_engine_id", "remote_request_id",
    "remote_host", "remote_port", "remote_num_tokens", "tp_size", "turbowire_preset",
    "turbowire_format_version", "turbowire_dense_bytes", "turbowire_wire_bytes",
})
#: Largest request body the proxy reads (a 128k-token prompt is ~1 MB as text or token ids);
#: a larger one is refused with 413 before it is parsed. ``--max-body-bytes`` changes it. A parsed
#: body holds up to ~5x its size (a list of token ids): with ``--max-concurrency`` requests at
#: once the proxy needs about concurrency x 5 x this much memory at worst.
DEFAULT_MAX_BODY_BYTES = 4 << 20
#: Requests (connections) uvicorn serves at once; beyond it, HTTP 503 (``--max-concurrency``).
DEFAULT_MAX_CONCURRENCY = 512
#: Transfer params a client may smuggle inside ``vllm_xargs`` (vLLM copies them into the
#: request unchecked, as connector/http_guard.py on the engines explains): refused with 400.
SMUGGLED_XARGS = ("kv_transfer_params", "ec_transfer_params")
#: Top-level body fields that are the engines' business: dropped from client bodies.
DROPPED_CLIENT_FIELDS = ("kv_transfer_params", "ec_transfer_params")
#: The header that carries the admin token on any request (Authorization is the engines' key).
ADMIN_TOKEN_HEADER = "x-turbowire-admin-token"
MIN_SECRET_CHARS = 16
MAX_SECRET_CHARS = 4096
#: A tenant id (an API key or a gateway header value) longer than this is refused (401).
MAX_TENANT_ID_CHARS = 4096
#: A client cache_salt the tenant salt is combined with (vLLM allows 128; HMAC takes any).
MAX_CLIENT_SALT_CHARS = 1024
#: The decode engines' /v1/models is re-read this often (LoRA adapters loaded at run time), and
#: at most every MODELS_MISS_REFRESH_SECONDS when a request names a model not listed.
MODELS_REFRESH_SECONDS = 30.0
MODELS_MISS_REFRESH_SECONDS = 2.0
MAX_MODEL_CARDS = 4096
MAX_MODEL_ID_CHARS = 1024
#: A client's ``X-Request-Id`` travels to both engines (vLLM names the request after it); one
#: that is too long or holds other characters is replaced by a fresh id.
_REQUEST_ID_CHARS = frozenset(
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.:"
)
MAX_REQUEST_ID_CHARS = 128

#: Routing decisions (the ``route`` label, the record's ``route``, ``X-TurboWire-Route``).
#: ``pd``: no directory configured; ``store_hit``: every full chunk of the prompt is stored, decode
#: engine only; the other ``pd_*`` ran the normal P/D flow because of what the lookup found:
#: ``pd_partial`` (some leading chunks stored), ``pd_miss`` (none), ``pd_short`` (no full chunk),
#: ``pd_no_scope`` (no store engine registered), ``pd_unsupported_prompt`` (a batch, or no prompt
#: string or token ids), ``pd_unsupported_input`` (images, audio, video or embeddings in the
#: prompt: KV keyed on inputs the proxy cannot hash), ``pd_unknown_model`` (the decode engine's
#: /v1/models does not list the model, or could not be read), ``pd_tokenize_error`` (the decode
#: engine's /tokenize failed), ``pd_directory_error`` (Redis unreachable or the directory call
#: failed).
ROUTES = (
    "pd", "store_hit", "pd_partial", "pd_miss", "pd_short", "pd_no_scope",
    "pd_unsupported_prompt", "pd_unsupported_input", "pd_unknown_model", "pd_tokenize_error",
    "pd_directory_error",
)  # fmt: skip
SCOPE_REFRESH_SECONDS = 10.0
EMPTY_REGISTRY_REFRESH_SECONDS = 1.0
TOKENIZE_TIMEOUT_SECONDS = 5.0
#: the store's TTL default, from the connector's key table (a light module: no vLLM)
DIRECTORY_TTL_SECONDS = DEFAULT_STORE_TTL_SECONDS
_WARN_EVERY_SECONDS = 30.0


class ProxyConfigError(TurboWireError, ValueError):
    """Bad proxy arguments (no engines, malformed URLs)."""


@dataclass
class RequestRecord:
    """What the proxy saw of one request (served at /turbowire/requests/{id})."""

    request_id: str
    endpoint: str
    prefill_url: str | None  # None when no prefill engine was used (route store_hit)
    decode_url: str
    stream: bool
    route: str = "pd"
    #: Tokens of the prompt's leading chunks found in the store (None: not looked up).
    stored_tokens: int | None = None
    directory_lookup_seconds: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    prefill_seconds: float | None = None
    decode_ttft_seconds: float | None = None
    ttft_seconds: float | None = None
    total_seconds: float | None = None
    kv_transfer_params: dict[str, Any] | None = None
    decode_report: dict[str, Any] | None = None
    outcome: str = "in_flight"
    started: float = field(default_factory=time.time)
    #: whether the client may see the route (not served: a property of the caller)
    expose: bool = field(default=False, repr=False)


class _Metrics:
    """Proxy series from the metrics catalog, in a registry of their own."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        from turbowire.metrics_catalog import DURATION_BUCKETS, PROXY_METRICS, REQUEST_BUCKETS

        # a directory lookup takes about a millisecond: request buckets start at 5 ms
        buckets = {"turbowire_proxy_directory_lookup_duration_seconds": DURATION_BUCKETS}

        self.registry = CollectorRegistry()
        self._m: dict[str, Any] = {}
        for spec in PROXY_METRICS:
            if spec.type == "counter":
                metric: Any = Counter(
                    spec.base_name, spec.help, spec.labels, registry=self.registry
                )
            elif spec.type == "gauge":
                metric = Gauge(spec.base_name, spec.help, spec.labels, registry=self.registry)
            else:
                metric = Histogram(
                    spec.base_name, spec.help, spec.labels,
                    buckets=buckets.get(spec.name, REQUEST_BUCKETS), registry=self.registry,
                )
            self._m[spec.name] = metric
        for outcome in ("ok", "prefill_error", "decode_error", "client_error"):
            self._m["turbowire_proxy_requests_total"].labels(outcome=outcome)
        for route in ROUTES:
            self._m["turbowire_proxy_routes_total"].labels(route=route)

    def route(self, route: str, lookup_seconds: float | None) -> None:
        self._m["turbowire_proxy_routes_total"].labels(route=route).inc()
        if lookup_seconds is not None:
            self._m["turbowire_proxy_directory_lookup_duration_seconds"].observe(lookup_seconds)

    def in_flight(self, delta: int) -> None:
        self._m["turbowire_proxy_in_flight_requests"].inc(delta)

    def finish(self, rec: RequestRecord) -> None:
        self._m["turbowire_proxy_requests_total"].labels(outcome=rec.outcome).inc()
        pairs = (
            ("turbowire_proxy_ttft_seconds", rec.ttft_seconds),
            ("turbowire_proxy_prefill_duration_seconds", rec.prefill_seconds),
            ("turbowire_proxy_decode_ttft_seconds", rec.decode_ttft_seconds),
            ("turbowire_proxy_request_duration_seconds", rec.total_seconds),
        )
        for name, value in pairs:
            if value is not None:
                self._m[name].observe(value)
        transfer_ms = (rec.decode_report or {}).get("transfer_ms")
        if isinstance(transfer_ms, (int, float)):
            self._m["turbowire_proxy_kv_transfer_duration_seconds"].observe(transfer_ms / 1e3)
            if rec.decode_ttft_seconds is not None:
                self._m["turbowire_proxy_first_decode_duration_seconds"].observe(
                    max(0.0, rec.decode_ttft_seconds - transfer_ms / 1e3)
                )

    def exposition(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


def _check_urls(kind: str, urls: Sequence[str]) -> list[str]:
    if not urls:
        raise ProxyConfigError(f"give at least one --{kind} URL such as http://127.0.0.1:8100")
    out = []
    for url in urls:
        parsed = httpx.URL(url)
        if parsed.scheme not in ("http", "https") or not parsed.host:
            raise ProxyConfigError(f"--{kind} {url!r} is not an http(s) URL with a host")
        out.append(str(url).rstrip("/"))
    return out


def request_id_from(header: str | None) -> str:
    """The client's ``X-Request-Id`` when it is a short plain token, else a fresh one."""
    if (
        header
        and len(header) <= MAX_REQUEST_ID_CHARS
        and all(c in _REQUEST_ID_CHARS for c in header)
    ):
        return header
    return uuid.uuid4().hex


async def read_json_body(request: Request, max_bytes: int) -> dict[str, Any]:
    """The request's JSON object, read up to ``max_bytes`` (413 past it, 400 if not JSON)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise HTTPException(413, f"request body is {declared} bytes; the proxy accepts at most "
                                 f"{max_bytes} (--max-body-bytes)")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise HTTPException(413, f"request body is over {max_bytes} bytes, the most the "
                                     "proxy accepts (--max-body-bytes)")
        chunks.append(chunk)
    try:
        body = json.loads(b"".join(chunks))
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError, ...
        raise HTTPException(400, f"request body is not JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise HTTPException(400, "request body must be a JSON object")
    # transfer params are the engines' business: a client's own are never forwarded
    for name in DROPPED_CLIENT_FIELDS:
        body.pop(name, None)
    xargs = body.get("vllm_xargs")
    if isinstance(xargs, dict):
        for name in SMUGGLED_XARGS:
            if name in xargs:
                raise HTTPException(400, f"vllm_xargs.{name} is not accepted: transfer params "
                                         "are set by the proxy, never by a client")
    if body.get("stream_options") is not None and body.get("stream") is not True:
        # vLLM refuses this on the decode request only (the prefill request drops
        # stream_options), after the prefill engine staged the prompt: refuse it before either
        raise HTTPException(400, "stream_options can only be set if stream is true")
    return body


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill request: same prompt, one token, no streaming, ask P to stage its KV."""
    p = {k: v for k, v in body.items() if k not in DROP_FOR_PREFILL}
    p["kv_transfer_params"] = dict(PREFILL_PARAMS)
    p["max_tokens"] = 1
    if "max_completion_tokens" in p:
        p["max_completion_tokens"] = 1
    p["stream"] = False
    return p


class UnsupportedPrompt(TurboWireError, ValueError):
    """A prompt the proxy does not look up (a batch, embeddings): it goes the normal P/D way."""


class UnknownModel(TurboWireError, ValueError):
    """The decode engine does not list the request's model (or its list could not be read): the
    proxy cannot tell which adapter's keys to look up."""


class UnsupportedInput(UnsupportedPrompt):
    """A prompt whose KV depends on inputs the proxy cannot hash as the engines do (images,
    audio, video, embeddings): it never takes the store route."""


#: Chat content part types that carry text only (vllm/renderers/chat_utils.py
#: ``_TEXT_CONTENT_PART_TYPES``); any other type, or a part with one of the media keys, is
#: multimodal (vLLM's ``has_non_text_content`` rule).
TEXT_PART_TYPES = frozenset({"text", "input_text", "output_text", "refusal", "thinking",
                             "tool_reference"})
MEDIA_PART_KEYS = frozenset({
    "input_image", "image_url", "image_embeds", "audio_embeds", "video_embeds", "prompt_embeds",
    "image_pil", "audio_url", "input_audio", "video_url",
})


def unsupported_input(endpoint: str, body: dict[str, Any]) -> str | None:
    """What in ``body`` the store keys cannot name (vLLM keys it by hashes the proxy does not
    have), or None for a text-only prompt."""
    if body.get("prompt_embeds") is not None:
        return "prompt_embeds"
    if endpoint != "/v1/chat/completions":
        return None
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None
    for msg in messages:
        content = msg.get("content") if isinstance(msg, dict) else None
        if not isinstance(content, list):
            continue
        for part in content:
            if isinstance(part, str):
                continue
            if not isinstance(part, dict):
                return "a content part that is not text"
            kind = part.get("type", "text")
            if not isinstance(kind, str) or kind not in TEXT_PART_TYPES or any(
                    key in part for key in MEDIA_PART_KEYS):
                return f"a {str(kind)[:40]!r} content part"
    return None


# -- who sees what -----------------------------------------------------------------------------


def _check_secret(what: str, secret: str) -> str:
    secret = secret.strip()
    if not MIN_SECRET_CHARS <= len(secret) <= MAX_SECRET_CHARS:
        raise ProxyConfigError(f"{what} must be {MIN_SECRET_CHARS}-{MAX_SECRET_CHARS} characters "
                               f"(got {len(secret)})")
    if any(not c.isprintable() or c.isspace() for c in secret):
        raise ProxyConfigError(f"{what} must be printable characters without spaces")
    return secret


def bearer_token(value: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header value, else None."""
    if not value or len(value) > MAX_TENANT_ID_CHARS + 16:
        return None
    scheme, _, token = value.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token or any(c.isspace() for c in token):
        return None
    return token


@dataclass(frozen=True)
class Visibility:
    """Who sees the proxy's internals (route and timing headers, request records, /health's
    engine list): callers with the admin token, or everyone with ``expose_internals``."""

    admin_token: str | None = None
    expose_internals: bool = False
    protect_metrics: bool = False  # /metrics only with the admin token

    def __post_init__(self) -> None:
        if self.admin_token is not None:
            object.__setattr__(self, "admin_token", _check_secret("the admin token",
                                                                  self.admin_token))
        if self.protect_metrics and self.admin_token is None:
            raise ProxyConfigError("--protect-metrics needs an admin token (--admin-token-file "
                                   "or TURBOWIRE_PROXY_ADMIN_TOKEN)")

    def is_admin(self, headers: Any, *, allow_bearer: bool = False) -> bool:
        """Whether the request presents the admin token (constant-time compare); on the
        proxy's own GET endpoints ``Authorization: Bearer`` carries it too (Prometheus)."""
        if self.admin_token is None:
            return False
        expected = self.admin_token.encode()
        given = headers.get(ADMIN_TOKEN_HEADER)
        if given is not None and hmac.compare_digest(given.encode(errors="replace"), expected):
            return True
        if allow_bearer:
            token = bearer_token(headers.get("authorization"))
            return token is not None and hmac.compare_digest(token.encode(errors="replace"),
                                                             expected)
        return False

    def sees_internals(self, headers: Any, *, allow_bearer: bool = False) -> bool:
        return self.expose_internals or self.is_admin(headers, allow_bearer=allow_bearer)


#: What a tenant salt is derived from: the caller's API key, or a header a gateway sets.
TENANT_SOURCES = ("api-key", "header")
_HEADER_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789-_")
_TENANT_SALT_TAG = b"turbowire/tenant-salt/v1"


def _lp(data: bytes) -> bytes:
    return struct.pack("<I", len(data)) + data


@dataclass(frozen=True)
class TenantSalt:
    """Per-tenant ``cache_salt``: ``tw1`` + HMAC-SHA256(secret, tenant id, client salt) in hex
    (67 characters: within vLLM's 128 and free of its forbidden characters). A tenant's own
    salts stay apart from each other, and no client can produce another tenant's salt without
    the secret."""

    source: str  # "api-key" or "header"
    header: str | None
    secret: bytes

    @classmethod
    def parse(cls, spec: str, secret: str) -> TenantSalt:
        """``spec`` is ``api-key`` (the ``Authorization: Bearer`` token names the tenant) or
        ``header:NAME`` (a header a trusted gateway sets, e.g. ``header:X-Tenant-Id``)."""
        if not isinstance(spec, str):
            raise ProxyConfigError("--tenant-salt-from must be api-key or header:NAME")
        kind, _, name = spec.strip().partition(":")
        kind = kind.strip().lower()
        header = None
        if kind == "header":
            header = name.strip().lower()
            if not header or len(header) > 64 or not set(header) <= _HEADER_NAME_CHARS \
                    or header in ("authorization", ADMIN_TOKEN_HEADER, "content-length"):
                raise ProxyConfigError(f"--tenant-salt-from {spec!r}: name a header such as "
                                       "header:X-Tenant-Id (letters, digits, - and _)")
        elif kind != "api-key" or name:
            raise ProxyConfigError(f"--tenant-salt-from {spec!r}: use api-key or header:NAME")
        return cls(kind, header, _check_secret("the tenant salt secret", secret).encode())

    def tenant_of(self, headers: Any) -> str | None:
        """The tenant id the request presents, or None (the request is refused)."""
        if self.source == "api-key":
            value = bearer_token(headers.get("authorization"))
        else:
            assert self.header is not None
            value = headers.get(self.header)
            value = value.strip() if isinstance(value, str) else None
        if not value or len(value) > MAX_TENANT_ID_CHARS or not value.isprintable():
            return None
        return value

    def salt(self, tenant: str, client_salt: str | None) -> str:
        data = _TENANT_SALT_TAG + _lp(tenant.encode("utf-8", "surrogatepass"))
        if client_salt is not None:
            data += b"\x01" + _lp(client_salt.encode("utf-8", "surrogatepass"))
        return "tw1" + hmac.new(self.secret, data, hashlib.sha256).hexdigest()

    def __repr__(self) -> str:  # never the secret
        return f"TenantSalt(source={self.source!r}, header={self.header!r})"


def apply_tenant_salt(salt: TenantSalt, body: dict[str, Any], headers: Any) -> None:
    """Set ``body["cache_salt"]`` to the caller's tenant salt (401 without a tenant id, 400 for
    a client salt that is not a short non-empty string)."""
    tenant = salt.tenant_of(headers)
    if tenant is None:
        what = "an Authorization: Bearer API key" if salt.source == "api-key" else \
            f"the {salt.header} header"
        raise HTTPException(401, f"this proxy keeps tenants apart: send {what}")
    client = body.get("cache_salt")
    if client is not None and (not isinstance(client, str) or not client
                               or len(client) > MAX_CLIENT_SALT_CHARS):
        raise HTTPException(400, "cache_salt must be a non-empty string of at most "
                                 f"{MAX_CLIENT_SALT_CHARS} characters")
    body["cache_salt"] = salt.salt(tenant, client)


# -- LoRA adapters from /v1/models -------------------------------------------------------------


@dataclass(frozen=True)
class ModelCard:
    """One entry of an engine's /v1/models: a base model (``lora_path`` None) or a LoRA adapter
    (vLLM lists adapters with a ``parent``; ``root`` is the adapter path it keys KV on)."""

    name: str
    lora_path: str | None


def parse_model_list(payload: Any) -> dict[str, ModelCard]:
    """The cards of a /v1/models answer by name; malformed cards are skipped, and an answer that
    is not an OpenAI model list is refused (ValueError)."""
    data = payload.get("data") if isinstance(payload, dict) else None
    if not isinstance(data, list):
        raise ValueError("not a model list (no data array)")
    out: dict[str, ModelCard] = {}
    for card in data[:MAX_MODEL_CARDS]:
        if not isinstance(card, dict):
            continue
        name, parent, root = card.get("id"), card.get("parent"), card.get("root")
        if not isinstance(name, str) or not 0 < len(name) <= MAX_MODEL_ID_CHARS:
            continue
        if parent is None:
            out.setdefault(name, ModelCard(name, None))
        elif isinstance(parent, str) and isinstance(root, str) and root \
                and len(root) <= MAX_MODEL_ID_CHARS:
            out[name] = ModelCard(name, root)
    return out


def record_view(rec: RequestRecord) -> dict[str, Any]:
    """A record as served: the prefill params reduced to :data:`RECORD_KV_FIELDS`."""
    out = asdict(rec)
    out.pop("expose", None)
    kv = out.get("kv_transfer_params")
    if isinstance(kv, dict):
        out["kv_transfer_params"] = {k: v for k, v in kv.items() if k in RECORD_KV_FIELDS}
    return out


#: Chat request fields that shape the prompt's tokens and that vLLM's /tokenize accepts as well
#: (vllm.entrypoints.serve.tokenize.protocol.TokenizeChatRequest).
_CHAT_TOKENIZE_FIELDS = (
    "add_generation_prompt", "continue_final_message", "add_special_tokens", "chat_template",
    "mm_processor_kwargs", "media_io_kwargs", "tools",
)  # fmt: skip


def _is_token_ids(value: Any) -> bool:
    return (
        isinstance(value, list) and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )  # fmt: skip


def tokenize_request(endpoint: str, body: dict[str, Any]) -> dict[str, Any] | list[int]:
    """What to send to the engine's ``POST /tokenize`` for this request, or the prompt's token
    ids when the request already carries them.

    The body renders the prompt the way the completion request will: for chat, the same messages,
    template and template arguments (``add_generation_prompt`` true by default as in vLLM; the
    chat endpoint's ``documents`` and ``reasoning_effort``, which /tokenize has no fields for, go
    into ``chat_template_kwargs`` exactly as vLLM's chat endpoint merges them). A mismatch could
    only cost a store hit: the decode engine hashes its own tokens and loads only chunks that
    match them.
    """
    model = body.get("model")
    out: dict[str, Any] = {"model": model} if isinstance(model, str) else {}
    if endpoint == "/v1/chat/completions":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise UnsupportedPrompt("chat request without a messages list")
        out["messages"] = messages
        for name in _CHAT_TOKENIZE_FIELDS:
            if body.get(name) is not None:
                out[name] = body[name]
        if not body.get("continue_final_message"):
            out.setdefault("add_generation_prompt", True)
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise UnsupportedPrompt("chat_template_kwargs is not an object")
        kwargs = dict(kwargs)
        effort = body.get("reasoning_effort")
        extra = {"documents": body.get("documents"), "reasoning_effort": effort}
        if effort is not None and "enable_thinking" not in kwargs:
            extra["enable_thinking"] = effort != "none"
        kwargs.update({k: v for k, v in extra.items() if v is not None})
        if kwargs:
            out["chat_template_kwargs"] = kwargs
        return out
    if body.get("prompt_embeds") is not None:
        raise UnsupportedInput("prompt_embeds")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if _is_token_ids(prompt):
        return list(prompt)
    if not isinstance(prompt, str) or not prompt:
        raise UnsupportedPrompt("prompt is not one string or one list of token ids")
    out["prompt"] = prompt
    if body.get("add_special_tokens") is not None:
        out["add_special_tokens"] = body["add_special_tokens"]
    return out


@dataclass
class RouteDecision:
    """The outcome of one store lookup."""

    route: str
    stored_tokens: int | None = None
    prompt_tokens: int | None = None
    seconds: float | None = None


class StoreRouter:
    """Decides store_hit vs P/D from the Redis directory (one per proxy).

    ``directory`` is a :class:`turbowire.store.directory.Directory` (or anything with its
    ``engines`` and ``longest_prefix``); its calls are blocking redis-py calls, made in a thread.
    The store scope (model, preset, format, chunk size, TP) comes from the engines' registrations,
    refreshed every ``refresh_seconds``.
    """

    def __init__(
        self,
        directory: Any,
        namespace: str = DEFAULT_NAMESPACE,
        *,
        refresh_seconds: float = SCOPE_REFRESH_SECONDS,
        tokenize_timeout: float = TOKENIZE_TIMEOUT_SECONDS,
    ) -> None:
        self.directory = directory
        self.namespace = namespace
        self.refresh_seconds = refresh_seconds
        self.tokenize_timeout = tokenize_timeout
        #: (http_url or None, scope) of each registered store consumer, newest registry read.
        self._scopes: list[tuple[str | None, StoreScope]] | None = None
        self._scopes_at = -float("inf")
        self._lock = asyncio.Lock()
        self._warned_disagreement: set[frozenset[StoreScope]] = set()
        self._warned_at: dict[str, float] = {}
        #: per decode engine URL: (read at, its model cards); one read at a time per URL
        self._models: dict[str, tuple[float, dict[str, ModelCard]]] = {}
        self._models_locks: dict[str, asyncio.Lock] = {}

    def _warn(self, key: str, msg: str, *args: Any) -> None:
        """A warning at most every 30 s per kind (Redis down would otherwise log every request)."""
        now = time.monotonic()
        if now - self._warned_at.get(key, -float("inf")) >= _WARN_EVERY_SECONDS:
            self._warned_at[key] = now
            logger.warning(msg, *args)

    def _fresh(self) -> bool:
        """A registry read is reused for ``refresh_seconds``; an empty one only briefly, so the
        first engine that registers (or re-registers after a Redis restart) is seen at once."""
        if self._scopes is None:
            return False
        age = time.monotonic() - self._scopes_at
        if self._scopes:
            return age < self.refresh_seconds
        return age < min(self.refresh_seconds, EMPTY_REGISTRY_REFRESH_SECONDS)

    async def _registered(self) -> list[tuple[str | None, StoreScope]]:
        """The registered store consumers, re-read when older than ``refresh_seconds``.

        When the registry cannot be read the previous list is kept until the next refresh (the
        lookup then fails fast and is counted as a directory error); with no previous list the
        error is raised, and the next request tries again (the directory's circuit breaker keeps
        that from touching the network while Redis is down).
        """
        if self._fresh():
            return self._scopes  # type: ignore[return-value]
        async with self._lock:
            if self._fresh():
                return self._scopes  # type: ignore[return-value]
            try:
                entries = await asyncio.to_thread(self.directory.engines, self.namespace)
            except Exception:
                if self._scopes is None:
                    raise
                self._scopes_at = time.monotonic()
                return self._scopes
            scopes: list[tuple[str | None, StoreScope]] = []
            for entry in entries:
                role = str(getattr(entry, "role", "")).removeprefix("kv_")
                scope = getattr(entry, "scope", None)
                if role not in ("consumer", "both") or not scope:
                    continue
                try:
                    parsed = StoreScope.from_dict(scope)
                except TurboWireError as exc:
                    self._warn(f"scope:{entry.engine_id}", "engine %s: %s", entry.engine_id, exc)
                    continue
                url = entry.http_url.rstrip("/") if entry.http_url else None
                scopes.append((url, parsed))
            self._scopes, self._scopes_at = scopes, time.monotonic()
            return scopes

    async def scope_for(self, decode_url: str) -> StoreScope | None:
        """The store scope to look up for a request decoded on ``decode_url``: that engine's when
        it is registered, else the most common one (None when no store consumer is registered)."""
        scopes = await self._registered()
        if not scopes:
            return None
        distinct = frozenset(s for _, s in scopes)
        if len(distinct) > 1 and distinct not in self._warned_disagreement:
            self._warned_disagreement.add(distinct)
            logger.warning(
                "store engines registered in namespace %r disagree on the store scope (%s): "
                "lookups use the decode engine's scope, or the most common one",
                self.namespace, ", ".join(sorted(s.prefix for s in distinct)),
            )
        url = decode_url.rstrip("/")
        for engine_url, scope in scopes:
            if engine_url == url:
                return scope
        return Counter(s for _, s in scopes).most_common(1)[0][0]

    async def _model_cards(self, client: httpx.AsyncClient, url: str, headers: dict[str, str],
                           want: str | None) -> dict[str, ModelCard]:
        """The decode engine's model cards, re-read after ``MODELS_REFRESH_SECONDS`` (or after
        ``MODELS_MISS_REFRESH_SECONDS`` when ``want`` is not among them)."""
        def fresh() -> dict[str, ModelCard] | None:
            at, cards = self._models.get(url, (-float("inf"), {}))
            age = time.monotonic() - at
            if age < MODELS_REFRESH_SECONDS and (want is None or want in cards
                                                 or age < MODELS_MISS_REFRESH_SECONDS):
                return cards
            return None

        cards = fresh()
        if cards is not None:
            return cards
        lock = self._models_locks.setdefault(url, asyncio.Lock())
        async with lock:
            cards = fresh()
            if cards is not None:
                return cards
            auth = {k: v for k, v in headers.items() if k.lower() == "authorization"}
            r = await client.get("/v1/models", headers=auth, timeout=self.tokenize_timeout)
            if r.status_code != 200:
                raise ValueError(f"/v1/models answered {r.status_code}")
            cards = parse_model_list(r.json())
            self._models[url] = (time.monotonic(), cards)
            return cards

    async def chain_inputs(self, body: dict[str, Any], client: httpx.AsyncClient, url: str,
                           headers: dict[str, str]) -> ChainInputs:
        """The key inputs of a request as the engine will see them: the body's ``cache_salt``
        and, for a LoRA model, the adapter's name and path (from the engine's /v1/models).
        Raises UnknownModel for a model the engine does not list."""
        salt = body.get("cache_salt")
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise UnsupportedPrompt("cache_salt is not a non-empty string")
        model = body.get("model")
        if model is None:
            return ChainInputs(cache_salt=salt)  # vLLM serves its base model
        if not isinstance(model, str):
            raise UnknownModel("model is not a string")
        try:
            cards = await self._model_cards(client, url, headers, model)
        except (httpx.HTTPError, ValueError, RecursionError) as exc:
            raise UnknownModel(f"reading /v1/models of {url}: {exc}") from exc
        card = cards.get(model)
        if card is None:
            raise UnknownModel(f"{url} does not serve model {model[:80]!r}")
        if card.lora_path is None:
            return ChainInputs(cache_salt=salt)
        return ChainInputs(cache_salt=salt, lora_name=card.name, lora_path=card.lora_path)

    async def _tokens(
        self, endpoint: str, body: dict[str, Any], client: httpx.AsyncClient,
        headers: dict[str, str],
    ) -> list[int]:
        req = tokenize_request(endpoint, body)
        if isinstance(req, list):
            return req
        r = await client.post("/tokenize", json=req, headers=headers, timeout=self.tokenize_timeout)
        if r.status_code != 200:
            raise ValueError(f"/tokenize answered {r.status_code}: {r.text[:200]}")
        tokens = r.json().get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise ValueError("/tokenize answer has no token id list")
        return tokens

    async def decide(
        self, endpoint: str, body: dict[str, Any], client: httpx.AsyncClient, decode_url: str,
        headers: dict[str, str],
    ) -> RouteDecision:
        """Never raises: every failure is a ``pd_*`` route."""
        t0 = time.perf_counter()
        decision = await self._decide(endpoint, body, client, decode_url, headers)
        decision.seconds = time.perf_counter() - t0
        return decision

    async def _decide(
        self, endpoint: str, body: dict[str, Any], client: httpx.AsyncClient, decode_url: str,
        headers: dict[str, str],
    ) -> RouteDecision:
        try:
            scope = await self.scope_for(decode_url)
        except Exception as exc:
            self._warn("directory", "store directory unreachable, routing P/D: %s", exc)
            return RouteDecision("pd_directory_error")
        if scope is None:
            self._warn("no_scope", "no store engine registered in namespace %r: routing P/D",
                       self.namespace)
            return RouteDecision("pd_no_scope")
        if unsupported_input(endpoint, body) is not None:
            return RouteDecision("pd_unsupported_input")
        try:
            inputs = await self.chain_inputs(body, client, decode_url, headers)
        except UnknownModel as exc:
            self._warn(f"model:{decode_url}", "no store route for this model, routing P/D: %s",
                       exc)
            return RouteDecision("pd_unknown_model")
        except UnsupportedPrompt:
            return RouteDecision("pd_unsupported_prompt")
        try:
            tokens = await self._tokens(endpoint, body, client, headers)
        except UnsupportedInput:
            return RouteDecision("pd_unsupported_input")
        except UnsupportedPrompt:
            return RouteDecision("pd_unsupported_prompt")
        except Exception as exc:
            self._warn(f"tokenize:{decode_url}", "tokenizing on %s failed, routing P/D: %s",
                       decode_url, exc)
            return RouteDecision("pd_tokenize_error")
        try:
            hashes = chunk_hashes(tokens, scope.chunk_tokens, inputs=inputs)
        except TurboWireError:
            return RouteDecision("pd_unsupported_prompt", prompt_tokens=len(tokens))
        if not hashes:
            return RouteDecision("pd_short", 0, len(tokens))
        try:
            stored = int(await asyncio.to_thread(self.directory.longest_prefix, scope, hashes))
        except Exception as exc:
            self._warn("directory", "store directory lookup failed, routing P/D: %s", exc)
            return RouteDecision("pd_directory_error", prompt_tokens=len(tokens))
        stored = max(0, min(stored, len(hashes)))
        route = "store_hit" if stored == len(hashes) else "pd_partial" if stored else "pd_miss"
        return RouteDecision(route, stored * scope.chunk_tokens, len(tokens))

    async def aclose(self) -> None:
        close = getattr(self.directory, "close", None)
        if close is not None:
            await asyncio.to_thread(close)


class PDProxy:
    """Round-robin P/D routing with request records and Prometheus metrics; with a store
    directory, requests whose whole prompt prefix is stored skip prefill (see the module doc)."""

    def __init__(
        self,
        prefill_urls: Sequence[str],
        decode_urls: Sequence[str],
        timeout: float = 600.0,
        transport: httpx.AsyncBaseTransport | None = None,
        directory: Any | None = None,
        store_namespace: str = DEFAULT_NAMESPACE,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        visibility: Visibility | None = None,
        tenant_salt: TenantSalt | None = None,
    ) -> None:
        if max_body_bytes < 1:
            raise ProxyConfigError(f"--max-body-bytes must be positive, got {max_body_bytes}")
        self.max_body_bytes = max_body_bytes
        self.visibility = visibility or Visibility()
        self.tenant_salt = tenant_salt
        self.prefill_urls = _check_urls("prefill", prefill_urls)
        self.decode_urls = _check_urls("decode", decode_urls)
        self._p_cycle = itertools.cycle(range(len(self.prefill_urls)))
        self._d_cycle = itertools.cycle(range(len(self.decode_urls)))
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
        self._timeout = httpx.Timeout(timeout, connect=10.0)
        self._clients = {
            url: httpx.AsyncClient(
                base_url=url, timeout=self._timeout, limits=limits, transport=transport
            )
            for url in dict.fromkeys(self.prefill_urls + self.decode_urls)
        }
        self.records: OrderedDict[str, RequestRecord] = OrderedDict()
        self.metrics = _Metrics()
        self.router = StoreRouter(directory, store_namespace) if directory is not None else None

    async def aclose(self) -> None:
        await asyncio.gather(*(c.aclose() for c in self._clients.values()))
        if self.router is not None:
            await self.router.aclose()

    def _remember(self, rec: RequestRecord) -> None:
        self.records[rec.request_id] = rec
        while len(self.records) > MAX_RECORDS:
            self.records.popitem(last=False)

    async def _route(
        self, rec: RequestRecord, endpoint: str, body: dict[str, Any], headers: dict[str, str]
    ) -> None:
        if self.router is None:
            self.metrics.route("pd", None)
            return
        try:
            decision = await self.router.decide(
                endpoint, body, self._clients[rec.decode_url], rec.decode_url, headers
            )
        except Exception:  # decide() does not raise; never fail a request over the directory
            logger.exception("request %s: store lookup failed, routing P/D", rec.request_id)
            decision = RouteDecision("pd_directory_error")
        rec.route = decision.route
        rec.stored_tokens = decision.stored_tokens
        rec.directory_lookup_seconds = decision.seconds
        if decision.prompt_tokens is not None:
            rec.prompt_tokens = decision.prompt_tokens
        self.metrics.route(decision.route, decision.seconds)

    async def handle(self, endpoint: str, request: Request) -> Response:
        body = await read_json_body(request, self.max_body_bytes)
        if self.tenant_salt is not None:
            apply_tenant_salt(self.tenant_salt, body, request.headers)
        request_id = request_id_from(request.headers.get("x-request-id"))
        d_url = self.decode_urls[next(self._d_cycle)]
        stream = bool(body.get("stream"))
        rec = RequestRecord(request_id, endpoint, None, d_url, stream)
        rec.expose = self.visibility.sees_internals(request.headers)
        self._remember(rec)
        headers = {"X-Request-Id": request_id}
        auth = request.headers.get("authorization")
        if auth:
            headers["Authorization"] = auth
        self.metrics.in_flight(1)
        t0 = time.perf_counter()
        await self._route(rec, endpoint, body, headers)
        if rec.route == "store_hit":
            # the decode engine finds the prefix in the store itself: no prefill, no params
            return await self._decode(rec, endpoint, dict(body), headers, t0)
        p_url = self.prefill_urls[next(self._p_cycle)]
        rec.prefill_url = p_url
        tp = time.perf_counter()
        try:
            p_resp = await self._clients[p_url].post(
                endpoint, json=prefill_body(body), headers=headers
            )
        except httpx.HTTPError as exc:
            return self._error(rec, "prefill_error", 502, f"prefill engine {p_url}: {exc}")
        rec.prefill_seconds = time.perf_counter() - tp
        if p_resp.status_code != 200:
            outcome = "client_error" if 400 <= p_resp.status_code < 500 else "prefill_error"
            return self._error(rec, outcome, p_resp.status_code, p_resp.text, passthrough=True)
        p_json = p_resp.json()
        kv = p_json.get("kv_transfer_params")
        # served at GET /turbowire/requests/{id}: only RECORD_KV_FIELDS, never the lease token
        # (it releases or extends the staging) nor the prompt hash
        rec.kv_transfer_params = (
            {k: v for k, v in kv.items() if k in RECORD_KV_FIELDS} if isinstance(kv, dict)
            else None
        )
        rec.prompt_tokens = (p_json.get("usage") or {}).get("prompt_tokens", rec.prompt_tokens)
        d_body = dict(body)
        if kv:
            d_body["kv_transfer_params"] = kv
        else:
            logger.warning(
                "prefill engine %s returned no kv_transfer_params: decode recomputes", p_url
            )
        return await self._decode(rec, endpoint, d_body, headers, t0)

    @staticmethod
    def _headers(rec: RequestRecord) -> dict[str, str]:
        """The response headers: the route only for callers who may see internals."""
        out = {"X-Request-Id": rec.request_id}
        if rec.expose:
            out["X-TurboWire-Route"] = rec.route
        return out

    async def _decode(
        self, rec: RequestRecord, endpoint: str, d_body: dict[str, Any],
        headers: dict[str, str], t0: float,
    ) -> Response:
        client = self._clients[rec.decode_url]
        if rec.stream:
            return StreamingResponse(
                self._stream(rec, client, endpoint, d_body, headers, t0),
                media_type="text/event-stream",
                headers=self._headers(rec),
            )
        t1 = time.perf_counter()
        try:
            d_resp = await client.post(endpoint, json=d_body, headers=headers)
        except httpx.HTTPError as exc:
            return self._error(rec, "decode_error", 502, f"decode engine {rec.decode_url}: {exc}")
        now = time.perf_counter()
        if d_resp.status_code != 200:
            outcome = (
                "client_error"
                if rec.prefill_url is None and 400 <= d_resp.status_code < 500
                else "decode_error"
            )  # without a prefill step, the decode engine is the first to judge the request
            return self._error(rec, outcome, d_resp.status_code, d_resp.text, passthrough=True)
        d_json = d_resp.json()
        kv_out = d_json.get("kv_transfer_params") if isinstance(d_json, dict) else None
        report = kv_out.get("turbowire_load") if isinstance(kv_out, dict) else None
        rec.decode_report = report if isinstance(report, dict) else None
        if not rec.expose and isinstance(d_json, dict):
            # the decode engine's load report says whether (and how much of) the prompt came
            # from the store: the same oracle as the route header
            d_json.pop("kv_transfer_params", None)
        usage = (d_json.get("usage") if isinstance(d_json, dict) else None) or {}
        rec.completion_tokens = usage.get("completion_tokens")
        if rec.prompt_tokens is None:
            rec.prompt_tokens = usage.get("prompt_tokens")
        rec.decode_ttft_seconds = None  # not observable without streaming
        rec.total_seconds = now - t0
        rec.outcome = "ok"
        self._done(rec)
        out = self._headers(rec)
        if rec.expose:  # the timings tell a store hit (no prefill) from P/D as well
            if rec.prefill_seconds is not None:
                out["X-TurboWire-Prefill-Ms"] = f"{rec.prefill_seconds * 1e3:.1f}"
            out["X-TurboWire-Decode-Ms"] = f"{(now - t1) * 1e3:.1f}"
        return JSONResponse(d_json, headers=out)

    async def _stream(
        self,
        rec: RequestRecord,
        client: httpx.AsyncClient,
        endpoint: str,
        d_body: dict[str, Any],
        headers: dict[str, str],
        t0: float,
    ) -> AsyncIterator[bytes]:
        t1 = time.perf_counter()
        first = True
        try:
            async with client.stream("POST", endpoint, json=d_body, headers=headers) as resp:
                if resp.status_code != 200:
                    text = (await resp.aread()).decode(errors="replace")
                    rec.outcome = "decode_error"
                    yield (
                        f"data: {json.dumps({'error': text, 'status': resp.status_code})}\n\n"
                    ).encode()
                    return
                async for chunk in resp.aiter_bytes():
                    if first and chunk.strip():
                        now = time.perf_counter()
                        rec.decode_ttft_seconds = now - t1
                        rec.ttft_seconds = now - t0
                        first = False
                    self._scan_usage(rec, chunk)
                    yield chunk
            rec.outcome = "ok"
        except httpx.HTTPError as exc:
            rec.outcome = "decode_error"
            logger.warning("request %s: decode stream failed: %s", rec.request_id, exc)
            detail = f"decode engine: {exc}" if rec.expose else "decode engine failed"
            yield f"data: {json.dumps({'error': detail})}\n\n".encode()
        finally:
            rec.total_seconds = time.perf_counter() - t0
            if rec.outcome == "in_flight":
                rec.outcome = "client_error"  # the client went away mid-stream
            self._done(rec)

    @staticmethod
    def _scan_usage(rec: RequestRecord, chunk: bytes) -> None:
        """Pick ``usage`` out of SSE chunks when the client asked for stream_options usage."""
        if b'"usage"' not in chunk:
            return
        for line in chunk.split(b"\n"):
            if line.startswith(b"data: {"):
                try:
                    payload = json.loads(line[6:])
                except (ValueError, RecursionError):  # a line cut by the chunking, or junk
                    continue
                usage = payload.get("usage") if isinstance(payload, dict) else None
                if isinstance(usage, dict):
                    tokens = usage.get("completion_tokens")
                    if isinstance(tokens, int) and not isinstance(tokens, bool):
                        rec.completion_tokens = tokens

    def _done(self, rec: RequestRecord) -> None:
        self.metrics.in_flight(-1)
        self.metrics.finish(rec)

    def _error(
        self, rec: RequestRecord, outcome: str, status: int, message: str, passthrough: bool = False
    ) -> Response:
        rec.outcome = outcome
        self._done(rec)
        logger.warning("request %s: %s (%d): %s", rec.request_id, outcome, status, message[:300])
        if not passthrough and not rec.expose:  # engine URLs and errors stay in the log
            message = f"{outcome.replace('_', ' ')}: the engine could not be reached"
        if passthrough:
            return Response(
                message, status_code=status, media_type="application/json",
                headers=self._headers(rec),
            )
        return JSONResponse(
            {"error": {"message": message, "type": outcome}}, status_code=status,
            headers=self._headers(rec),
        )

    async def health(self) -> tuple[bool, dict[str, str]]:
        async def probe(url: str) -> tuple[str, str]:
            try:
                r = await self._clients[url].get("/health", timeout=5.0)
                return url, "ok" if r.status_code == 200 else f"http {r.status_code}"
            except httpx.HTTPError as exc:
                return url, f"down ({type(exc).__name__})"

        results = dict(await asyncio.gather(*(probe(u) for u in self._clients)))
        return all(v == "ok" for v in results.values()), results


def open_directory(url: str, ttl_seconds: float = DIRECTORY_TTL_SECONDS) -> Any:
    """The store directory at ``url`` (``redis://HOST:PORT[/DB]`` or ``rediss://``).

    The proxy only reads it (lookups never refresh an entry's TTL), so ``ttl_seconds`` has no
    effect on what is stored. Nothing is contacted here: the proxy starts (and serves P/D) while
    Redis is down."""
    from turbowire.store.directory import Directory

    try:
        return Directory(url, ttl_seconds=ttl_seconds)
    except TurboWireError as exc:
        raise ProxyConfigError(f"--directory: {exc}") from exc


def build_app(
    prefill_urls: Sequence[str],
    decode_urls: Sequence[str],
    timeout: float = 600.0,
    transport: httpx.AsyncBaseTransport | None = None,
    *,
    directory_url: str | None = None,
    store_namespace: str = DEFAULT_NAMESPACE,
    directory_ttl_seconds: float = DIRECTORY_TTL_SECONDS,
    directory: Any | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    visibility: Visibility | None = None,
    tenant_salt: TenantSalt | None = None,
) -> FastAPI:
    """The FastAPI app (``turbowire proxy`` serves it with uvicorn).

    ``directory_url`` turns on cache-aware routing (``directory`` injects a ready directory
    object instead, for tests). ``visibility`` says who sees routes, timings, records and the
    engine list (default: nobody); ``tenant_salt`` salts every request per tenant."""
    if directory is None and directory_url:
        directory = open_directory(directory_url, directory_ttl_seconds)
    visibility = visibility or Visibility()
    proxy = PDProxy(
        prefill_urls, decode_urls, timeout, transport, directory, store_namespace, max_body_bytes,
        visibility, tenant_salt,
    )

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await proxy.aclose()

    app = FastAPI(title="turbowire P/D proxy", lifespan=lifespan)
    app.state.proxy = proxy

    def internals(request: Request) -> bool:
        return visibility.sees_internals(request.headers, allow_bearer=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy.handle("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await proxy.handle("/v1/chat/completions", request)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        auth = request.headers.get("authorization")
        r = await proxy._clients[proxy.decode_urls[0]].get(
            "/v1/models", headers={"Authorization": auth} if auth else None)
        return Response(r.content, status_code=r.status_code, media_type="application/json")

    @app.get("/health")
    async def health(request: Request) -> Response:
        ok, engines = await proxy.health()
        out: dict[str, Any] = {"status": "ok" if ok else "degraded"}
        if internals(request):  # engine URLs and states are internal
            out["engines"] = engines
        return JSONResponse(out, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        if visibility.protect_metrics and not visibility.is_admin(request.headers,
                                                                  allow_bearer=True):
            raise HTTPException(401, "/metrics needs the admin token (--protect-metrics)")
        return Response(proxy.metrics.exposition(), media_type="text/plain; version=0.0.4")

    @app.get("/turbowire/requests/{request_id}")
    async def request_record(request_id: str, request: Request) -> Response:
        if not internals(request):
            if visibility.admin_token is None:
                raise HTTPException(404, "request records are off: start the proxy with "
                                         "--admin-token-file (or --expose-internals)")
            raise HTTPException(401, f"request records need the admin token "
                                     f"({ADMIN_TOKEN_HEADER} or Authorization: Bearer)")
        rec = proxy.records.get(request_id)
        if rec is None:
            raise HTTPException(
                404, f"no record of request {request_id} (kept: last {MAX_RECORDS})"
            )
        return JSONResponse(record_view(rec))

    return app
