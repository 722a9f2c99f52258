"""The API-server guard: transfer params smuggled in ``vllm_xargs`` get a 400 naming the field;
every other request (streaming included) reaches the app unchanged."""

from __future__ import annotations

import json

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.testclient import TestClient

from turbowire.connector.http_guard import TransferParamsGuard, smuggled_params


def _app() -> FastAPI:
    app = FastAPI()
    app.add_middleware(TransferParamsGuard)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        if body.get("stream"):
            async def chunks():
                for i in range(3):
                    yield f"data: {i}\n\n"
            return StreamingResponse(chunks(), media_type="text/event-stream")
        return JSONResponse({"echo": body})

    @app.get("/health")
    async def health():
        return {"ok": True}

    return app


@pytest.mark.parametrize("value", ["x", 0, [], ["a", 1], 1.5, ""])
@pytest.mark.parametrize("key", ["kv_transfer_params", "ec_transfer_params"])
def test_params_in_vllm_xargs_are_refused_with_the_field_named(key, value) -> None:
    client = TestClient(_app())
    r = client.post("/v1/completions", json={"prompt": "hi", "vllm_xargs": {key: value}})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == f"vllm_xargs.{key}" and "top-level" in err["message"]


@pytest.mark.parametrize("body", [
    {"prompt": "hi", "kv_transfer_params": {"do_remote_decode": True}},
    {"prompt": "hi", "vllm_xargs": {"my_kv_transfer_params_note": "fine", "n": 3}},
    {"prompt": "a prompt that mentions kv_transfer_params in its text"},
    {"prompt": "hi", "vllm_xargs": "not an object"},  # vLLM's own validation answers
])
def test_everything_else_reaches_the_app_unchanged(body) -> None:
    client = TestClient(_app())
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200 and r.json() == {"echo": body}


def test_streaming_bodies_not_json_and_other_methods_pass() -> None:
    client = TestClient(_app())
    with client.stream("POST", "/v1/completions", json={"prompt": "hi", "stream": True}) as r:
        assert r.status_code == 200
        assert "".join(r.iter_text()) == "data: 0\n\ndata: 1\n\ndata: 2\n\n"
    # not JSON: passed on for vLLM's own error (this app's json() raises: a 500 here)
    lenient = TestClient(_app(), raise_server_exceptions=False)
    r = lenient.post("/v1/completions", content=b'{"vllm_xargs": {"kv_transfer_params": "x"',
                     headers={"content-type": "application/json"})
    assert r.status_code == 500 and "vllm_xargs" not in r.text
    assert client.get("/health").json() == {"ok": True}


def test_smuggled_params_reads_only_objects() -> None:
    assert smuggled_params({"vllm_xargs": {"kv_transfer_params": None}}) == "kv_transfer_params"
    assert smuggled_params({"vllm_xargs": {"other": 1}}) is None
    assert smuggled_params(["vllm_xargs"]) is None
    assert smuggled_params(json.loads('{"vllm_xargs": [1]}')) is None
