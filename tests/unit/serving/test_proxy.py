"""Proxy logic against fake engines (httpx MockTransport): the two-step P/D flow, NixlConnector
field names, round robin, request ids, streaming, errors, health and metrics; cache-aware routing
against a fake store directory (decode only when the whole prompt prefix is stored, P/D on any
miss or failure). These tests run the proxy with ``expose_internals`` to read routes and records;
what clients see by default, the admin token, tenant salts, LoRA and multimodal requests are
tests/unit/serving/test_proxy_security.py."""

from __future__ import annotations

import json

import httpx
import pytest
from fastapi.testclient import TestClient

from turbowire.serving.proxy import (
    ROUTES,
    ProxyConfigError,
    UnsupportedPrompt,
    Visibility,
    prefill_body,
    tokenize_request,
)
from turbowire.serving.proxy import build_app as _build_app
from turbowire.store.directory import DirectoryUnavailable, EngineEntry
from turbowire.store.keys import StoreScope, chunk_hashes

P_URLS = ["http://p0:8100", "http://p1:8100"]
D_URLS = ["http://d0:8200"]
EXPOSED = Visibility(expose_internals=True)
MODELS = {"object": "list", "data": [
    {"id": "m", "object": "model", "root": "/models/m", "parent": None},
    {"id": "tiny", "object": "model", "root": "/models/tiny", "parent": None},
]}


def build_app(*args, **kw):
    """The proxy with its internals shown (route header, records): what these tests read."""
    kw.setdefault("visibility", EXPOSED)
    return _build_app(*args, **kw)


class FakeEngines:
    def __init__(self, prefill_status: int = 200) -> None:
        self.calls: list[tuple[str, str, dict, dict]] = []
        self.prefill_status = prefill_status

    def __call__(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if request.url.path == "/health":
            return httpx.Response(200 if host != "p1" else 500)
        if request.url.path == "/v1/models":
            self.calls.append((host, "/v1/models", {}, dict(request.headers)))
            return httpx.Response(200, json=MODELS)
        body = json.loads(request.content)
        self.calls.append((host, request.url.path, body, dict(request.headers)))
        if host.startswith("p"):
            if self.prefill_status != 200:
                return httpx.Response(self.prefill_status, json={"error": "bad prompt"})
            return httpx.Response(200, json={
                "choices": [{"text": "x"}],
                "usage": {"prompt_tokens": 7, "completion_tokens": 1},
                "kv_transfer_params": {
                    "do_remote_prefill": True, "do_remote_decode": False,
                    "remote_engine_id": f"eng-{host}", "remote_request_id": "r1",
                    "remote_host": "127.0.0.1", "remote_port": 5700,
                    "remote_block_ids": [0], "remote_num_tokens": 7, "tp_size": 1,
                    "turbowire_lease_token": "ab" * 16,
                },
            })
        if body.get("stream"):
            sse = b'data: {"choices":[{"text":"he"}]}\n\ndata: {"choices":[{"text":"llo"}]}\n\n'
            return httpx.Response(200, content=sse + b"data: [DONE]\n\n",
                                  headers={"content-type": "text/event-stream"})
        return httpx.Response(200, json={
            "choices": [{"text": "hello"}],
            "usage": {"prompt_tokens": 7, "completion_tokens": 2},
            "kv_transfer_params": {"turbowire_load": {"transfer_ms": 3.5, "wire_bytes": 100}},
        })


@pytest.fixture
def engines():
    return FakeEngines()


@pytest.fixture
def client(engines):
    app = build_app(P_URLS, D_URLS, transport=httpx.MockTransport(engines))
    with TestClient(app) as c:
        yield c


def test_prefill_body_follows_toy_proxy():
    body = prefill_body({"prompt": "hi", "max_tokens": 50, "stream": True,
                         "stream_options": {"include_usage": True}, "min_tokens": 3,
                         "max_completion_tokens": 50})
    assert body["max_tokens"] == 1 and body["max_completion_tokens"] == 1
    assert body["stream"] is False
    assert "stream_options" not in body and "min_tokens" not in body
    kv = body["kv_transfer_params"]
    assert kv["do_remote_decode"] is True and kv["do_remote_prefill"] is False
    assert kv["remote_engine_id"] is None and kv["remote_block_ids"] is None


def test_two_step_flow_round_robin_and_request_id(client, engines):
    for i in range(2):
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5},
                        headers={"X-Request-Id": f"req-{i}"})
        assert r.status_code == 200
        assert r.json()["choices"][0]["text"] == "hello"
        assert r.headers["x-request-id"] == f"req-{i}"
    hosts = [c[0] for c in engines.calls]
    assert hosts == ["p0", "d0", "p1", "d0"]
    for host, _, body, headers in engines.calls:
        assert headers["x-request-id"] in ("req-0", "req-1")
        if host == "d0":
            assert body["max_tokens"] == 5
            assert body["kv_transfer_params"]["remote_engine_id"].startswith("eng-p")
    rec = client.get("/turbowire/requests/req-0").json()
    assert rec["outcome"] == "ok" and rec["prompt_tokens"] == 7
    assert rec["decode_report"]["transfer_ms"] == 3.5
    assert rec["kv_transfer_params"]["remote_num_tokens"] == 7
    assert client.get("/turbowire/requests/nope").status_code == 404


def test_lease_token_reaches_decode_but_not_the_request_records(client, engines):
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5},
                    headers={"X-Request-Id": "tok-1"})
    assert r.status_code == 200
    decode = [body for host, _, body, _ in engines.calls if host == "d0"]
    assert decode[-1]["kv_transfer_params"]["turbowire_lease_token"] == "ab" * 16
    rec = client.get("/turbowire/requests/tok-1").json()
    assert "turbowire_lease_token" not in rec["kv_transfer_params"]
    assert rec["kv_transfer_params"]["remote_request_id"] == "r1"


def test_chat_streaming_passthrough(client, engines):
    with client.stream("POST", "/v1/chat/completions",
                       json={"messages": [{"role": "user", "content": "hi"}], "stream": True},
                       headers={"X-Request-Id": "s1"}) as r:
        text = b"".join(r.iter_bytes()).decode()
    assert '"he"' in text and '"llo"' in text and "[DONE]" in text
    assert engines.calls[0][1] == "/v1/chat/completions"
    assert engines.calls[0][2]["stream"] is False and engines.calls[1][2]["stream"] is True
    rec = client.get("/turbowire/requests/s1").json()
    assert rec["outcome"] == "ok" and rec["ttft_seconds"] is not None


def test_prefill_error_is_passed_back():
    engines = FakeEngines(prefill_status=400)
    app = build_app(P_URLS, D_URLS, transport=httpx.MockTransport(engines))
    with TestClient(app) as c:
        r = c.post("/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 400 and "bad prompt" in r.text
        assert all(host.startswith("p") for host, *_ in engines.calls)  # D never called
        metrics = c.get("/metrics").text
        assert 'turbowire_proxy_requests_total{outcome="client_error"} 1.0' in metrics


def test_health_and_metrics(client):
    r = client.get("/health")
    assert r.status_code == 503 and r.json()["engines"]["http://p1:8100"] == "http 500"
    client.post("/v1/completions", json={"prompt": "hi"})
    text = client.get("/metrics").text
    assert 'turbowire_proxy_requests_total{outcome="ok"} 1.0' in text
    assert "turbowire_proxy_prefill_duration_seconds_count 1.0" in text
    assert "turbowire_proxy_kv_transfer_duration_seconds_count 1.0" in text


def test_bad_body_and_bad_urls(client):
    assert client.post("/v1/completions", content=b"not json").status_code == 400
    assert client.post("/v1/completions", json=[1, 2]).status_code == 400
    with pytest.raises(ProxyConfigError, match="at least one --decode"):
        build_app(P_URLS, [])
    with pytest.raises(ProxyConfigError, match="not an http"):
        build_app(["ftp://x"], D_URLS)


# -- cache-aware routing (--directory) ---------------------------------------------------------

CHUNK = 4
SCOPE = StoreScope("turbowire", "Qwen_Qwen3-0.6B", "k8v4", 1, CHUNK, 1)
PROMPT_TOKENS = list(range(100, 110))  # 2 full chunks of 4 + a tail of 2


def entry(engine_id: str, http_url: str | None, scope: StoreScope = SCOPE,
          role: str = "consumer") -> EngineEntry:
    return EngineEntry(engine_id, role, "127.0.0.1:5700", http_url, scope.to_dict(), {}, 1.0)


class FakeDirectory:
    """The Directory calls the proxy makes; ``stored`` = leading chunks reported stored."""

    def __init__(self, stored: int = 0, entries: list[EngineEntry] | None = None,
                 down: bool = False) -> None:
        self.stored = stored
        self.entries = [entry("d0", "http://d0:8200")] if entries is None else entries
        self.down = down
        self.lookups: list[tuple[StoreScope, list[bytes]]] = []
        self.engine_reads = 0
        self.closed = False

    def engines(self, namespace: str) -> list[EngineEntry]:
        self.engine_reads += 1
        if self.down:
            raise DirectoryUnavailable("redis down")
        return [e for e in self.entries if e.scope["namespace"] == namespace]

    def longest_prefix(self, scope: StoreScope, hashes) -> int:
        if self.down:
            raise DirectoryUnavailable("redis down")
        self.lookups.append((scope, list(hashes)))
        return min(self.stored, len(hashes))

    def close(self) -> None:
        self.closed = True


class StoreEngines(FakeEngines):
    """FakeEngines whose decode engines also answer /tokenize."""

    def __init__(self, tokens: list[int] = PROMPT_TOKENS, tokenize_status: int = 200) -> None:
        super().__init__()
        self.tokens = tokens
        self.tokenize_status = tokenize_status

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/tokenize":
            body = json.loads(request.content)
            self.calls.append((request.url.host, "/tokenize", body, dict(request.headers)))
            if self.tokenize_status != 200:
                return httpx.Response(self.tokenize_status, json={"error": "no tokenizer"})
            return httpx.Response(200, json={"count": len(self.tokens), "max_model_len": 4096,
                                             "tokens": self.tokens})
        return super().__call__(request)

    def hosts(self, path: str = "/v1/completions") -> list[str]:
        return [host for host, p, *_ in self.calls if p == path]

    def posts(self) -> list[tuple[str, str]]:
        return [(h, p) for h, p, *_ in self.calls if p != "/v1/models"]


def store_client(engines: FakeEngines, directory: FakeDirectory, **kw) -> TestClient:
    app = build_app(P_URLS, D_URLS, transport=httpx.MockTransport(engines), directory=directory,
                    **kw)
    return TestClient(app)


def routes_metric(text: str, route: str) -> float:
    for line in text.splitlines():
        if line.startswith(f'turbowire_proxy_routes_total{{route="{route}"}}'):
            return float(line.split()[-1])
    raise AssertionError(f"no routes_total sample for {route}")


def test_all_chunks_stored_goes_to_decode_only():
    engines, directory = StoreEngines(), FakeDirectory(stored=2)
    with store_client(engines, directory) as c:
        r = c.post("/v1/completions", json={"model": "m", "prompt": "hello " * 9, "max_tokens": 5,
                                           "kv_transfer_params": {"do_remote_prefill": True}},
                   headers={"X-Request-Id": "hit-1"})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "hello"
        assert r.headers["x-turbowire-route"] == "store_hit"
        assert "x-turbowire-prefill-ms" not in r.headers
        # /tokenize on the decode engine, then the decode engine alone, no kv_transfer_params
        assert engines.posts() == [("d0", "/tokenize"), ("d0", "/v1/completions")]
        (tok_call,) = [c for c in engines.calls if c[1] == "/tokenize"]
        assert tok_call[2] == {"model": "m", "prompt": "hello " * 9}
        assert tok_call[3]["x-request-id"] == "hit-1"
        d_body = engines.calls[-1][2]
        assert "kv_transfer_params" not in d_body and d_body["max_tokens"] == 5
        scope, hashes = directory.lookups[0]
        assert scope == SCOPE and hashes == chunk_hashes(PROMPT_TOKENS, CHUNK)
        rec = c.get("/turbowire/requests/hit-1").json()
        assert rec["route"] == "store_hit" and rec["stored_tokens"] == 8
        assert rec["prefill_url"] is None and rec["outcome"] == "ok"
        assert rec["prompt_tokens"] == len(PROMPT_TOKENS)
        assert rec["directory_lookup_seconds"] >= 0
        text = c.get("/metrics").text
        assert routes_metric(text, "store_hit") == 1.0 and routes_metric(text, "pd_miss") == 0.0
        assert "turbowire_proxy_directory_lookup_duration_seconds_count 1.0" in text
        assert "turbowire_proxy_prefill_duration_seconds_count 0.0" in text
    assert directory.closed


def test_store_hit_streaming():
    engines, directory = StoreEngines(), FakeDirectory(stored=2)
    with store_client(engines, directory) as c, c.stream(
        "POST", "/v1/chat/completions", headers={"X-Request-Id": "hs"},
        json={"messages": [{"role": "user", "content": "hi"}], "stream": True},
    ) as r:
        text = b"".join(r.iter_bytes()).decode()
        assert r.headers["x-turbowire-route"] == "store_hit"
        assert '"llo"' in text
        assert engines.hosts("/v1/chat/completions") == ["d0"]
        rec = c.get("/turbowire/requests/hs").json()
        assert rec["outcome"] == "ok" and rec["ttft_seconds"] is not None


@pytest.mark.parametrize("stored,route", [(1, "pd_partial"), (0, "pd_miss")])
def test_partial_or_no_prefix_runs_pd(stored, route):
    engines, directory = StoreEngines(), FakeDirectory(stored=stored)
    with store_client(engines, directory) as c:
        r = c.post("/v1/completions", json={"prompt": "hi"}, headers={"X-Request-Id": "r"})
        assert r.status_code == 200 and r.headers["x-turbowire-route"] == route
        assert engines.hosts() == ["p0", "d0"]
        assert engines.calls[-1][2]["kv_transfer_params"]["remote_engine_id"] == "eng-p0"
        rec = c.get("/turbowire/requests/r").json()
        assert rec["route"] == route and rec["stored_tokens"] == stored * CHUNK
        assert rec["prefill_url"] == "http://p0:8100"
        assert routes_metric(c.get("/metrics").text, route) == 1.0


def test_prompt_shorter_than_a_chunk_runs_pd_without_lookup():
    engines, directory = StoreEngines(tokens=[1, 2, 3]), FakeDirectory(stored=5)
    with store_client(engines, directory) as c:
        r = c.post("/v1/completions", json={"prompt": "hi"})
        assert r.headers["x-turbowire-route"] == "pd_short"
        assert engines.hosts() == ["p0", "d0"] and directory.lookups == []


def test_directory_down_falls_back_to_pd():
    engines, directory = StoreEngines(), FakeDirectory(stored=2, down=True)
    with store_client(engines, directory) as c:
        for i in range(2):
            r = c.post("/v1/completions", json={"prompt": "hi"}, headers={"X-Request-Id": f"x{i}"})
            assert r.status_code == 200 and r.headers["x-turbowire-route"] == "pd_directory_error"
        assert engines.hosts() == ["p0", "d0", "p1", "d0"]
        assert c.get("/turbowire/requests/x1").json()["route"] == "pd_directory_error"
        text = c.get("/metrics").text
        assert routes_metric(text, "pd_directory_error") == 2.0
        assert "turbowire_proxy_directory_lookup_duration_seconds_count 2.0" in text
        assert 'turbowire_proxy_requests_total{outcome="ok"} 2.0' in text
    # with no scope known yet every request asks (the real Directory's breaker answers at once)
    assert directory.engine_reads == 2


def test_lookup_failing_after_scope_is_known_falls_back():
    engines, directory = StoreEngines(), FakeDirectory(stored=2)
    with store_client(engines, directory) as c:
        assert c.post("/v1/completions", json={"prompt": "a"}).headers["x-turbowire-route"] \
            == "store_hit"
        directory.down = True  # Redis dies: the cached scope stays, the lookup fails fast
        r = c.post("/v1/completions", json={"prompt": "a"})
        assert r.status_code == 200 and r.headers["x-turbowire-route"] == "pd_directory_error"
        assert engines.hosts() == ["d0", "p0", "d0"]


@pytest.mark.parametrize("status", [500, 404])
def test_tokenize_failing_falls_back_to_pd(status):
    engines, directory = StoreEngines(tokenize_status=status), FakeDirectory(stored=2)
    with store_client(engines, directory) as c:
        r = c.post("/v1/completions", json={"prompt": "hi"}, headers={"X-Request-Id": "t"})
        assert r.status_code == 200 and r.headers["x-turbowire-route"] == "pd_tokenize_error"
        assert engines.hosts() == ["p0", "d0"] and directory.lookups == []
        assert c.get("/turbowire/requests/t").json()["route"] == "pd_tokenize_error"


def test_tokenize_unreachable_falls_back_to_pd():
    engines, directory = StoreEngines(), FakeDirectory(stored=2)

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/tokenize":
            raise httpx.ConnectError("refused", request=request)
        return engines(request)

    app = build_app(P_URLS, D_URLS, transport=httpx.MockTransport(handler), directory=directory)
    with TestClient(app) as c:
        r = c.post("/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 200 and r.headers["x-turbowire-route"] == "pd_tokenize_error"


def test_token_id_prompt_is_hashed_without_tokenize():
    engines, directory = StoreEngines(), FakeDirectory(stored=2)
    with store_client(engines, directory) as c:
        for prompt in (PROMPT_TOKENS, [PROMPT_TOKENS]):
            r = c.post("/v1/completions", json={"prompt": prompt})
            assert r.headers["x-turbowire-route"] == "store_hit"
        assert not engines.hosts("/tokenize")
        assert [h for _, h in directory.lookups] == [chunk_hashes(PROMPT_TOKENS, CHUNK)] * 2


@pytest.mark.parametrize("prompt", [["a", "b"], [[1, 2], [3, 4]], None, ""])
def test_batch_and_odd_prompts_run_pd(prompt):
    engines, directory = StoreEngines(), FakeDirectory(stored=2)
    with store_client(engines, directory) as c:
        r = c.post("/v1/completions", json={"prompt": prompt})
        assert r.headers["x-turbowire-route"] == "pd_unsupported_prompt"
        assert engines.hosts() == ["p0", "d0"] and not engines.hosts("/tokenize")


def test_no_registered_scope_runs_pd():
    engines = StoreEngines()
    directory = FakeDirectory(stored=2, entries=[entry("p0", "http://p0:8100", role="producer")])
    with store_client(engines, directory) as c:
        r = c.post("/v1/completions", json={"prompt": "hi"})
        assert r.headers["x-turbowire-route"] == "pd_no_scope"
        assert not engines.hosts("/tokenize") and engines.hosts() == ["p0", "d0"]


def test_no_directory_is_plain_pd(client, engines):
    r = client.post("/v1/completions", json={"prompt": "hi"})
    assert r.headers["x-turbowire-route"] == "pd"
    assert not [c for c in engines.calls if c[1] == "/tokenize"]
    text = client.get("/metrics").text
    assert routes_metric(text, "pd") == 1.0
    assert "turbowire_proxy_directory_lookup_duration_seconds_count 0.0" in text
    for route in ROUTES:
        routes_metric(text, route)  # every route has a (zero) series from the start


def test_scope_of_the_chosen_decode_engine_wins(caplog):
    other = StoreScope("turbowire", "other", "k4v4", 1, 8, 2)
    directory = FakeDirectory(stored=2, entries=[
        entry("a", "http://elsewhere:1", other), entry("b", "http://elsewhere:2", other),
        entry("d0", "http://d0:8200/", SCOPE, role="both"),
    ])
    engines = StoreEngines()
    with store_client(engines, directory) as c, caplog.at_level("WARNING"):
        for _ in range(3):
            c.post("/v1/completions", json={"prompt": "hi"})
    assert [s for s, _ in directory.lookups] == [SCOPE] * 3
    assert sum("disagree on the store scope" in r.message for r in caplog.records) == 1
    assert directory.engine_reads == 1  # cached between refreshes


def test_most_common_scope_when_decode_engine_is_not_registered():
    other = StoreScope("turbowire", "other", "k4v4", 1, 8, 1)
    directory = FakeDirectory(stored=1, entries=[
        entry("a", None, SCOPE), entry("b", "http://x:1", other), entry("c", "http://y:1", other),
    ])
    engines = StoreEngines(tokens=list(range(16)))
    with store_client(engines, directory) as c:
        r = c.post("/v1/completions", json={"prompt": "hi"})
    assert directory.lookups[0][0] == other
    assert r.headers["x-turbowire-route"] == "pd_partial"  # 1 of 2 chunks of 8


def test_scope_registry_is_refreshed(monkeypatch):
    import turbowire.serving.proxy as proxy_mod

    directory = FakeDirectory(stored=2, entries=[])
    engines = StoreEngines()
    app = build_app(P_URLS, D_URLS, transport=httpx.MockTransport(engines), directory=directory)
    router = app.state.proxy.router
    router.refresh_seconds = 0.0
    with TestClient(app) as c:
        assert c.post("/v1/completions", json={"prompt": "a"}).headers["x-turbowire-route"] \
            == "pd_no_scope"
        directory.entries = [entry("d0", "http://d0:8200")]
        assert c.post("/v1/completions", json={"prompt": "a"}).headers["x-turbowire-route"] \
            == "store_hit"
    assert directory.engine_reads == 2
    assert proxy_mod.SCOPE_REFRESH_SECONDS == 10.0


def test_other_namespace_is_not_seen():
    directory = FakeDirectory(stored=2)
    engines = StoreEngines()
    with store_client(engines, directory, store_namespace="prod") as c:
        assert c.post("/v1/completions", json={"prompt": "a"}).headers["x-turbowire-route"] \
            == "pd_no_scope"


def test_store_hit_decode_error_is_reported():
    class Failing(StoreEngines):
        def __call__(self, request):
            if request.url.host == "d0" and request.url.path == "/v1/completions":
                return httpx.Response(400, json={"error": "too long"})
            return super().__call__(request)

    with store_client(Failing(), FakeDirectory(stored=2)) as c:
        r = c.post("/v1/completions", json={"prompt": "a"})
        assert r.status_code == 400 and r.headers["x-turbowire-route"] == "store_hit"
        assert 'turbowire_proxy_requests_total{outcome="client_error"} 1.0' in c.get(
            "/metrics").text


def test_chat_tokenize_body_carries_the_template_fields():
    engines, directory = StoreEngines(), FakeDirectory(stored=2)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    with store_client(engines, directory) as c:
        r = c.post("/v1/chat/completions", json={
            "model": "m", "messages": messages, "max_tokens": 3, "temperature": 0.0,
            "chat_template_kwargs": {"enable_thinking": False}, "tools": [],
        })
        assert r.headers["x-turbowire-route"] == "store_hit"
    (tok,) = [body for _, p, body, _ in engines.calls if p == "/tokenize"]
    assert tok == {"model": "m", "messages": messages, "add_generation_prompt": True,
                   "chat_template_kwargs": {"enable_thinking": False}, "tools": []}


def test_tokenize_request_shapes():
    msgs = [{"role": "user", "content": "hi"}]
    chat = "/v1/chat/completions"
    assert tokenize_request(chat, {"messages": msgs}) == {
        "messages": msgs, "add_generation_prompt": True}
    assert tokenize_request(chat, {"messages": msgs, "add_generation_prompt": False,
                                   "chat_template": "{{x}}", "add_special_tokens": True}) == {
        "messages": msgs, "add_generation_prompt": False, "chat_template": "{{x}}",
        "add_special_tokens": True}
    # continue_final_message: add_generation_prompt left to vLLM's default, as the chat call does
    assert tokenize_request(chat, {"messages": msgs, "continue_final_message": True}) == {
        "messages": msgs, "continue_final_message": True}
    # chat-only template inputs travel in chat_template_kwargs, as vLLM's chat endpoint merges
    got = tokenize_request(chat, {"messages": msgs, "reasoning_effort": "low",
                                  "documents": [{"title": "t", "text": "x"}],
                                  "chat_template_kwargs": {"foo": 1}})
    assert got["chat_template_kwargs"] == {"foo": 1, "reasoning_effort": "low",
                                           "enable_thinking": True,
                                           "documents": [{"title": "t", "text": "x"}]}
    comp = "/v1/completions"
    assert tokenize_request(comp, {"prompt": "x", "max_tokens": 3, "stream": True}) == {
        "prompt": "x"}
    assert tokenize_request(comp, {"prompt": ["x"], "add_special_tokens": False}) == {
        "prompt": "x", "add_special_tokens": False}
    assert tokenize_request(comp, {"prompt": [5, 6]}) == [5, 6]
    for bad in ({"prompt": ["a", "b"]}, {"prompt": [True, 1]}, {"prompt_embeds": "..."}, {}):
        with pytest.raises(UnsupportedPrompt):
            tokenize_request(comp, bad)
    with pytest.raises(UnsupportedPrompt):
        tokenize_request(chat, {"messages": "hi"})


def test_bad_directory_url():
    with pytest.raises(ProxyConfigError, match="--directory"):
        build_app(P_URLS, D_URLS, directory_url="http://redis:6379")


def test_an_empty_registry_is_read_again_soon(monkeypatch):
    """No store engine registered yet (or Redis just restarted, empty): the next engine that
    registers is seen within EMPTY_REGISTRY_REFRESH_SECONDS, not the full refresh period."""
    import turbowire.serving.proxy as proxy_mod

    monkeypatch.setattr(proxy_mod, "EMPTY_REGISTRY_REFRESH_SECONDS", 0.0)
    directory = FakeDirectory(stored=2, entries=[])
    engines = StoreEngines()
    app = build_app(P_URLS, D_URLS, transport=httpx.MockTransport(engines), directory=directory)
    assert app.state.proxy.router.refresh_seconds == proxy_mod.SCOPE_REFRESH_SECONDS
    with TestClient(app) as c:
        assert c.post("/v1/completions", json={"prompt": "a"}).headers["x-turbowire-route"] \
            == "pd_no_scope"
        directory.entries = [entry("d0", "http://d0:8200")]
        assert c.post("/v1/completions", json={"prompt": "a"}).headers["x-turbowire-route"] \
            == "store_hit"
        assert c.post("/v1/completions", json={"prompt": "a"}).headers["x-turbowire-route"] \
            == "store_hit"
    assert directory.engine_reads == 2, "a non-empty registry is cached for the full period"


def test_oversized_body_is_refused_before_reaching_an_engine(engines):
    app = build_app(P_URLS, D_URLS, transport=httpx.MockTransport(engines), max_body_bytes=1000)
    with TestClient(app) as c:
        big = {"prompt": "x" * 2000, "max_tokens": 5}
        r = c.post("/v1/completions", json=big)
        assert r.status_code == 413 and "--max-body-bytes" in r.json()["detail"]

        def chunked():  # no content-length: the cap applies while reading
            yield b'{"prompt": "'
            for _ in range(20):
                yield b"y" * 100
            yield b'"}'

        r = c.post("/v1/completions", content=chunked(),
                   headers={"content-type": "application/json"})
        assert r.status_code == 413
        assert c.post("/v1/completions", json={"prompt": "ok"}).status_code == 200
    assert [call[0] for call in engines.calls] == ["p0", "d0"]  # only the small one went out


def test_max_body_bytes_must_be_positive():
    with pytest.raises(ProxyConfigError, match="--max-body-bytes"):
        build_app(P_URLS, D_URLS, max_body_bytes=0)


def test_client_kv_transfer_params_never_reach_an_engine(client, engines):
    injected = {"do_remote_prefill": True, "remote_host": "10.6.6.6", "remote_port": 1,
                "remote_block_ids": [0, 0, 0], "remote_num_tokens": 1 << 30}
    r = client.post("/v1/completions",
                    json={"prompt": "hi", "max_tokens": 5, "kv_transfer_params": injected})
    assert r.status_code == 200
    (p_call, d_call) = engines.calls
    assert p_call[2]["kv_transfer_params"]["do_remote_decode"] is True
    assert "remote_host" not in json.dumps(p_call[2]["kv_transfer_params"]).replace(
        '"remote_host": null', "")
    assert d_call[2]["kv_transfer_params"]["remote_host"] == "127.0.0.1"  # the prefill's own
    assert d_call[2]["kv_transfer_params"]["remote_num_tokens"] == 7


@pytest.mark.parametrize("given,kept", [
    ("req-1.a:b_c", True), ("x" * 129, False), ("a b", False), ("../../etc", False),
    ("id%2F", False),
])
def test_request_id_header_is_kept_only_when_plain(client, engines, given, kept):
    r = client.post("/v1/completions", json={"prompt": "hi"},
                    headers={"X-Request-Id": given})
    assert r.status_code == 200
    sent = engines.calls[0][3]["x-request-id"]
    assert (sent == given) is kept
    assert len(sent) <= 128 and sent == engines.calls[1][3]["x-request-id"]
