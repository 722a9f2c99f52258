"""Speculative decoding on the decode engine, with real engines, the real proxy and real Redis.

The prefill engine runs plain; decode engines run vLLM's ngram speculation with K=3 and K=5
(``raw``). Greedy answers through the proxy equal the prefill engine answering alone, for
prompts whose drafts are mostly accepted and mostly rejected; the connector's draft counts
equal vLLM's own spec-decode counters; the load report says how many tokens were accepted drafts.

No rejected draft leaks (``transport: both``): the K=3 decode engine saves the chunks it
computes (the prompt's tail and its outputs, for the next turn) under its own namespace; the
plain prefill engine then prefills the decode engine's own token sequence (prompt + outputs) and
saves the same chunks under another. vLLM does not promise that speculative and plain greedy
decoding agree bitwise over long outputs (near-ties of a random model flip under other verify
batch shapes), so that equality is reported there, not assumed; what must hold is that every
stored position holds the KV of the engine's own token. The chunks are decoded and compared per
layer, K/V, position and head within a few bf16 steps (one prefill pass against K+1 verify steps
rounds differently); a forged chunk holding one draft token is rejected by the same comparison.

EAGLE (a tiny random EAGLE-1 draft vLLM loads on CPU): the draft model's attention layer is an
ordinary ``kv_caches`` entry and moves with the target's (the wire bytes cover three layers);
a decode engine running EAGLE refuses a plain prefill peer at the handshake, naming the
speculative config, and recomputes.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import torch
from conftest import MODEL_NAME, metric_sum, scrape_metrics
from support.redis_server import RedisServer
from test_connector_e2e_raw import prompt_ids

from turbowire.models import ensure_tiny_eagle
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

CHUNK = 32  # store chunks of one block: many chunk ends fall inside verify steps
STAGING = 64 << 20
LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 64
DENSE_PER_TOKEN = LAYERS * 2 * KV_HEADS * HEAD_DIM * 2  # bf16 K and V, target layers


def ngram(k: int) -> list[str]:
    return ["--speculative-config", json.dumps({
        "method": "ngram", "num_speculative_tokens": k,
        "prompt_lookup_max": 4, "prompt_lookup_min": 2,
    })]


def repetitive(seed: int, n: int) -> list[int]:
    """A prompt that repeats one short phrase: ngram drafts are mostly accepted."""
    phrase = prompt_ids(seed, 7)
    return (phrase * (n // len(phrase) + 1))[:n]


@dataclass
class SpecStack:
    prefill: ManagedProcess
    decoders: dict[int, ManagedProcess]  # K -> decode engine
    proxies: dict[int, ManagedProcess]
    redis: RedisServer

    def complete(self, url: str, prompt, max_tokens: int = 48,
                 params: dict | None = None) -> dict:
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0, "return_token_ids": True}
        if params is not None:
            body["kv_transfer_params"] = params
        r = httpx.post(url + "/v1/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        return r.json()


def _engine(group: ProcessGroup, name: str, model, cpu: int, log_dir, extra_args=(), **cfg):
    common = dict(kvcache_gib=1, block_size=32, max_model_len=2048, max_num_seqs=8,
                  max_num_batched_tokens=1024, served_model_name=MODEL_NAME)
    cfg = {"preset": "raw", "staging_bytes": STAGING, "lease_seconds": 10, **cfg}
    return group.add(start_engine(EngineSpec(
        name, model, free_port(), cpu=cpu,
        kv_transfer_config=turbowire_kv_config(side_channel_port=free_port(), **cfg),
        extra_args=list(extra_args), **common), log_dir))


@pytest.fixture(scope="module")
def spec(tiny_model, engine_slot, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("logs-spec")
    redis = RedisServer()
    redis.start()
    group = ProcessGroup()
    try:
        store = dict(transport="both", store_url=redis.url, store_local_cpu_bytes="64MiB",
                     store_chunk_tokens=CHUNK)
        p = _engine(group, "spec-prefill", tiny_model, 0, log_dir, store_namespace="ref", **store)
        d3 = _engine(group, "spec-decode-k3", tiny_model, 1, log_dir, ngram(3),
                     store_namespace="spec", **store)
        d5 = _engine(group, "spec-decode-k5", tiny_model, 1, log_dir, ngram(5))
        for e in (p, d3, d5):
            e.wait_healthy(900)
        proxies = {}
        for k, d in ((3, d3), (5, d5)):
            proxies[k] = group.add(start_proxy([p.url], [d.url], free_port(), log_dir))
            proxies[k].wait_healthy(120)
        st = SpecStack(p, {3: d3, 5: d5}, proxies, redis)
        for k in (3, 5):
            st.complete(proxies[k].url, "warm up the connection please", max_tokens=2)
        yield st
    finally:
        group.stop()
        redis.stop()


def _counters(url: str) -> dict[str, float]:
    s = scrape_metrics(url)
    return {
        "drafted": metric_sum(s, "turbowire_spec_positions_total", outcome="drafted"),
        "accepted": metric_sum(s, "turbowire_spec_positions_total", outcome="accepted"),
        "discarded": metric_sum(s, "turbowire_spec_positions_total", outcome="discarded"),
        "vllm_drafted": metric_sum(s, "vllm:spec_decode_num_draft_tokens_total"),
        "vllm_accepted": metric_sum(s, "vllm:spec_decode_num_accepted_tokens_total"),
    }


PROMPTS = {
    "repetitive": [repetitive(s, 120 + 37 * s) for s in (1, 2)],
    "plain": [prompt_ids(5100 + s, 90 + 61 * s) for s in range(3)],
}


@pytest.mark.parametrize("k", [3, 5])
def test_greedy_outputs_equal_the_prefill_engine_alone(spec, k):
    before = _counters(spec.decoders[k].url)
    rates = {}
    drafted = accepted = 0
    for kind, prompts in PROMPTS.items():
        kind_drafted = kind_accepted = 0
        for prompt in prompts:
            ref = spec.complete(spec.prefill.url, prompt)["choices"][0]["text"]
            out = spec.complete(spec.proxies[k].url, prompt)
            assert out["choices"][0]["text"] == ref, f"{kind} prompt: D with K={k} differs"
            load = out["kv_transfer_params"]["turbowire_load"]
            assert load["tokens"] == len(prompt) and not load.get("failed")
            assert 0 <= load["spec_accepted_tokens"] <= load["spec_drafted_tokens"]
            kind_drafted += load["spec_drafted_tokens"]
            kind_accepted += load["spec_accepted_tokens"]
        assert kind_drafted > 0, f"no drafts on the {kind} prompts"
        rates[kind] = kind_accepted / kind_drafted
        drafted += kind_drafted
        accepted += kind_accepted
    after = _counters(spec.decoders[k].url)
    delta = {name: after[name] - before[name] for name in after}
    requests = sum(len(p) for p in PROMPTS.values())
    # the connector saw every draft vLLM verified, and the per-request reports add up to it;
    # vLLM also counts the K placeholder drafts (-1) it pads the first step after a load with
    assert delta["drafted"] == drafted
    assert drafted <= delta["vllm_drafted"] <= drafted + k * requests
    assert delta["accepted"] == accepted
    assert delta["accepted"] + delta["discarded"] == delta["drafted"]
    # vLLM also counts drafts accepted past a stop; the connector counts only output tokens
    assert delta["accepted"] <= delta["vllm_accepted"] <= delta["accepted"] + k * requests
    assert rates["repetitive"] > 0.5, rates
    assert rates["repetitive"] > rates["plain"], rates


def _scope(redis_url: str, namespace: str):
    """The store scope the engines of ``namespace`` registered (their weights fingerprint too)."""
    from turbowire.store.directory import Directory
    from turbowire.store.keys import StoreScope

    directory = Directory(redis_url, ttl_seconds=600)
    try:
        deadline = time.monotonic() + 30
        while not (entries := directory.engines(namespace)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert entries, f"no engine registered in store namespace {namespace!r}"
        return StoreScope.from_dict(entries[0].scope)
    finally:
        directory.close()


def _stored_blob(redis_url: str, namespace: str, tokens: list[int], index: int) -> bytes | None:
    from turbowire.store.keys import chunk_hashes
    from turbowire.store.tiers import ChunkStore, StoreSettings

    scope = _scope(redis_url, namespace)
    store = ChunkStore(StoreSettings(store_url=redis_url, local_cpu_bytes=0, local_disk=None,
                                     ttl_seconds=600, namespace=namespace))
    try:
        return store.get(scope, chunk_hashes(tokens, CHUNK)[index], 0)
    finally:
        store.close()


def _wait_blob(redis_url: str, namespace: str, tokens: list[int], index: int) -> bytes | None:
    deadline = time.monotonic() + 20
    while True:
        blob = _stored_blob(redis_url, namespace, tokens, index)
        if blob is not None or time.monotonic() > deadline:
            return blob
        time.sleep(0.3)


BF16_EPS = torch.finfo(torch.bfloat16).eps  # 2**-7: one bf16 step at 1.0
# Largest difference accepted between a head vector of the decode engine's chunk and the plain
# engine's, in bf16 steps of its largest |element|: room for the same sums rounded in other batch
# shapes (measured here: 0), well above a whole bf16-vs-fp32 forward pass (about 2) and far below
# two distinct tokens' layer-0 K/V (about 90 and more); both measured in
# test_tolerance_separates_every_wrong_token_at_layer_0.
KV_TOLERANCE_STEPS = 8.0


def _layers_kv(blob: bytes) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every layer's (K, V) [T, H, D] of a stored blob; the blob and layer headers are checked."""
    from turbowire.codec import Codec
    from turbowire.store.blob import parse_header

    header = parse_header(blob)
    codec = Codec("raw", HEAD_DIM, header.num_layers)
    view = memoryview(blob)
    return [codec.decode(layer, view[offset:offset + size]) for layer, (offset, size)
            in enumerate(zip(header.layer_offsets(), header.layer_nbytes, strict=True))]


def head_steps(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """[..., H, D] -> [..., H]: a head vector's largest difference in bf16 steps of its largest
    |element| in ``want`` (scale-free; 0 is identical)."""
    got, want = got.float(), want.float()
    scale = want.abs().amax(-1).clamp_min(torch.finfo(torch.float32).tiny) * BF16_EPS
    return (got - want).abs().amax(-1) / scale


def kv_steps(got: bytes, want: bytes) -> torch.Tensor:
    """[layer, K/V, position]: the worst head of each position (``head_steps``)."""
    out = []
    for layer_got, layer_want in zip(_layers_kv(got), _layers_kv(want), strict=True):
        out.append(torch.stack([head_steps(g, w).amax(-1)
                                for g, w in zip(layer_got, layer_want, strict=True)]))
    assert out[0].shape == (2, CHUNK), out[0].shape
    return torch.stack(out)


def _model_kv(model: Any, ids: torch.Tensor, positions: torch.Tensor | None = None,
              ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every layer's (K, V) [B, T, H, D] of one forward pass of a transformers model."""
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.no_grad():
        model(ids, position_ids=positions, past_key_values=cache, use_cache=True)
    if hasattr(cache, "layers"):  # transformers >= 4.56
        pairs = [(layer.keys, layer.values) for layer in cache.layers]
    else:
        pairs = list(zip(cache.key_cache, cache.value_cache, strict=True))
    return [(k.transpose(1, 2), v.transpose(1, 2)) for k, v in pairs]


def test_tolerance_separates_every_wrong_token_at_layer_0(tiny_model, engine_slot):
    """Why ``KV_TOLERANCE_STEPS`` is safe both ways, on the same weights (no engine needed).

    Layer 0's K/V at position p depend on the token at p and on p alone, so a leaked draft at p
    (another token) moves them by at least the smallest distance between two tokens' layer-0
    K/V: every pair of the vocabulary is measured. The honest side: computing a whole sequence
    in fp32 instead of bf16, a far coarser change than a batch shape's rounding, stays inside.
    """
    from transformers import AutoModelForCausalLM

    def load(dtype: torch.dtype) -> Any:
        return AutoModelForCausalLM.from_pretrained(
            tiny_model, dtype=dtype, attn_implementation="eager").eval()

    bf16, fp32 = load(torch.bfloat16), load(torch.float32)
    ids = torch.tensor([prompt_ids(8800, 12 * CHUNK)])
    noise = max(head_steps(b.to(torch.bfloat16), a).max().item()
                for layer_a, layer_b in zip(_model_kv(bf16, ids), _model_kv(fp32, ids), strict=True)
                for a, b in zip(layer_a, layer_b, strict=True))
    vocab = torch.arange(bf16.config.vocab_size)[:, None]
    closest = float("inf")
    for p in (3 * CHUNK, 6 * CHUNK - 1, 11 * CHUNK + 7):
        k, v = _model_kv(bf16, vocab, torch.full_like(vocab, p))[0]
        for x in (k[:, 0].float(), v[:, 0].float()):  # [tokens, H, D]
            # head_steps of every (got, want) pair: max-abs distances over each want's scale
            scale = x.abs().amax(-1).clamp_min(torch.finfo(torch.float32).tiny) * BF16_EPS
            steps = torch.stack([torch.cdist(x[:, h], x[:, h], p=float("inf")) / scale[:, h]
                                 for h in range(x.shape[1])]).amax(0)  # [got, want]
            steps.fill_diagonal_(float("inf"))  # a token against itself
            closest = min(closest, steps.min().item())
    print(f"\nbf16 vs fp32 sequence KV: {noise:.2f} bf16 steps; two distinct tokens' layer-0 "
          f"K/V: >= {closest:.2f}; tolerance {KV_TOLERANCE_STEPS}")
    assert noise <= KV_TOLERANCE_STEPS
    assert closest > 4 * KV_TOLERANCE_STEPS


def _fmt(steps: torch.Tensor) -> str:
    """[layer, K/V] steps, one decimal, for the report."""
    return "[" + ", ".join("[" + ", ".join(f"{x:.1f}" for x in row) + "]"
                           for row in steps.tolist()) + "]"


def _first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where ``a`` and ``b`` differ (the shorter one's end counts), or None."""
    diff = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    return diff if diff is not None or len(a) == len(b) else min(len(a), len(b))


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_saved_chunks_hold_no_rejected_draft(spec, seed):
    """Every chunk the K=3 decode engine stores holds the KV of its own tokens, never a draft's.

    The reference is the plain prefill engine prefilling the decode engine's own sequence, so it
    holds exactly the right tokens whatever the greedy outputs do. A leaked draft at position p
    changes layer 0's K/V at p (they depend on the token at p and p alone) by far more than the
    tolerance: a forged chunk with one replaced token proves the comparison rejects it.
    """
    prompt = prompt_ids(8800 + seed, 3 * CHUNK + 5 * seed)
    max_tokens = 8 * CHUNK  # outputs fill several chunks on the decode engine
    before = _counters(spec.decoders[3].url)
    out = spec.complete(spec.proxies[3].url, prompt, max_tokens=max_tokens)
    after = _counters(spec.decoders[3].url)
    assert after["discarded"] > before["discarded"], "no draft was rejected: nothing to show"
    outputs = list(out["choices"][0]["token_ids"])
    tokens = prompt + outputs
    first = len(prompt) // CHUNK  # the first chunk the decode engine computed itself
    last = len(tokens) // CHUNK - 1  # the final token's KV is never computed
    assert last - first >= 6, f"only chunks {first}..{last - 1} to compare"
    redis = spec.redis.url

    # the plain engine computes (not loads) the KV of exactly the decode engine's sequence
    assert _stored_blob(redis, "ref", tokens, first) is None
    spec.complete(spec.prefill.url, tokens, max_tokens=1)
    honest = []
    for index in range(first, last):
        spec_blob = _wait_blob(redis, "spec", tokens, index)
        ref_blob = _wait_blob(redis, "ref", tokens, index)
        assert spec_blob is not None, f"the decode engine did not save chunk {index}"
        assert ref_blob is not None, f"the prefill engine did not save chunk {index}"
        steps = kv_steps(spec_blob, ref_blob)
        bad = (steps > KV_TOLERANCE_STEPS).nonzero().tolist()
        assert not bad, (f"chunk {index}: (layer, K/V, position) {bad[:8]} hold other KV than "
                         f"the decode engine's own tokens (up to {steps.max():.1f} bf16 steps)")
        honest.append(steps)
    # the chunks before came from the prefill peer: the decode engine does not store them again
    for index in range(first):
        assert _stored_blob(redis, "spec", tokens, index) is None, f"chunk {index} stored again"

    # a leaked draft: the last position of one chunk (a chunk end inside a verify step) holds a
    # draft token instead, one the ngram drafter could propose (it copies from the context)
    index = first + seed
    p = (index + 1) * CHUNK - 1
    draft = next(t for t in reversed(tokens[:p]) if t != tokens[p])
    forged = tokens[:p] + [draft]
    spec.complete(spec.prefill.url, forged, max_tokens=1)
    forged_blob = _wait_blob(redis, "ref", forged, index)
    assert forged_blob is not None, "the prefill engine did not save the forged chunk"
    forged_steps = kv_steps(forged_blob, _stored_blob(redis, "ref", tokens, index))
    # each layer's K and V at p alone are rejected; the positions before p hold the same tokens
    leak = forged_steps[:, :, -1]
    assert leak.min() > KV_TOLERANCE_STEPS, f"a leaked draft would pass: {leak.tolist()}"
    assert forged_steps[:, :, :-1].max() <= KV_TOLERANCE_STEPS
    worst = torch.stack(honest).amax(dim=(0, 3))  # [layer, K/V]
    print(f"\nseed {seed}: chunks {first}..{last - 1}; honest worst (bf16 steps, [layer][K,V]) "
          f"{_fmt(worst)}; forged token at {p} {_fmt(leak)}; "
          f"forged chunk before it {forged_steps[:, :, :-1].max():.2f}; "
          f"tolerance {KV_TOLERANCE_STEPS}")

    # equal greedy output is not promised over 256 tokens here (it is checked where it is
    # deterministic: test_greedy_outputs_equal_the_prefill_engine_alone); reported only
    plain = spec.complete(spec.prefill.url, prompt, max_tokens=max_tokens,
                          params={"turbowire_store": False})["choices"][0]["token_ids"]
    diff = _first_difference(outputs, list(plain))
    if diff is None:
        print(f"seed {seed}: the {len(outputs)} speculative outputs equal plain greedy decoding")
    else:
        print(f"seed {seed}: speculative outputs ({len(outputs)}) first differ from plain greedy "
              f"({len(plain)}) at output token {diff}")


# ------------------------------------------------------------------ EAGLE: draft KV moves too
@dataclass
class EagleStack:
    prefill: ManagedProcess
    decode: ManagedProcess
    proxy: ManagedProcess
    plain_proxy: ManagedProcess  # the plain prefill engine -> the EAGLE decode engine


@pytest.fixture(scope="module")
def eagle(spec, tiny_model, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("logs-eagle")
    draft = ensure_tiny_eagle(tiny_model)
    args = ["--speculative-config", json.dumps(
        {"method": "eagle", "model": str(draft), "num_speculative_tokens": 3})]
    group = ProcessGroup()
    try:
        p = _engine(group, "eagle-prefill", tiny_model, 0, log_dir, args)
        d = _engine(group, "eagle-decode", tiny_model, 1, log_dir, args,
                    load_failure_policy="recompute")
        p.wait_healthy(900)
        d.wait_healthy(900)
        x = group.add(start_proxy([p.url], [d.url], free_port(), log_dir))
        plain = group.add(start_proxy([spec.prefill.url], [d.url], free_port(), log_dir))
        x.wait_healthy(120)
        plain.wait_healthy(120)
        yield EagleStack(p, d, x, plain)
    finally:
        group.stop()


def _complete(url: str, prompt, max_tokens: int = 32) -> dict:
    r = httpx.post(url + "/v1/completions", json={
        "model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
    }, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def test_eagle_draft_layers_move_with_the_target(eagle):
    before = scrape_metrics(eagle.decode.url)
    for seed in range(3):
        prompt = prompt_ids(7300 + seed, 100 + 45 * seed)
        ref = _complete(eagle.prefill.url, prompt)["choices"][0]["text"]
        out = _complete(eagle.proxy.url, prompt)
        assert out["choices"][0]["text"] == ref
        load = out["kv_transfer_params"]["turbowire_load"]
        assert not load["failed"] and load["tokens"] == len(prompt)
        # three attention layers moved: the target's two and the EAGLE draft's one
        assert load["dense_bytes"] == len(prompt) * DENSE_PER_TOKEN * 3 // 2
        assert load["spec_drafted_tokens"] > 0
    after = scrape_metrics(eagle.decode.url)
    drafted = (metric_sum(after, "turbowire_spec_positions_total", outcome="drafted")
               - metric_sum(before, "turbowire_spec_positions_total", outcome="drafted"))
    assert drafted > 0


def test_eagle_decode_refuses_a_plain_prefill_peer(eagle, spec):
    refused = 'turbowire_kv_transfer_failures_total'
    before = metric_sum(scrape_metrics(eagle.decode.url), refused, reason="incompatible")
    prompt = prompt_ids(7400, 150)
    ref = _complete(spec.prefill.url, prompt)["choices"][0]["text"]
    out = _complete(eagle.plain_proxy.url, prompt)
    assert out["choices"][0]["text"] == ref  # recomputed on the decode engine
    load = (out.get("kv_transfer_params") or {}).get("turbowire_load")
    assert load is None or load["failed"]
    after = metric_sum(scrape_metrics(eagle.decode.url), refused, reason="incompatible")
    assert after > before
    log = eagle.decode.log_path.read_text(errors="replace")
    assert "speculative_config differs" in log and "runs 'eagle'" in log
