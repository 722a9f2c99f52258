"""llm-d's routing sidecar, ``--kv-connector=nixlv2``, re-done in Python, field for field, so
e2e tests can drive real turbowire engines exactly as that sidecar does, and fail the day
turbowire needs anything the sidecar does not carry.

Source read: github.com/llm-d/llm-d-router (the sidecar's home since it left
llm-d-routing-sidecar and llm-d-inference-scheduler; the image llm-d's guides run,
``ghcr.io/llm-d/llm-d-router-disagg-sidecar:main``, is built from it), commit
ebab687927f5331c1b39defcb579a07951bce56c (2026-08-22), ``pkg/sidecar/proxy/``: ``proxy.go``
(routes, token-limit fields, connector choice), ``chat_completions.go``
(``disaggregatedPrefillHandler``), ``connector_nixlv2.go`` (``handleNIXLV2``),
``proxy_helpers.go`` (reverse proxies, ``readJSONBody``), ``decode.go`` (``dispatchDecode``),
``cached_tokens_usage_rewriter.go``, ``errors.go``, ``options.go`` (defaults), and
``pkg/common/routing/common.go`` (the headers). What it does, and this relay with it:

- Routes: ``POST /v1/chat/completions``, ``/v1/completions`` and ``/v1/messages`` (token limits
  ``max_tokens``, ``max_completion_tokens``, ``min_tokens``), ``POST /v1/responses``
  (``max_output_tokens``), ``POST /inference/v1/generate`` (``max_tokens`` and ``min_tokens``
  inside ``sampling_params``); ``GET /health`` answers 200; every other request is passed to the
  decoder unchanged.
- Headers in: every ``x-prefiller-host-port`` value is read and the header deleted (one value is
  split at commas; the first entry, trimmed, is the prefill ``host:port``, an ``http://`` prefix
  cut); ``x-kv-cache-source-host-port`` and ``x-encoder-hosts-ports`` are deleted too (P2P pulls
  and the encoder stage are off by default). No prefill host: the request goes to the decoder
  untouched (its body bytes as they came).
- The prefill request: the client's body parsed into a ``map[string]any`` (every number a
  float64) with ``kv_transfer_params`` set to ``{"do_remote_decode": true, "do_remote_prefill":
  false, "remote_engine_id": null, "remote_block_ids": null, "remote_host": null,
  "remote_port": null}``, ``stream`` set to false, ``stream_options`` deleted and each token
  limit of the API set to 1, present or not (for generate inside ``sampling_params``, created if
  absent); every other field as the client sent it. The client's headers go along
  (``Authorization`` included) with ``x-request-id: <uuid1>`` added and a reverse proxy's changes
  (hop-by-hop headers dropped, ``X-Forwarded-For`` appended, ``Content-Length`` recomputed).
- The prefill answer is buffered. A status outside 2xx goes back to the client as it is
  (retries on 502/503/504 are off by default: ``--prefill-max-retries 0``). A 2xx answer is
  parsed; its ``kv_transfer_params`` (``null`` when absent) and its
  ``usage.prompt_tokens_details.cached_tokens`` (0 when absent) are kept. Nothing else.
- The decode request: the same map with ``stream`` and ``stream_options`` as the client sent
  them (absent if absent), each token limit as the client sent it (absent if absent; an empty
  ``sampling_params`` the relay created is dropped), and ``kv_transfer_params`` replaced by the
  prefill's; the same ``x-request-id``.
- The decode answer streams back (a reverse proxy flushes event streams at once), through a
  writer that drops ``Content-Length`` and, in every JSON body or SSE ``data:`` line whose
  ``usage`` is an object, sets ``usage.prompt_tokens_details.cached_tokens`` to the prefill's
  count (re-encoded only when that changes something).
- JSON is Go's ``encoding/json``: numbers are float64 (an integer above 2^53 loses its low
  bits), output keys sorted, ``<``, ``>``, ``&``, U+2028 and U+2029 escaped.

Not reproduced (configuration the nixlv2 flow does not need, all off by default or unused on
one host): TLS on any leg (``--secure-proxy``), the SSRF allowlist (``--enable-ssrf-protection``),
prefill retries, prefiller sampling, data-parallel ranks, MoRI-IO write mode, P2P pulls, chunked
decode (``--decode-chunk-size``), the encoder stage (``--ec-connector``), tracing, and Go's
transport asking upstreams for gzip. Client bodies must carry ``Content-Length`` (411
otherwise); methods other than GET and POST get 501.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import math
import threading
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

PREFILL_HEADER = "x-prefiller-host-port"
KV_CACHE_SOURCE_HEADER = "x-kv-cache-source-host-port"
ENCODER_HEADER = "x-encoder-hosts-ports"
REQUEST_ID_HEADER = "X-Request-Id"  # "x-request-id" as Go's Header.Add canonicalizes it
#: ``kv_transfer_params`` of every prefill request (connector_nixlv2.go).
PREFILL_KV_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
#: The token-limit fields per route (proxy.go ``tokenLimitFieldsForAPIType``).
ROUTES: dict[str, tuple[str, ...]] = {
    "/v1/chat/completions": ("max_tokens", "max_completion_tokens", "min_tokens"),
    "/v1/completions": ("max_tokens", "max_completion_tokens", "min_tokens"),
    "/v1/messages": ("max_tokens", "max_completion_tokens", "min_tokens"),
    "/v1/responses": ("max_output_tokens",),
    "/inference/v1/generate": ("max_tokens", "min_tokens"),
}
#: The route whose token limits sit inside ``sampling_params`` (``tokenLimitMap``).
GENERATE_PATH = "/inference/v1/generate"
#: Headers Go's httputil.ReverseProxy never forwards (besides those a Connection header names).
HOP_BY_HOP = frozenset({
    "connection", "proxy-connection", "keep-alive", "proxy-authenticate",
    "proxy-authorization", "te", "trailer", "transfer-encoding", "upgrade",
})
UPSTREAM_TIMEOUT_S = 300.0
#: errors.go ``decoderServiceUnavailableResponseJSON``: the decoder refused the connection.
DECODER_UNAVAILABLE = (
    b'{"object":"error","message":"The decode node is not ready. Please check that the vLLM '
    b'service is running and the port configuration is correct.","type":"ServiceUnavailable",'
    b'"param":"","code":503}'
)

Headers = list[tuple[str, str]]


class GoJSONError(ValueError):
    """A body Go's ``json.Unmarshal`` into ``map[string]any`` refuses."""


# ---- Go's encoding/json --------------------------------------------------------------------------
def _go_number(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise GoJSONError(f"json: cannot unmarshal number {text} into a float64")
    return value


def _no_constant(name: str) -> Any:
    raise GoJSONError(f"invalid character in JSON: {name} is not a JSON value")


def go_loads(data: bytes) -> Any:
    """``json.Unmarshal`` into ``any``: every number becomes a float64 (Python float)."""
    try:
        return json.loads(data.decode("utf-8", "replace"), parse_int=_go_number,
                          parse_float=_go_number, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:
        raise GoJSONError(str(exc)) from exc


def go_object(data: bytes) -> dict[str, Any]:
    """``json.Unmarshal`` into ``map[string]any``: anything but an object is an error."""
    value = go_loads(data)
    if not isinstance(value, dict):
        raise GoJSONError(f"json: cannot unmarshal {type(value).__name__} into a Go map")
    return value


def _go_float(f: float) -> str:
    """``strconv.AppendFloat`` as encoding/json's floatEncoder calls it (shortest digits)."""
    if math.isnan(f) or math.isinf(f):
        raise GoJSONError(f"json: unsupported value: {f!r}")
    a = abs(f)
    if a != 0 and (a < 1e-6 or a >= 1e21):
        s = repr(f)  # Python's shortest repr uses exponent form throughout this range
        if len(s) >= 4 and s[-4] == "e" and s[-3] == "-" and s[-2] == "0":
            s = s[:-2] + s[-1]  # Go cleans e-07 up to e-7
        return s
    s = format(Decimal(repr(f)), "f")
    if "." in s:
        s = s.rstrip("0").rstrip(".")
    return s


_SHORT_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r",
                  "\t": "\\t"}


def _go_string(s: str) -> str:
    out = ['"']
    for ch in s:
        o = ord(ch)
        if 0xD800 <= o <= 0xDFFF:  # a lone surrogate: Go writes the replacement character
            ch, o = "\ufffd", 0xFFFD
        if ch in _SHORT_ESCAPES:
            out.append(_SHORT_ESCAPES[ch])
        elif o < 0x20 or ch in "<>&" or o in (0x2028, 0x2029):
            out.append(f"\\u{o:04x}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def _go_encode(value: Any) -> str:
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return _go_float(value)
    if isinstance(value, str):
        return _go_string(value)
    if isinstance(value, dict):
        keys = sorted(value, key=lambda k: k.encode("utf-8", "surrogatepass"))
        return "{" + ",".join(f"{_go_string(k)}:{_go_encode(value[k])}" for k in keys) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_go_encode(v) for v in value) + "]"
    raise GoJSONError(f"json: unsupported type: {type(value).__name__}")


def go_dumps(value: Any) -> bytes:
    """``json.Marshal``: compact, map keys sorted, HTML characters escaped, Go float format."""
    return _go_encode(value).encode("utf-8")


def go_error(message: str, kind: str, code: int) -> bytes:
    """errors.go ``sendError``: the body of the sidecar's own errors (a Go struct: its fields in
    declaration order, ``param`` an empty string)."""
    return (f'{{"object":"error","message":{_go_string(message)},"type":{_go_string(kind)},'
            f'"param":"","code":{code}}}').encode("utf-8")


# ---- the usage rewriter (cached_tokens_usage_rewriter.go) ----------------------------------------
def _int_value(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return int(value)
    return None


def cached_tokens_of(response: dict[str, Any]) -> int:
    """``usage.prompt_tokens_details.cached_tokens`` of the prefill answer; absent: 0."""
    usage = response.get("usage")
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    value = _int_value(details.get("cached_tokens")) if isinstance(details, dict) else None
    return 0 if value is None else value


def _set_cached_tokens(response: dict[str, Any], cached: int) -> bool:
    usage = response.get("usage")
    if not isinstance(usage, dict):
        return False
    details = usage.get("prompt_tokens_details")
    if not isinstance(details, dict):
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
        return True
    if _int_value(details.get("cached_tokens")) != cached:
        details["cached_tokens"] = cached
        return True
    return False


def rewrite_json(body: bytes, cached: int) -> tuple[bytes, bool]:
    """(body, was JSON): ``usage`` of a JSON object answer carries the prefill's count."""
    if not body.strip():
        return body, False
    try:
        response = go_loads(body)
    except GoJSONError:
        return body, False
    if not isinstance(response, dict) or not _set_cached_tokens(response, cached):
        return body, True
    return go_dumps(response), True


def rewrite_sse_line(line: bytes, cached: int) -> bytes:
    """One SSE line: a ``data: {json}`` line gets the prefill's cached tokens, others pass."""
    trimmed = line.rstrip(b"\r\n")
    ending = line[len(trimmed):]
    if not trimmed.startswith(b"data: "):
        return line
    data = trimmed[len(b"data: "):]
    if data.strip() == b"[DONE]":
        return line
    replaced, is_json = rewrite_json(data, cached)
    return b"data: " + replaced + ending if is_json else line


# ---- the relay -----------------------------------------------------------------------------------
@dataclass
class Exchange:
    """One request the relay sent upstream, and what came back."""

    stage: str  # "prefill", "decode" (P/D), "decoder" (passed through)
    target: str  # host:port
    path: str
    headers: Headers  # as sent, in order
    body: bytes
    status: int = 0
    response_headers: Headers = field(default_factory=list)
    response_body: bytes = b""  # as received from upstream (before any rewrite)

    def json(self) -> dict[str, Any]:
        """The body sent, parsed (plain JSON: exact ints where the engine sees ints)."""
        return json.loads(self.body)

    def response_json(self) -> dict[str, Any]:
        return json.loads(self.response_body)

    def header_names(self) -> set[str]:
        return {k.lower() for k, _ in self.headers}

    def header(self, name: str) -> list[str]:
        return [v for k, v in self.headers if k.lower() == name.lower()]


def _hostport(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname or parts.port is None:
        raise ValueError(f"decoder URL {url!r}: give http://HOST:PORT (the local vLLM engine)")
    return f"{parts.hostname}:{parts.port}"


class SidecarRelay:
    """The sidecar in front of one decoder (``--decoder-url``), on 127.0.0.1, a port of its own
    (bound, never probed). ``exchanges`` records every upstream request in order."""

    def __init__(self, decoder_url: str) -> None:
        self.decoder = _hostport(decoder_url)
        self.exchanges: list[Exchange] = []
        self._lock = threading.Lock()
        relay = self

        class Handler(_Handler):
            pass

        Handler.relay = relay
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def record(self, exchange: Exchange) -> None:
        with self._lock:
            self.exchanges.append(exchange)

    def since(self, mark: int) -> list[Exchange]:
        """Exchanges recorded after ``mark`` (``len(relay.exchanges)`` taken before a request)."""
        with self._lock:
            return list(self.exchanges[mark:])

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def __enter__(self) -> SidecarRelay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _proxied_headers(headers: Headers, host: str, client_ip: str) -> Headers:
    """What httputil.ReverseProxy sends for a request with these headers: hop-by-hop headers
    (and any a Connection header names) dropped, ``Te: trailers`` kept, ``X-Forwarded-For``
    appended, Host as the client gave it, Content-Length left to the body."""
    named = {t.strip().lower() for k, v in headers if k.lower() == "connection"
             for t in v.split(",") if t.strip()}
    te_trailers = any("trailers" in (t.strip().lower() for t in v.split(","))
                      for k, v in headers if k.lower() == "te")
    out: Headers = [("Host", host)]
    prior: list[str] = []
    for k, v in headers:
        low = k.lower()
        if low in HOP_BY_HOP or low in named or low in ("host", "content-length"):
            continue
        if low == "x-forwarded-for":
            prior.append(v)
            continue
        out.append((k, v))
    if te_trailers:
        out.append(("Te", "trailers"))
    out.append(("X-Forwarded-For", ", ".join([*prior, client_ip])))
    return out


def _response_headers(headers: Headers) -> Headers:
    named = {t.strip().lower() for k, v in headers if k.lower() == "connection"
             for t in v.split(",") if t.strip()}
    return [(k, v) for k, v in headers if k.lower() not in HOP_BY_HOP and k.lower() not in named]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    relay: SidecarRelay

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base's name)
        """Quiet: the tests read the exchanges, not an access log."""

    # ---- entry points --------------------------------------------------------------------------
    def do_GET(self) -> None:
        if self._path() == "/health":
            self._send(200, [], b"")
            return
        self._pass_to_decoder("decoder", self._client_headers(), self._read_body() or b"")

    def do_POST(self) -> None:
        body = self._read_body()
        if body is None:
            self._send_error("this relay needs a Content-Length (no chunked bodies)",
                             "BadRequestError", 411)
            return
        headers = self._client_headers()
        fields = ROUTES.get(self._path())
        if fields is None:
            self._pass_to_decoder("decoder", headers, body)
            return
        values = [v for k, v in headers if k.lower() == PREFILL_HEADER]
        dropped = (PREFILL_HEADER, KV_CACHE_SOURCE_HEADER, ENCODER_HEADER)
        headers = [(k, v) for k, v in headers if k.lower() not in dropped]
        if len(values) == 1:
            values = values[0].split(",")
        target = values[0].strip() if values else ""
        if not target:
            self._pass_to_decoder("decoder", headers, body)
            return
        self._nixlv2(headers, body, target.removeprefix("http://"), fields,
                     self._path() == GENERATE_PATH)

    # ---- the nixlv2 protocol (connector_nixlv2.go) -------------------------------------------
    def _nixlv2(self, headers: Headers, original: bytes, target: str,
                fields: Sequence[str], generate: bool) -> None:
        try:
            request = go_object(original)
        except GoJSONError as exc:
            self._send_error(f"invalid JSON: {exc}", "BadRequestError", 400)
            return
        request_id = str(uuid.uuid1())
        stream_ok, stream_value = "stream" in request, request.get("stream")
        options_ok, options_value = "stream_options" in request, request.get("stream_options")
        limits, created = request, False  # tokenLimitMap
        if generate:
            params = request.get("sampling_params")
            if not isinstance(params, dict):
                params, created = {}, True
                request["sampling_params"] = params
            limits = params
        saved = [(f, f in limits, limits.get(f)) for f in fields]

        request["kv_transfer_params"] = dict(PREFILL_KV_PARAMS)
        request["stream"] = False
        request.pop("stream_options", None)
        for f in fields:
            limits[f] = 1
        p_headers = [*headers, (REQUEST_ID_HEADER, request_id)]
        prefill = self._exchange("prefill", target, p_headers, go_dumps(request))
        if not 200 <= prefill.status < 300:  # returned as it is, no decode leg
            self._send(prefill.status, _response_headers(prefill.response_headers),
                       prefill.response_body)
            return
        try:
            answer = go_object(prefill.response_body)
        except GoJSONError as exc:
            self._send_error(str(exc), "BadRequestError", 400)
            return
        kv = answer.get("kv_transfer_params")  # absent: null, as Go's nil any
        cached = cached_tokens_of(answer)

        request.pop("stream", None)
        if stream_ok:
            request["stream"] = stream_value
        if options_ok:
            request["stream_options"] = options_value
        for name, present, value in saved:
            limits.pop(name, None)
            if present:
                limits[name] = value
        if created and not limits:
            request.pop("sampling_params", None)
        request["kv_transfer_params"] = kv
        d_headers = [*headers, (REQUEST_ID_HEADER, request_id)]
        self._stream_from("decode", self.relay.decoder, d_headers, go_dumps(request), cached)

    # ---- upstream calls ---------------------------------------------------------------------
    def _upstream(self, target: str, headers: Headers, body: bytes
                  ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse, Headers]:
        host, _, port = target.rpartition(":")
        conn = http.client.HTTPConnection(host.strip("[]"), int(port), timeout=UPSTREAM_TIMEOUT_S)
        conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
        for k, v in headers:
            conn.putheader(k, v)
        conn.endheaders(body or None)
        resp = conn.getresponse()
        return conn, resp, list(resp.getheaders())

    def _sent_headers(self, headers: Headers, body: bytes) -> Headers:
        """The headers of an upstream request with ``body``, Content-Length last."""
        host = next((v for k, v in self.headers.items() if k.lower() == "host"), self.relay.url)
        out = _proxied_headers(headers, host, self.client_address[0])
        if body or self.command == "POST":
            out.append(("Content-Length", str(len(body))))
        return out

    def _exchange(self, stage: str, target: str, headers: Headers, body: bytes) -> Exchange:
        """A buffered call (the prefill), recorded. An upstream that cannot be reached is a bare
        502, as httputil.ReverseProxy's default error handler writes it."""
        sent = self._sent_headers(headers, body)
        ex = Exchange(stage, target, self.path, sent, body)
        self.relay.record(ex)
        try:
            conn, resp, resp_headers = self._upstream(target, sent, body)
            try:
                ex.response_body = resp.read()
            finally:
                conn.close()
        except (OSError, http.client.HTTPException, ValueError):
            ex.status = 502
            return ex
        ex.status, ex.response_headers = resp.status, resp_headers
        return ex

    def _pass_to_decoder(self, stage: str, headers: Headers, body: bytes) -> None:
        self._stream_from(stage, self.relay.decoder, headers, body, None)

    def _stream_from(self, stage: str, target: str, headers: Headers, body: bytes,
                     cached: int | None) -> None:
        """Relay an upstream answer as it arrives; ``cached`` set: through the usage rewriter
        (the P/D decode leg), else untouched (the decoder passthrough)."""
        sent = self._sent_headers(headers, body)
        ex = Exchange(stage, target, self.path, sent, body)
        self.relay.record(ex)
        try:
            conn, resp, resp_headers = self._upstream(target, sent, body)
        except ConnectionRefusedError:  # createDecoderProxyHandler's ErrorHandler
            self._send(503, [], DECODER_UNAVAILABLE)
            return
        except (OSError, http.client.HTTPException, ValueError) as exc:
            self._send_error(str(exc), "BadGateway", 502)
            return
        ex.status, ex.response_headers = resp.status, resp_headers
        out = _response_headers(resp_headers)
        if cached is not None:
            out = [(k, v) for k, v in out if k.lower() != "content-length"]
        sse = any(k.lower() == "content-type" and "text/event-stream" in v for k, v in out)
        try:
            self.send_response(resp.status)
            for k, v in out:
                if k.lower() not in ("content-length", "date", "server"):
                    self.send_header(k, v)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for piece in self._rewritten(resp, ex, cached, sse):
                if piece:
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                    self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client went away: so does the upstream request
        finally:
            conn.close()

    @staticmethod
    def _rewritten(resp: http.client.HTTPResponse, ex: Exchange, cached: int | None,
                   sse: bool) -> Iterator[bytes]:
        if cached is None:
            while chunk := resp.read1(65536):
                ex.response_body += chunk
                yield chunk
            return
        if not sse:  # a JSON answer: rewritten whole
            ex.response_body = resp.read()
            yield rewrite_json(ex.response_body, cached)[0]
            return
        pending = b""
        while chunk := resp.read1(65536):
            ex.response_body += chunk
            pending += chunk
            lines = pending.split(b"\n")
            pending = lines.pop()
            yield b"".join(rewrite_sse_line(line + b"\n", cached) for line in lines)
        if pending:
            yield rewrite_sse_line(pending, cached)

    # ---- plumbing ---------------------------------------------------------------------------
    def _path(self) -> str:
        return urlsplit(self.path).path

    def _client_headers(self) -> Headers:
        return [(k, v) for k, v in self.headers.items()]

    def _read_body(self) -> bytes | None:
        """The request body; None for a chunked one (not supported here)."""
        if self.headers.get("Transfer-Encoding"):
            return None
        length = self.headers.get("Content-Length")
        return self.rfile.read(int(length)) if length else b""

    def _send(self, status: int, headers: Headers, body: bytes) -> None:
        self.send_response(status)
        for k, v in headers:
            if k.lower() not in ("content-length", "date", "server", "transfer-encoding"):
                self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            self.wfile.write(body)

    def _send_error(self, message: str, kind: str, code: int) -> None:
        self._send(code, [], go_error(message, kind, code))
