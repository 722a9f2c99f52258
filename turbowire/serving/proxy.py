"""OpenAI-compatible P/D proxy: prefill on one engine, decode on another (vLLM toy-proxy flow).

For each request: send it to a prefill engine with ``max_tokens=1``, ``stream=False`` and
``kv_transfer_params={"do_remote_decode": true, ...}``; take the ``kv_transfer_params`` of the
answer and send the original request with them to a decode engine; stream (or return) the
decode engine's answer. Engines are picked round-robin; the request id travels as
``X-Request-Id`` to both. The field names are vLLM NixlConnector's, so this proxy also drives
NixlConnector engines and other routers drive turbowire engines.

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
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from turbowire.errors import TurboWireError

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


class ProxyConfigError(TurboWireError, ValueError):
    """Bad proxy arguments (no engines, malformed URLs)."""


@dataclass
class RequestRecord:
    """What the proxy saw of one request (served at /turbowire/requests/{id})."""

    request_id: str
    endpoint: str
    prefill_url: str
    decode_url: str
    stream: bool
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

        from turbowire.metrics_catalog import PROXY_METRICS, REQUEST_BUCKETS

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
                    spec.base_name, spec.help, spec.labels, buckets=REQUEST_BUCKETS,
                    registry=self.registry,
                )
            self._m[spec.name] = metric
        for outcome in ("ok", "prefill_error", "decode_error", "client_error"):
            self._m["turbowire_proxy_requests_total"].labels(outcome=outcome)

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


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill request: same prompt, one token, no streaming, ask P to stage its KV."""
    p = {k: v for k, v in body.items() if k not in DROP_FOR_PREFILL}
    p["kv_transfer_params"] = dict(PREFILL_PARAMS)
    p["max_tokens"] = 1
    if "max_completion_tokens" in p:
        p["max_completion_tokens"] = 1
    p["stream"] = False
    return p


class PDProxy:
    """Round-robin P/D routing with request records and Prometheus metrics."""

    def __init__(
        self,
        prefill_urls: Sequence[str],
        decode_urls: Sequence[str],
        timeout: float = 600.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
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

    async def aclose(self) -> None:
        await asyncio.gather(*(c.aclose() for c in self._clients.values()))

    def _remember(self, rec: RequestRecord) -> None:
        self.records[rec.request_id] = rec
        while len(self.records) > MAX_RECORDS:
            self.records.popitem(last=False)

    async def handle(self, endpoint: str, request: Request) -> Response:
        try:
            body = await request.json()
        except json.JSONDecodeError as exc:
            raise HTTPException(400, f"request body is not JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise HTTPException(400, "request body must be a JSON object")
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        p_url = self.prefill_urls[next(self._p_cycle)]
        d_url = self.decode_urls[next(self._d_cycle)]
        stream = bool(body.get("stream"))
        rec = RequestRecord(request_id, endpoint, p_url, d_url, stream)
        self._remember(rec)
        headers = {"X-Request-Id": request_id}
        auth = request.headers.get("authorization")
        if auth:
            headers["Authorization"] = auth
        self.metrics.in_flight(1)
        t0 = time.perf_counter()
        try:
            p_resp = await self._clients[p_url].post(
                endpoint, json=prefill_body(body), headers=headers
            )
        except httpx.HTTPError as exc:
            return self._error(rec, "prefill_error", 502, f"prefill engine {p_url}: {exc}")
        rec.prefill_seconds = time.perf_counter() - t0
        if p_resp.status_code != 200:
            outcome = "client_error" if 400 <= p_resp.status_code < 500 else "prefill_error"
            return self._error(rec, outcome, p_resp.status_code, p_resp.text, passthrough=True)
        p_json = p_resp.json()
        kv = p_json.get("kv_transfer_params")
        rec.kv_transfer_params = kv
        rec.prompt_tokens = (p_json.get("usage") or {}).get("prompt_tokens")
        d_body = dict(body)
        if kv:
            d_body["kv_transfer_params"] = kv
        else:
            logger.warning(
                "prefill engine %s returned no kv_transfer_params: decode recomputes", p_url
            )
        client = self._clients[d_url]
        if stream:
            return StreamingResponse(
                self._stream(rec, client, endpoint, d_body, headers, t0),
                media_type="text/event-stream",
                headers={"X-Request-Id": request_id},
            )
        t1 = time.perf_counter()
        try:
            d_resp = await client.post(endpoint, json=d_body, headers=headers)
        except httpx.HTTPError as exc:
            return self._error(rec, "decode_error", 502, f"decode engine {d_url}: {exc}")
        now = time.perf_counter()
        if d_resp.status_code != 200:
            return self._error(
                rec, "decode_error", d_resp.status_code, d_resp.text, passthrough=True
            )
        d_json = d_resp.json()
        report = (d_json.get("kv_transfer_params") or {}).get("turbowire_load")
        rec.decode_report = report if isinstance(report, dict) else None
        rec.completion_tokens = (d_json.get("usage") or {}).get("completion_tokens")
        rec.decode_ttft_seconds = None  # not observable without streaming
        rec.total_seconds = now - t0
        rec.outcome = "ok"
        self._done(rec)
        return JSONResponse(
            d_json,
            headers={
                "X-Request-Id": request_id,
                "X-TurboWire-Prefill-Ms": f"{rec.prefill_seconds * 1e3:.1f}",
                "X-TurboWire-Decode-Ms": f"{(now - t1) * 1e3:.1f}",
            },
        )

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
                    usage = json.loads(line[6:]).get("usage")
                except json.JSONDecodeError:
                    continue
                if usage:
                    rec.completion_tokens = usage.get("completion_tokens", rec.completion_tokens)

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
            return Response(message, status_code=status, media_type="application/json")
        return JSONResponse({"error": {"message": message, "type": outcome}}, status_code=status)

    async def health(self) -> tuple[bool, dict[str, str]]:
        async def probe(url: str) -> tuple[str, str]:
            try:
                r = await self._clients[url].get("/health", timeout=5.0)
                return url, "ok" if r.status_code == 200 else f"http {r.status_code}"
            except httpx.HTTPError as exc:
                return url, f"down ({type(exc).__name__})"

        results = dict(await asyncio.gather(*(probe(u) for u in self._clients)))
        return all(v == "ok" for v in results.values()), results


def build_app(
    prefill_urls: Sequence[str],
    decode_urls: Sequence[str],
    timeout: float = 600.0,
    transport: httpx.AsyncBaseTransport | None = None,
) -> FastAPI:
    """The FastAPI app (``turbowire proxy`` serves it with uvicorn)."""
    proxy = PDProxy(prefill_urls, decode_urls, timeout, transport)

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
