"""Real engines, preset ``raw`` (bf16 passthrough in the chunk container): greedy outputs through
the proxy equal a single engine's, for prompts of several lengths (not block-aligned),
concurrent requests, a shared prefix, an aborted request, vLLM toy-proxy semantics, a full
staging pool (fallback) and malformed params (recompute)."""

from __future__ import annotations

import concurrent.futures as cf
import time

import httpx
import pytest
from conftest import BLOCK_SIZE, MODEL_NAME, PDStack, metric_sum, start_stack

pytestmark = pytest.mark.e2e

STAGING_SLOTS = 40  # 1280 tokens of blocks: the concurrent test fits, a 1500-token prompt does not


def staging_bytes_for(preset: str, slots: int, layers: int = 2, head_dim: int = 64) -> int:
    """Pool size holding exactly ``slots`` slots of a tiny model (``layers`` x 2 KV heads x
    ``head_dim``: 2 layers of 64 for the tiny Llama)."""
    from turbowire.codec import Codec
    from turbowire.connector.geometry import KVGeometry, LayerSpec, StagingLayout

    geo = KVGeometry(tuple(LayerSpec(f"l.{i}", 2, head_dim) for i in range(layers)),
                     BLOCK_SIZE, "bfloat16")
    one = StagingLayout.build(geo, Codec(preset, head_dim, layers).encoded_nbytes, 1 << 30)
    return one.slot_bytes * slots


def prompt_ids(seed: int, n: int) -> list[int]:
    """Deterministic token ids (3..1999) of length n; different seeds never share a prefix."""
    x = seed * 7919 + 17
    out = []
    for _ in range(n):
        x = (x * 1103515245 + 12345) % (1 << 31)
        out.append(3 + x % 1990)
    return out


@pytest.fixture(scope="module")
def stack(tiny_model, engine_slot, tmp_path_factory):
    group, st = start_stack(
        tiny_model, "raw", tmp_path_factory.mktemp("logs-raw"),
        staging_bytes_for("raw", STAGING_SLOTS),
    )
    yield st
    group.stop()


def pd(stack: PDStack, prompt, max_tokens: int = 12, request_id: str | None = None,
       **body) -> dict:
    """A greedy completion through the proxy (``body``: more request fields, e.g. logprobs)."""
    headers = {"X-Request-Id": request_id} if request_id else {}
    r = httpx.post(stack.proxy.url + "/v1/completions", timeout=300, headers=headers,
                   json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
                         "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def single(stack: PDStack, prompt, max_tokens: int = 12) -> str:
    """The reference: the prefill engine answering alone (no kv_transfer_params)."""
    return stack.complete(stack.prefill.url, prompt, max_tokens)["choices"][0]["text"]


@pytest.mark.parametrize("n", [5, 33, 70, 150, 401])
def test_greedy_equals_single_engine(stack, n):
    prompt = prompt_ids(n, n)
    out = pd(stack, prompt, request_id=f"len-{n}")
    load = out["kv_transfer_params"]["turbowire_load"]
    assert load["failed"] is None
    assert load["tokens"] == n  # the decode engine had nothing cached: the whole prompt moved
    assert out["choices"][0]["text"] == single(stack, prompt)


def test_concurrent_requests(stack):
    prompts = [prompt_ids(1000 + i, 40 + 37 * i) for i in range(6)]
    with cf.ThreadPoolExecutor(6) as pool:
        outs = list(pool.map(lambda p: pd(stack, p)["choices"][0]["text"], prompts))
    refs = [single(stack, p) for p in prompts]
    assert outs == refs


def test_shared_prefix_loads_only_the_new_blocks(stack):
    prefix = prompt_ids(77, 3 * BLOCK_SIZE)
    first = prefix + prompt_ids(78, 10)
    second = prefix + prompt_ids(79, 21)
    pd(stack, first)
    out = pd(stack, second)
    load = out["kv_transfer_params"]["turbowire_load"]
    # The decode engine's own prefix cache holds the 3 shared blocks from the first request.
    assert load["tokens"] == len(second) - 3 * BLOCK_SIZE
    assert out["choices"][0]["text"] == single(stack, second)


def test_aborted_request_releases_staging(stack):
    prompt = prompt_ids(4242, 200)
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 400, "temperature": 0,
            "stream": True, "ignore_eos": True}
    with httpx.stream("POST", stack.proxy.url + "/v1/completions", json=body, timeout=300) as r:
        for chunk in r.iter_bytes():
            if chunk.strip():
                break  # the client goes away after the first token: the decode engine aborts
    status = stack.wait_pool_empty()
    assert status.used_slots == 0 and status.leases == 0, status
    # both engines still serve
    assert pd(stack, prompt_ids(4243, 50))["choices"][0]["text"]


def test_toy_proxy_semantics_without_our_proxy(stack):
    """The exact two-step flow of vLLM's toy_proxy_server.py, straight to the engines."""
    prompt = prompt_ids(555, 90)
    p_body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1, "stream": False,
              "temperature": 0,
              "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False,
                                     "remote_engine_id": None, "remote_block_ids": None,
                                     "remote_host": None, "remote_port": None}}
    p = httpx.post(stack.prefill.url + "/v1/completions", json=p_body, timeout=300).json()
    kv = p["kv_transfer_params"]
    for key in ("do_remote_prefill", "remote_engine_id", "remote_request_id", "remote_host",
                "remote_port", "remote_block_ids", "remote_num_tokens", "tp_size"):
        assert key in kv
    d_body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 12, "temperature": 0,
              "kv_transfer_params": kv}
    d = httpx.post(stack.decode.url + "/v1/completions", json=d_body, timeout=300).json()
    assert d["kv_transfer_params"]["turbowire_load"]["tokens"] == 90
    assert d["choices"][0]["text"] == single(stack, prompt)


def test_full_staging_falls_back_to_recompute(stack):
    before = stack.metrics(stack.prefill.url)
    prompt = prompt_ids(999, 1500)  # needs 47 slots, the pool has 40
    out = pd(stack, prompt)
    assert out["kv_transfer_params"] is None or "turbowire_load" not in (
        out["kv_transfer_params"] or {}
    )
    assert out["choices"][0]["text"] == single(stack, prompt)
    assert stack.pool_status().used_slots == 0  # the partial reservation was given back
    after = stack.metrics(stack.prefill.url)
    assert metric_sum(after, "turbowire_kv_fallbacks_total", reason="staging_full") == (
        metric_sum(before, "turbowire_kv_fallbacks_total", reason="staging_full") + 1
    )


def test_malformed_params_are_recomputed_and_counted(stack):
    prompt = prompt_ids(31337, 45)
    before = stack.metrics(stack.decode.url)
    bad = {"do_remote_prefill": True, "remote_engine_id": "x", "remote_request_id": "y",
           "remote_host": "127.0.0.1", "remote_port": "not-a-port", "remote_block_ids": [0, 1],
           "remote_num_tokens": 45, "turbowire_preset": "raw", "turbowire_format_version": 1}
    r = httpx.post(stack.decode.url + "/v1/completions", timeout=300,
                   json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 12,
                         "temperature": 0, "kv_transfer_params": bad})
    assert r.status_code == 200
    assert r.json()["choices"][0]["text"] == single(stack, prompt)
    time.sleep(1.0)
    after = stack.metrics(stack.decode.url)
    assert metric_sum(after, "turbowire_kv_transfer_failures_total", reason="bad_params") == (
        metric_sum(before, "turbowire_kv_transfer_failures_total", reason="bad_params") + 1
    )
