"""A body with transfer params smuggled in ``vllm_xargs`` (issue 33, H2), on real engines.

vLLM's request models let ``vllm_xargs`` values be strings, numbers or lists and copy them into
``SamplingParams.extra_args``, where vLLM reads ``kv_transfer_params`` as the transfer params
without a type check: ``{"vllm_xargs": {"kv_transfer_params": "x"}}`` was an HTTP 500 from both
engines, and the proxy forwarded it. Here every such body, on ``/v1/completions`` and
``/v1/chat/completions`` (the tiny model gets a chat template), sent to a prefill engine, a
decode engine, and through the proxy on its P/D route and its store-hit route, gets either a
4xx that names the field (engines: turbowire's API-server guard) or the right answer (the proxy
drops the smuggled field), and every engine keeps serving.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from conftest import BLOCK_SIZE, MODEL_NAME
from support.redis_server import RedisServer
from test_connector_e2e_raw import prompt_ids, staging_bytes_for

from turbowire.serving.launch import (
    EngineSpec,
    ManagedProcess,
    ProcessGroup,
    free_port,
    start_engine,
    start_proxy,
    turbowire_kv_config,
)

pytestmark = pytest.mark.e2e

NAMESPACE = "h2"
CHUNK = 64  # store chunks of two blocks: a short prompt fills some
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
SMUGGLED = {
    "kv-string": {"kv_transfer_params": "x"},
    "kv-list": {"kv_transfer_params": ["do_remote_prefill"]},
    "kv-zero": {"kv_transfer_params": 0},
    "ec-string": {"ec_transfer_params": "x"},
}


@dataclass
class Stack:
    prefill: ManagedProcess
    decode: ManagedProcess
    proxy: ManagedProcess


@pytest.fixture(scope="module")
def stack(tiny_model: Path, engine_slot, tmp_path_factory) -> Iterator[Stack]:
    log_dir = tmp_path_factory.mktemp("logs-h2")
    template = log_dir / "chat-template.jinja"
    template.write_text(CHAT_TEMPLATE)
    redis = RedisServer()
    redis.start()
    group = ProcessGroup()
    try:
        cfg = dict(preset="raw", staging_bytes=staging_bytes_for("raw", 32), lease_seconds=10,
                   transport="both", store_url=redis.url, store_namespace=NAMESPACE,
                   store_local_cpu_bytes="64MiB", store_chunk_tokens=CHUNK)
        common = dict(kvcache_gib=1, block_size=BLOCK_SIZE, max_model_len=2048, max_num_seqs=8,
                      max_num_batched_tokens=1024, served_model_name=MODEL_NAME,
                      extra_args=["--chat-template", str(template)])
        engines = [group.add(start_engine(EngineSpec(
            name, tiny_model, free_port(), cpu=cpu,
            kv_transfer_config=turbowire_kv_config(side_channel_port=free_port(), **cfg),
            **common), log_dir)) for name, cpu in (("h2-prefill", 0), ("h2-decode", 1))]
        for e in engines:
            e.wait_healthy(900)
        proxy = group.add(start_proxy([engines[0].url], [engines[1].url], free_port(), log_dir,
                                      ["--directory", redis.url, "--store-namespace", NAMESPACE]))
        proxy.wait_healthy(120)
        yield Stack(engines[0], engines[1], proxy)
    finally:
        group.stop()
        redis.cleanup()


def _body(endpoint: str, prompt: list[int], xargs: dict | None) -> dict:
    body: dict = {"model": MODEL_NAME, "max_tokens": 6, "temperature": 0}
    if endpoint == "completions":
        body["prompt"] = prompt
    else:  # the chat template turns the message into a prompt; the text stands for the ids
        body["messages"] = [{"role": "user", "content": " ".join(f"w{t}" for t in prompt)}]
    if xargs is not None:
        body["vllm_xargs"] = xargs
    return body


def _post(url: str, endpoint: str, body: dict) -> httpx.Response:
    path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
    return httpx.post(url + path, json=body, timeout=300)


def _text(r: httpx.Response) -> str:
    choice = r.json()["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]


def _still_serving(stack: Stack) -> None:
    for proc in (stack.prefill, stack.decode):
        assert proc.alive(), f"{proc.name} died"
        assert httpx.get(proc.url + "/health", timeout=10).status_code == 200
        r = _post(proc.url, "completions", _body("completions", prompt_ids(4, 9), None))
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("case", sorted(SMUGGLED))
@pytest.mark.parametrize("target", ["prefill", "decode"])
def test_engines_answer_4xx_naming_the_field_and_keep_serving(stack, target, case, endpoint):
    url = getattr(stack, target).url
    r = _post(url, endpoint, _body(endpoint, prompt_ids(70_000 + len(case), 40), SMUGGLED[case]))
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    assert "vllm_xargs." in r.text
    _still_serving(stack)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("case", sorted(SMUGGLED))
def test_the_proxy_answers_right_on_the_pd_route(stack, case, endpoint):
    prompt = prompt_ids(71_000 + 10 * len(case) + len(endpoint), 40)
    want = _text(_post(stack.prefill.url, endpoint, _body(endpoint, prompt, None)))
    r = _post(stack.proxy.url, endpoint, _body(endpoint, prompt, SMUGGLED[case]))
    _refused_or_right(r, want)
    _still_serving(stack)


def _refused_or_right(r: httpx.Response, want: str) -> None:
    """A 4xx that names the smuggled field, or the answer the prompt gets without it."""
    if r.status_code == 200:
        assert _text(r) == want
    else:
        assert 400 <= r.status_code < 500 and "vllm_xargs." in r.text, (r.status_code, r.text)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_the_proxy_answers_right_on_the_store_hit_route(stack, endpoint):
    """A prompt of whole chunks, stored by a first request: the second goes straight to the
    decode engine (it loads the prompt from the store), carrying the smuggled field."""
    prompt = prompt_ids(72_000 + len(endpoint), 3 * CHUNK)
    first = _post(stack.proxy.url, endpoint, _body(endpoint, prompt, None))
    assert first.status_code == 200, first.text
    want = _text(first)
    deadline = time.monotonic() + 30
    while True:  # the prefill engine's chunks reach the directory shortly after its answer
        r = _post(stack.proxy.url, endpoint, _body(endpoint, prompt, None))
        assert r.status_code == 200, r.text
        if r.headers.get("x-turbowire-route") == "store_hit" or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert r.headers.get("x-turbowire-route") == "store_hit", r.headers
    # the prompt now takes the store-hit route: the smuggled field on it
    r = _post(stack.proxy.url, endpoint, _body(endpoint, prompt, SMUGGLED["kv-string"]))
    _refused_or_right(r, want)
    _still_serving(stack)
