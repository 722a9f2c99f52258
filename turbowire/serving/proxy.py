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

Per-request timings (prefill, decode TTFT, KV transfer when the decode engine reports it) go to
Prometheus (``/metrics``, names from ``turbowire.metrics_catalog``) and to
``GET /turbowire/requests/{id}`` (the demo prints them).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from turbowire.errors import TurboWireError
from turbowire.store.keys import DEFAULT_NAMESPACE, StoreScope, chunk_hashes

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
#: prefill kv_transfer_params fields forwarded to decode but never shown in request records
SECRET_KV_FIELDS = frozenset({"turbowire_lease_token"})
#: Largest request body the proxy reads (a 128k-token prompt is ~1 MB as text or token ids);
#: a larger one is refused with 413 before it is parsed. ``--max-body-bytes`` changes it.
DEFAULT_MAX_BODY_BYTES = 16 << 20
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
#: ``pd_no_scope`` (no store engine registered), ``pd_unsupported_prompt`` (batch or embeddings
#: prompt), ``pd_tokenize_error`` (the decode engine's /tokenize failed), ``pd_directory_error``
#: (Redis unreachable or the directory call failed).
ROUTES = (
    "pd", "store_hit", "pd_partial", "pd_miss", "pd_short", "pd_no_scope",
    "pd_unsupported_prompt", "pd_tokenize_error", "pd_directory_error",
)  # fmt: skip
SCOPE_REFRESH_SECONDS = 10.0
EMPTY_REGISTRY_REFRESH_SECONDS = 1.0
TOKENIZE_TIMEOUT_SECONDS = 5.0
#: connector.config.DEFAULT_STORE_TTL_SECONDS (not imported: the proxy does not load the connector)
DIRECTORY_TTL_SECONDS = 3600.0
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
    # kv_transfer_params are the engines' business: a client's own are never forwarded
    body.pop("kv_transfer_params", None)
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
        raise UnsupportedPrompt("prompt_embeds")
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
        try:
            tokens = await self._tokens(endpoint, body, client, headers)
        except UnsupportedPrompt:
            return RouteDecision("pd_unsupported_prompt")
        except Exception as exc:
            self._warn(f"tokenize:{decode_url}", "tokenizing on %s failed, routing P/D: %s",
                       decode_url, exc)
            return RouteDecision("pd_tokenize_error")
        try:
            hashes = chunk_hashes(tokens, scope.chunk_tokens)
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
    ) -> None:
        if max_body_bytes < 1:
            raise ProxyConfigError(f"--max-body-bytes must be positive, got {max_body_bytes}")
        self.max_body_bytes = max_body_bytes
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
        request_id = request_id_from(request.headers.get("x-request-id"))
        d_url = self.decode_urls[next(self._d_cycle)]
        stream = bool(body.get("stream"))
        rec = RequestRecord(request_id, endpoint, None, d_url, stream)
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
        # served at GET /turbowire/requests/{id}: never the lease token, which lets its holder
        # release or extend that request's staging on the prefill engine
        rec.kv_transfer_params = (
            {k: v for k, v in kv.items() if k not in SECRET_KV_FIELDS}
            if isinstance(kv, dict) else kv
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

    def _headers(self, rec: RequestRecord) -> dict[str, str]:
        return {"X-Request-Id": rec.request_id, "X-TurboWire-Route": rec.route}

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
        report = (d_json.get("kv_transfer_params") or {}).get("turbowire_load")
        rec.decode_report = report if isinstance(report, dict) else None
        usage = d_json.get("usage") or {}
        rec.completion_tokens = usage.get("completion_tokens")
        if rec.prompt_tokens is None:
            rec.prompt_tokens = usage.get("prompt_tokens")
        rec.decode_ttft_seconds = None  # not observable without streaming
        rec.total_seconds = now - t0
        rec.outcome = "ok"
        self._done(rec)
        out = self._headers(rec)
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
            yield f"data: {json.dumps({'error': f'decode engine: {exc}'})}\n\n".encode()
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

    ``ttl_seconds`` should be the engines' ``store_ttl_seconds``: a lookup that hits refreshes the
    entries it found to it. Nothing is contacted here: the proxy starts (and serves P/D) while
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
) -> FastAPI:
    """The FastAPI app (``turbowire proxy`` serves it with uvicorn).

    ``directory_url`` turns on cache-aware routing (``directory`` injects a ready directory
    object instead, for tests)."""
    if directory is None and directory_url:
        directory = open_directory(directory_url, directory_ttl_seconds)
    proxy = PDProxy(
        prefill_urls, decode_urls, timeout, transport, directory, store_namespace, max_body_bytes
    )

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await proxy.aclose()

    app = FastAPI(title="turbowire P/D proxy", lifespan=lifespan)
    app.state.proxy = proxy

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy.handle("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await proxy.handle("/v1/chat/completions", request)

    @app.get("/v1/models")
    async def models() -> Response:
        r = await proxy._clients[proxy.decode_urls[0]].get("/v1/models")
        return Response(r.content, status_code=r.status_code, media_type="application/json")

    @app.get("/health")
    async def health() -> Response:
        ok, engines = await proxy.health()
        return JSONResponse({"status": "ok" if ok else "degraded", "engines": engines},
                            status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(proxy.metrics.exposition(), media_type="text/plain; version=0.0.4")

    @app.get("/turbowire/requests/{request_id}")
    async def request_record(request_id: str) -> Response:
        rec = proxy.records.get(request_id)
        if rec is None:
            raise HTTPException(
                404, f"no record of request {request_id} (kept: last {MAX_RECORDS})"
            )
        return JSONResponse(asdict(rec))

    return app
