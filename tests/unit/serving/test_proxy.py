"""Proxy logic against fake engines (httpx MockTransport): the two-step P/D flow, NixlConnector
field names, round robin, request ids, streaming, errors, health and metrics."""

from __future__ import annotations

import json

import httpx
import pytest
from fastapi.testclient import TestClient

from turbowire.serving.proxy import ProxyConfigError, build_app, prefill_body

P_URLS = ["http://p0:8100", "http://p1:8100"]
D_URLS = ["http://d0:8200"]


class FakeEngines:
    def __init__(self, prefill_status: int = 200) -> None:
        self.calls: list[tuple[str, str, dict, dict]] = []
        self.prefill_status = prefill_status

    def __call__(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if request.url.path == "/health":
            return httpx.Response(200 if host != "p1" else 500)
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
