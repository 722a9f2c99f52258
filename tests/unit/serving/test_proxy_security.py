"""What the proxy tells clients and what it forwards (issue 33: H2's proxy half, H4, L2), and the
store keys its lookups use (H1): against fake engines (httpx MockTransport) and a fake directory.

- By default no client learns how a request was routed (no route or timing header, no request
  records, no engine list in /health); the admin token (or ``expose_internals``) shows them.
- Records never hold the lease token or the prompt hash.
- Transfer params inside ``vllm_xargs`` are refused with 400 on every route, store hit included,
  before any engine is asked; top-level ones are dropped.
- With a tenant salt every request carries ``cache_salt = HMAC(secret, tenant, client salt)``:
  two tenants never share a salt, a client cannot pick another tenant's, a request without a
  tenant id is refused, and the store lookup hashes under that salt.
- LoRA models are looked up under the adapter's name and path from /v1/models; prompts with
  images or embeddings, and unknown models, never take the store route.
"""

from __future__ import annotations

import json

import httpx
import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from turbowire.serving.proxy import (
    ADMIN_TOKEN_HEADER,
    RECORD_KV_FIELDS,
    ModelCard,
    ProxyConfigError,
    TenantSalt,
    Visibility,
    build_app,
    parse_model_list,
    unsupported_input,
)
from turbowire.store.directory import EngineEntry
from turbowire.store.keys import ChainInputs, StoreScope, chunk_hashes

P_URL, D_URL = "http://p0:8100", "http://d0:8200"
ADMIN = "admin-token-0123456789"
SECRET = "salt-secret-0123456789abcdef"
CHUNK = 4
SCOPE = StoreScope("turbowire", "tiny", "raw", 1, CHUNK, 1, weights="ab" * 8)
TOKENS = list(range(100, 110))  # 2 full chunks
LORA_PATH = "/adapters/lora-a"
MODELS = {"object": "list", "data": [
    {"id": "base", "object": "model", "root": "/models/base", "parent": None},
    {"id": "lora-a", "object": "model", "root": LORA_PATH, "parent": "base"},
]}
PREFILL_PARAMS = {
    "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "eng-p0",
    "remote_request_id": "r1", "remote_host": "10.0.0.1", "remote_port": 5700,
    "remote_block_ids": [0], "remote_num_tokens": 7, "tp_size": 1,
    "turbowire_lease_token": "ab" * 16, "turbowire_prompt_hash": "cd" * 16,
    "turbowire_params_mac": "ef" * 16, "turbowire_preset": "raw",
}


LOAD_REPORT = {"turbowire_load": {"source": "store", "tokens": 8, "failed": None}}


class Engines:
    """A prefill and a decode engine: completions, /tokenize, /v1/models, /health."""

    def __init__(self, models: dict | None = None, models_status: int = 200) -> None:
        self.calls: list[tuple[str, str, dict, dict]] = []
        self.models = MODELS if models is None else models
        self.models_status = models_status

    def __call__(self, request: httpx.Request) -> httpx.Response:
        host, path = request.url.host, request.url.path
        if path == "/health":
            return httpx.Response(200)
        if path == "/v1/models":
            self.calls.append((host, path, {}, dict(request.headers)))
            return httpx.Response(self.models_status, json=self.models)
        body = json.loads(request.content)
        self.calls.append((host, path, body, dict(request.headers)))
        if path == "/tokenize":
            return httpx.Response(200, json={"count": len(TOKENS), "tokens": TOKENS})
        if host == "p0":
            return httpx.Response(200, json={"choices": [{"text": "x"}],
                                             "usage": {"prompt_tokens": 10},
                                             "kv_transfer_params": dict(PREFILL_PARAMS)})
        return httpx.Response(200, json={"choices": [{"text": "hello"}],
                                         "usage": {"prompt_tokens": 10, "completion_tokens": 2},
                                         "kv_transfer_params": LOAD_REPORT})

    def hosts(self, path: str) -> list[str]:
        return [h for h, p, *_ in self.calls if p == path]

    def bodies(self, host: str) -> list[dict]:
        return [b for h, p, b, _ in self.calls if h == host and p.startswith("/v1/c")]


class Directory:
    """The Directory calls of the proxy; every chunk looked up counts as stored."""

    def __init__(self) -> None:
        self.lookups: list[list[bytes]] = []

    def engines(self, namespace: str) -> list[EngineEntry]:
        return [EngineEntry("d0", "kv_both", "127.0.0.1:5700", None, SCOPE.to_dict(), {}, 1.0,
                            1e12)]

    def longest_prefix(self, scope: StoreScope, hashes) -> int:
        self.lookups.append(list(hashes))
        return len(hashes)

    def close(self) -> None:
        pass


def make(engines: Engines | None = None, directory: Directory | None = None,
         **kw) -> tuple[TestClient, Engines]:
    engines = engines or Engines()
    app = build_app([P_URL], [D_URL], transport=httpx.MockTransport(engines),
                    directory=directory, **kw)
    return TestClient(app), engines


def complete(c: TestClient, rid: str = "r", headers: dict | None = None, **body) -> httpx.Response:
    return c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, **body},
                  headers={"X-Request-Id": rid, **(headers or {})})


# -- H4: what clients see --------------------------------------------------------------------


def test_by_default_no_client_learns_the_route_records_or_engines():
    c, engines = make(directory=Directory())
    with c:
        r = complete(c, "a", model="base")
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "hello"
        assert engines.hosts("/v1/completions") == ["d0"], "a store hit, decode only"
        leaked = [h for h in r.headers if h.lower().startswith("x-turbowire")]
        assert leaked == [], leaked
        rec = c.get("/turbowire/requests/a")
        assert rec.status_code == 404 and "--admin-token-file" in rec.text
        assert "kv_transfer_params" not in r.json(), "the load report tells a store hit too"
        health = c.get("/health").json()
        assert health == {"status": "ok"}
        # the route is still counted for operators
        assert 'turbowire_proxy_routes_total{route="store_hit"} 1.0' in c.get("/metrics").text


def test_admin_token_shows_route_records_and_engines():
    c, _ = make(directory=Directory(), visibility=Visibility(admin_token=ADMIN))
    with c:
        r = complete(c, "a", headers={ADMIN_TOKEN_HEADER: ADMIN}, model="base")
        assert r.headers["x-turbowire-route"] == "store_hit"
        assert r.json()["kv_transfer_params"] == LOAD_REPORT
        r = complete(c, "b", headers={ADMIN_TOKEN_HEADER: "wrong-token-0123456789"},
                     model="base")
        assert "x-turbowire-route" not in r.headers and "kv_transfer_params" not in r.json()
        assert c.get("/turbowire/requests/a").status_code == 401
        assert c.get("/turbowire/requests/a",
                     headers={ADMIN_TOKEN_HEADER: ADMIN[:-1] + "x"}).status_code == 401
        rec = c.get("/turbowire/requests/a", headers={ADMIN_TOKEN_HEADER: ADMIN}).json()
        assert rec["route"] == "store_hit" and rec["stored_tokens"] == 2 * CHUNK
        assert "expose" not in rec
        # Prometheus-style: the token as a bearer on the proxy's own GET endpoints
        bearer = {"Authorization": f"Bearer {ADMIN}"}
        assert c.get("/turbowire/requests/b", headers=bearer).json()["route"] == "store_hit"
        assert c.get("/health", headers=bearer).json()["engines"] == {P_URL: "ok", D_URL: "ok"}
        assert "engines" not in c.get("/health").json()


def test_bearer_admin_token_on_a_completion_is_the_engines_key_not_admin():
    c, engines = make(directory=Directory(), visibility=Visibility(admin_token=ADMIN))
    with c:
        r = complete(c, headers={"Authorization": f"Bearer {ADMIN}"}, model="base")
        assert "x-turbowire-route" not in r.headers
        assert engines.calls[-1][3]["authorization"] == f"Bearer {ADMIN}"  # forwarded as is
        assert ADMIN_TOKEN_HEADER not in engines.calls[-1][3]


def test_records_hold_neither_lease_token_nor_prompt_hash():
    c, engines = make(visibility=Visibility(expose_internals=True))
    with c:
        assert complete(c, "p").status_code == 200
        rec = c.get("/turbowire/requests/p").json()
    kv = rec["kv_transfer_params"]
    assert set(kv) <= RECORD_KV_FIELDS
    text = json.dumps(rec)
    for secret in ("turbowire_lease_token", "turbowire_prompt_hash", "turbowire_params_mac",
                   "ab" * 16, "cd" * 16, "ef" * 16):
        assert secret not in text
    assert kv["remote_num_tokens"] == 7 and kv["remote_request_id"] == "r1"
    # the decode engine still gets every field it needs
    assert engines.bodies("d0")[-1]["kv_transfer_params"] == PREFILL_PARAMS


def test_timing_headers_and_engine_errors_stay_internal():
    def down(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    app = build_app([P_URL], [D_URL], transport=httpx.MockTransport(down))
    with TestClient(app) as c:
        r = complete(c)
        assert r.status_code == 502 and "p0" not in r.text and "8100" not in r.text
    c, _ = make()
    with c:
        r = complete(c)
        assert not [h for h in r.headers if h.lower().startswith("x-turbowire")]


def test_protected_metrics_need_the_admin_token():
    with pytest.raises(ProxyConfigError, match="admin token"):
        Visibility(protect_metrics=True)
    c, _ = make(visibility=Visibility(admin_token=ADMIN, protect_metrics=True))
    with c:
        assert c.get("/metrics").status_code == 401
        assert c.get("/metrics", headers={"Authorization": f"Bearer {ADMIN}"}).status_code == 200


@pytest.mark.parametrize("token", ["short", "has space in it 0123", "x" * 5000])
def test_admin_token_must_be_a_long_plain_secret(token):
    with pytest.raises(ProxyConfigError):
        Visibility(admin_token=token)


# -- H2: transfer params in client bodies ----------------------------------------------------


@pytest.mark.parametrize("endpoint,body", [
    ("/v1/completions", {"prompt": "hi"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
])
@pytest.mark.parametrize("key", ["kv_transfer_params", "ec_transfer_params"])
@pytest.mark.parametrize("with_store", [False, True])
def test_smuggled_transfer_params_get_400_on_every_route(endpoint, body, key, with_store):
    c, engines = make(directory=Directory() if with_store else None)
    with c:
        for value in ("x", {"do_remote_prefill": True}, ["x"]):
            r = c.post(endpoint, json={**body, "model": "base", "vllm_xargs": {key: value}})
            assert r.status_code == 400 and f"vllm_xargs.{key}" in r.text
        assert [call for call in engines.calls if call[1] != "/v1/models"] == []
        # other vllm_xargs travel on; top-level transfer params are dropped
        r = c.post(endpoint, json={**body, "model": "base", "vllm_xargs": {"foo": 1},
                                   "ec_transfer_params": {"x": 1},
                                   "kv_transfer_params": {"remote_host": "10.6.6.6"}})
        assert r.status_code == 200
        for host in ("p0", "d0"):
            for sent in engines.bodies(host):
                assert sent["vllm_xargs"] == {"foo": 1} and "ec_transfer_params" not in sent
                assert "10.6.6.6" not in json.dumps(sent)


# -- H4: per-tenant salts ----------------------------------------------------------------------


def test_tenant_salt_from_api_key_separates_tenants_and_reaches_both_engines():
    salt = TenantSalt.parse("api-key", SECRET)
    c, engines = make(tenant_salt=salt)
    with c:
        salts = []
        for key, client_salt in (("key-a", None), ("key-b", None), ("key-a", None),
                                 ("key-a", "mine"), ("key-b", salt.salt("key-a", None))):
            body = {} if client_salt is None else {"cache_salt": client_salt}
            r = complete(c, headers={"Authorization": f"Bearer {key}"}, **body)
            assert r.status_code == 200
            sent_p, sent_d = engines.bodies("p0")[-1], engines.bodies("d0")[-1]
            assert sent_p["cache_salt"] == sent_d["cache_salt"]
            salts.append(sent_d["cache_salt"])
        a, b, a_again, a_mine, b_naming_a = salts
        assert a == a_again == salt.salt("key-a", None)
        assert len({a, b, a_mine, b_naming_a}) == 4, "no client can name another tenant's salt"
        assert len(a) <= 128 and all(ch not in a for ch in "@/\\\0")  # vLLM's cache_salt rules
        for s in salts:
            assert "key-a" not in s and "key-b" not in s
        n = len(engines.calls)
        r = complete(c)  # no API key: refused before any engine is asked
        assert r.status_code == 401 and "Authorization" in r.text
        r = complete(c, headers={"Authorization": "Basic abc"})
        assert r.status_code == 401
        r = complete(c, headers={"Authorization": "Bearer k"}, cache_salt=5)
        assert r.status_code == 400
        assert len(engines.calls) == n


def test_tenant_salt_from_a_gateway_header_and_secret_matters():
    salt = TenantSalt.parse("header:X-Tenant-Id", SECRET)
    other = TenantSalt.parse("header:X-Tenant-Id", SECRET + "-rotated")
    assert salt.salt("t1", None) != other.salt("t1", None)
    assert SECRET not in repr(salt)
    c, engines = make(tenant_salt=salt)
    with c:
        assert complete(c, headers={"X-Tenant-Id": "t1"}).status_code == 200
        assert engines.bodies("d0")[-1]["cache_salt"] == salt.salt("t1", None)
        assert complete(c, headers={"Authorization": "Bearer t1"}).status_code == 401


@pytest.mark.parametrize("spec", ["", "header", "header:", "header:Authorization",
                                  "header:x y", "apikey", "api-key:x", "cookie:a"])
def test_bad_tenant_salt_options(spec):
    with pytest.raises(ProxyConfigError):
        TenantSalt.parse(spec, SECRET)
    with pytest.raises(ProxyConfigError):
        TenantSalt.parse("api-key", "too-short")


def test_store_lookup_hashes_under_the_tenant_salt():
    salt = TenantSalt.parse("api-key", SECRET)
    directory = Directory()
    c, _ = make(directory=directory, tenant_salt=salt)
    with c:
        for key in ("key-a", "key-b"):
            complete(c, headers={"Authorization": f"Bearer {key}"}, model="base")
    expect = [chunk_hashes(TOKENS, CHUNK, inputs=ChainInputs(cache_salt=salt.salt(k, None)))
              for k in ("key-a", "key-b")]
    assert directory.lookups == expect
    assert expect[0][0] != expect[1][0] != chunk_hashes(TOKENS, CHUNK)[0]


# -- H1: the lookup's keys ---------------------------------------------------------------------


def test_lookup_keys_carry_cache_salt_and_lora_adapter():
    directory = Directory()
    c, engines = make(directory=directory, visibility=Visibility(expose_internals=True))
    with c:
        for body in ({"model": "base"}, {"model": "base", "cache_salt": "s1"},
                     {"model": "lora-a"}, {}):
            r = complete(c, **body)
            assert r.headers["x-turbowire-route"] == "store_hit"
    expect = [
        chunk_hashes(TOKENS, CHUNK),
        chunk_hashes(TOKENS, CHUNK, inputs=ChainInputs(cache_salt="s1")),
        chunk_hashes(TOKENS, CHUNK, inputs=ChainInputs(lora_name="lora-a", lora_path=LORA_PATH)),
        chunk_hashes(TOKENS, CHUNK),  # no model: vLLM's base model
    ]
    assert directory.lookups == expect
    assert len({h[0] for h in expect[:3]}) == 3
    assert engines.hosts("/v1/models") == ["d0"], "the model list is cached"


def test_unknown_model_or_unreadable_model_list_never_takes_the_store_route():
    for engines, body in ((Engines(), {"model": "nope"}),
                          (Engines(models_status=500), {"model": "base"}),
                          (Engines(models={"data": "x"}), {"model": "base"}),
                          (Engines(), {"model": 7})):
        directory = Directory()
        c, engines = make(engines, directory, visibility=Visibility(expose_internals=True))
        with c:
            r = complete(c, **body)
            assert r.status_code == 200 and r.headers["x-turbowire-route"] == "pd_unknown_model"
            assert engines.hosts("/v1/completions") == ["p0", "d0"]
        assert directory.lookups == []


@pytest.mark.parametrize("content,reason", [
    ([{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "data:x"}}],
     "image_url"),
    ([{"type": "input_audio", "input_audio": {"data": "x", "format": "wav"}}], "input_audio"),
    ([{"type": "video_url", "video_url": {"url": "x"}}], "video_url"),
    ([{"image_url": {"url": "x"}}], "text"),  # a media key without a type
    ([{"type": "prompt_embeds", "data": "x"}], "prompt_embeds"),
    ([7], "not text"),
])
def test_multimodal_prompts_never_take_the_store_route(content, reason):
    directory = Directory()
    c, engines = make(directory=directory, visibility=Visibility(expose_internals=True))
    body = {"model": "base", "messages": [{"role": "user", "content": content}]}
    assert reason in unsupported_input("/v1/chat/completions", body)
    with c:
        r = c.post("/v1/chat/completions", json=body)
        assert r.headers["x-turbowire-route"] == "pd_unsupported_input"
        r = c.post("/v1/completions", json={"model": "base", "prompt_embeds": "AAAA"})
        assert r.headers["x-turbowire-route"] == "pd_unsupported_input"
    assert directory.lookups == [] and engines.hosts("/tokenize") == []


def test_text_only_chat_content_is_looked_up():
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, "b",
                                                      {"type": "input_text", "text": "c"}]},
                         {"role": "assistant", "content": None}]}
    assert unsupported_input("/v1/chat/completions", body) is None
    assert unsupported_input("/v1/completions", {"prompt": "x"}) is None


def test_parse_model_list():
    cards = parse_model_list(MODELS)
    assert cards == {"base": ModelCard("base", None), "lora-a": ModelCard("lora-a", LORA_PATH)}
    junk = {"data": [7, {"id": 5}, {"id": "x", "parent": "b"}, {"id": "", "parent": None},
                     {"id": "y", "parent": 3, "root": "/r"}, {"id": "z", "parent": None}]}
    assert parse_model_list(junk) == {"z": ModelCard("z", None)}
    for bad in ([], {"data": {}}, None, "x"):
        with pytest.raises(ValueError):
            parse_model_list(bad)


# -- L2 and the CLI --------------------------------------------------------------------------


def test_cli_defaults_match_the_proxy_and_bounds_reach_uvicorn(monkeypatch, tmp_path):
    import uvicorn

    from turbowire import cli
    from turbowire.commands import proxy as command
    from turbowire.serving import proxy as serving

    assert command.DEFAULT_MAX_BODY_BYTES == serving.DEFAULT_MAX_BODY_BYTES == 4 << 20
    assert command.DEFAULT_MAX_CONCURRENCY == serving.DEFAULT_MAX_CONCURRENCY
    seen: dict = {}

    def run(app, **kw):
        seen.update(kw, app=app)

    monkeypatch.setattr(uvicorn, "run", run)
    monkeypatch.delenv(command.ADMIN_TOKEN_ENV, raising=False)
    monkeypatch.setenv(command.TENANT_SECRET_ENV, SECRET)
    monkeypatch.delenv(command.EXPOSE_INTERNALS_ENV, raising=False)
    token_file = tmp_path / "admin"
    token_file.write_text(ADMIN + "\n")
    runner = CliRunner()
    base = ["proxy", "-p", P_URL, "-d", D_URL]
    r = runner.invoke(cli.app, base)
    assert r.exit_code == 0, r.output
    assert seen["limit_concurrency"] == serving.DEFAULT_MAX_CONCURRENCY
    proxy = seen["app"].state.proxy
    assert proxy.max_body_bytes == 4 << 20 and proxy.visibility == Visibility()
    assert proxy.tenant_salt is None
    r = runner.invoke(cli.app, base + ["--max-concurrency", "7", "--admin-token-file",
                                       str(token_file), "--tenant-salt-from", "api-key"])
    assert r.exit_code == 0, r.output
    proxy = seen["app"].state.proxy
    assert seen["limit_concurrency"] == 7 and proxy.visibility.admin_token == ADMIN
    assert proxy.tenant_salt.salt("t", None) == TenantSalt.parse("api-key", SECRET).salt("t",
                                                                                          None)
    for bad in (["--max-concurrency", "0"], ["--protect-metrics"],
                ["--admin-token-file", str(tmp_path / "missing")],
                ["--tenant-salt-from", "cookie"],
                ["--tenant-salt-secret-file", str(token_file)]):
        r = runner.invoke(cli.app, base + bad)
        assert r.exit_code != 0, bad
    monkeypatch.setenv(command.EXPOSE_INTERNALS_ENV, "1")  # how tests and demos turn it on
    assert runner.invoke(cli.app, base).exit_code == 0
    assert seen["app"].state.proxy.visibility.expose_internals
    monkeypatch.delenv(command.EXPOSE_INTERNALS_ENV)
    monkeypatch.delenv(command.TENANT_SECRET_ENV)
    r = runner.invoke(cli.app, base + ["--tenant-salt-from", "api-key"])
    assert r.exit_code != 0 and "secret" in r.output
    help_text = runner.invoke(cli.app, ["proxy", "--help"]).output
    for option in ("--admin-token-file", "--expose-internals", "--tenant-salt-from",
                   "--max-concurrency", "--protect-metrics"):
        assert option in help_text


# -- M1: a body only the decode engine would refuse ---------------------------------------------


def test_stream_options_without_stream_is_refused_before_any_engine_stages_anything():
    """vLLM refuses stream_options unless stream is true; the prefill request drops it, so only
    the decode request failed, after the prefill engine had staged the prompt (a lease held for
    nothing). The proxy answers 400 first; with stream true the request goes through."""
    c, engines = make()
    with c:
        for stream in (False, None):
            body = {"model": "base", "stream_options": {"include_usage": True}}
            if stream is not None:
                body["stream"] = stream
            r = complete(c, "s", **body)
            assert r.status_code == 400 and "stream_options" in r.text
        assert [call for call in engines.calls if call[1] != "/v1/models"] == []
