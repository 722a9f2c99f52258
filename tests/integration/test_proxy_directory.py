"""Cache-aware routing of the P/D proxy against a real redis-server and the real Directory.

Why: the routing decision depends on what an engine actually wrote into Redis (chunk entries per
TP rank, its registration), and the proxy's promise that a dead Redis never fails a request is
about how redis-py and the directory's circuit breaker behave. The engines are httpx fakes (no
vLLM here): they answer /tokenize with fixed token ids and completions like vLLM does.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import pytest
from fastapi.testclient import TestClient
from support.redis_server import RedisServer

from turbowire.serving.proxy import Visibility, build_app
from turbowire.store.directory import Directory, EngineEntry
from turbowire.store.keys import StoreScope, chunk_hashes

#: these tests read the route header and records (off by default: test_proxy_security.py)
EXPOSED = Visibility(expose_internals=True)

pytestmark = pytest.mark.integration

NS = "twproxy"
SCOPE = StoreScope(NS, "Qwen_Qwen3-0.6B", "k8v4", 1, 256, 2)
P_URL, D_URL = "http://p0:8100", "http://d0:8200"
#: prompt text -> the token ids the fake decode engine's /tokenize answers
TOKENS = {
    "all stored": list(range(1000, 1600)),  # 2 full chunks + 88 tail tokens
    "half stored": list(range(2000, 2600)),
    "nothing stored": list(range(3000, 3600)),
    "short": list(range(4000, 4100)),
}


class Engines:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, dict]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        host, path = request.url.host, request.url.path
        if path == "/health":
            return httpx.Response(200)
        if path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m", "parent": None}]})
        body = json.loads(request.content)
        self.calls.append((host, path, body))
        if path == "/tokenize":
            assert host == "d0"
            tokens = TOKENS[body["prompt"]]
            return httpx.Response(200, json={"count": len(tokens), "max_model_len": 4096,
                                             "tokens": tokens})
        if host == "p0":
            return httpx.Response(200, json={
                "choices": [{"text": "x"}], "usage": {"prompt_tokens": 600},
                "kv_transfer_params": {"do_remote_prefill": True, "remote_engine_id": "p0",
                                       "remote_block_ids": [0], "remote_host": "127.0.0.1",
                                       "remote_port": 5700},
            })
        return httpx.Response(200, json={"choices": [{"text": "hello"}],
                                         "usage": {"prompt_tokens": 600, "completion_tokens": 2}})

    def completions(self) -> list[tuple[str, dict]]:
        out = [(h, b) for h, p, b in self.calls if p == "/v1/completions"]
        self.calls.clear()
        return out


@pytest.fixture
def redis_srv() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


def publish_like_an_engine(url: str) -> Directory:
    """What the engines' store transport writes: registrations and per-rank chunk entries."""
    writer = Directory(url, ttl_seconds=60)
    for engine_id, role, http_url in (("p0", "producer", P_URL), ("d0", "consumer", D_URL)):
        writer.register_engine(EngineEntry(engine_id, role, "127.0.0.1:5700", http_url,
                                           SCOPE.to_dict(), {"format_version": 1}), 60)
    full = chunk_hashes(TOKENS["all stored"], SCOPE.chunk_tokens)
    half = chunk_hashes(TOKENS["half stored"], SCOPE.chunk_tokens)
    assert len(full) == len(half) == 2
    writer.publish(SCOPE, [(h, rank, 10_000) for h in full for rank in range(2)])
    # chunk 1 of "half stored" only on rank 0: not usable by a TP=2 decode engine
    writer.publish(SCOPE, [(half[0], 0, 10_000), (half[0], 1, 10_000), (half[1], 0, 10_000)])
    return writer


def post(c: TestClient, prompt: str, rid: str) -> httpx.Response:
    r = c.post("/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 4},
               headers={"X-Request-Id": rid})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "hello"
    return r


def test_routing_from_a_real_directory_and_redis_death(redis_srv: RedisServer) -> None:
    writer = publish_like_an_engine(redis_srv.url)
    engines = Engines()
    app = build_app([P_URL], [D_URL], transport=httpx.MockTransport(engines),
                    directory_url=redis_srv.url, store_namespace=NS, directory_ttl_seconds=60,
                    visibility=EXPOSED)
    with TestClient(app) as c:
        r = post(c, "all stored", "a")
        assert r.headers["x-turbowire-route"] == "store_hit"
        ((host, body),) = engines.completions()
        assert host == "d0" and "kv_transfer_params" not in body
        rec = c.get("/turbowire/requests/a").json()
        assert rec["route"] == "store_hit" and rec["stored_tokens"] == 512
        assert rec["prefill_url"] is None

        for prompt, route, stored in (("half stored", "pd_partial", 256),
                                      ("nothing stored", "pd_miss", 0),
                                      ("short", "pd_short", 0)):
            rid = prompt.replace(" ", "-")  # X-Request-Id: a plain token (spaces are replaced)
            r = post(c, prompt, rid)
            assert r.headers["x-turbowire-route"] == route
            assert [h for h, _ in engines.completions()] == ["p0", "d0"]
            assert c.get(f"/turbowire/requests/{rid}").json()["stored_tokens"] == stored

        # Redis dies: every request still answers 200, through P/D, and fast
        redis_srv.kill()
        for i in range(3):
            t0 = time.monotonic()
            r = post(c, "all stored", f"down-{i}")
            assert time.monotonic() - t0 < 5.0  # 0.25 s socket timeouts, then the breaker
            assert r.headers["x-turbowire-route"] == "pd_directory_error"
            assert [h for h, _ in engines.completions()] == ["p0", "d0"]
        text = c.get("/metrics").text
        assert 'turbowire_proxy_routes_total{route="pd_directory_error"} 3.0' in text
        assert 'turbowire_proxy_routes_total{route="store_hit"} 1.0' in text
        assert 'turbowire_proxy_requests_total{outcome="ok"} 7.0' in text
        assert "turbowire_proxy_directory_lookup_duration_seconds_count 7.0" in text

        # Redis back (empty): once the breaker retries and engines publish again, hits return
        redis_srv.start()
        time.sleep(2.2)  # the directory's retry_seconds (2 s) of both clients
        publish_like_an_engine(redis_srv.url).close()
        r = post(c, "all stored", "again")
        assert r.headers["x-turbowire-route"] == "store_hit"
        assert [h for h, _ in engines.completions()] == ["d0"]
    writer.close()


def test_proxy_starts_and_serves_pd_with_redis_down() -> None:
    server = RedisServer()  # never started: nothing listens on its port
    engines = Engines()
    app = build_app([P_URL], [D_URL], transport=httpx.MockTransport(engines),
                    directory_url=server.url, store_namespace=NS, visibility=EXPOSED)
    with TestClient(app) as c:
        for i in range(2):
            r = post(c, "all stored", f"r{i}")
            assert r.headers["x-turbowire-route"] == "pd_directory_error"
        assert c.get("/health").status_code == 200
    server.cleanup()


def test_proxy_lookups_never_extend_a_stored_chunk(redis_srv: RedisServer) -> None:
    """H4: a client probing prompts through the proxy must not keep another tenant's chunks
    alive: the entries' TTLs only run down however often the proxy looks them up (and hits)."""
    import redis as redis_py

    writer = publish_like_an_engine(redis_srv.url)
    rds = redis_py.Redis.from_url(redis_srv.url)
    keys = [f"{SCOPE.prefix}/{h.hex()}" for h in chunk_hashes(TOKENS["all stored"], 256)]
    app = build_app([P_URL], [D_URL], transport=httpx.MockTransport(Engines()),
                    directory_url=redis_srv.url, store_namespace=NS, visibility=EXPOSED)
    try:
        with TestClient(app) as c:
            before = [rds.pttl(k) for k in keys]
            assert all(0 < t <= 60_000 for t in before)
            time.sleep(0.3)
            for i in range(5):
                r = post(c, "all stored", f"probe-{i}")
                assert r.headers["x-turbowire-route"] == "store_hit"
            after = [rds.pttl(k) for k in keys]
            assert all(a <= b - 250 for a, b in zip(after, before, strict=True)), (before, after)
    finally:
        rds.close()
        writer.close()
