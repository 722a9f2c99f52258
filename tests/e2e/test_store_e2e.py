"""Store path with real engines, a real redis-server and real LMCache tiers.

Two vLLM CPU engines (A on core 0, B on core 1, separate processes, the same config with
``transport: store``) share one Redis. A computes prompts; B, given the same prompt or one that
shares only its first chunks, loads the stored chunks instead of computing them: vLLM's
prompt-tokens-by-source metric counts them as external, the connector's load report says
``source: store``, and with ``raw`` B's greedy output equals A's. With ``tq4`` the bytes Redis holds
for a chunk are the codec's size (dense / the preset's ratio). Also: a prefix that vLLM's own
prefix cache holds up to a point that is not chunk-aligned, prompts shorter than one chunk, the
opt-out, a corrupted chunk (a miss, recomputed, never decoded) and Redis killed and restarted
during traffic (misses, no client errors, recovery). And an MLA model's latent rows through the
store (``raw``: B's greedy output equals A's; the bytes held are the latent chunks').
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
import redis as redis_py
from conftest import BLOCK_SIZE, MODEL_NAME, metric_sum, scrape_metrics
from support.redis_server import RedisServer
from test_connector_e2e_raw import prompt_ids

from turbowire.serving.launch import EngineSpec, ProcessGroup, free_port, start_engine

pytestmark = pytest.mark.e2e

CHUNK = 256
LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 64
DENSE_PER_TOKEN = LAYERS * 2 * KV_HEADS * HEAD_DIM * 2
EXTERNAL = 'vllm:prompt_tokens_by_source_total'
NAMESPACE = "e2e"


class StorePair:
    def __init__(self, preset: str, a, b, redis: RedisServer, model: Path) -> None:
        self.preset, self.a, self.b, self.redis, self.model = preset, a, b, redis, model
        self._scope = None

    def complete(self, url: str, prompt, max_tokens: int = 12, params: dict | None = None) -> dict:
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0}
        if params is not None:
            body["kv_transfer_params"] = params
        r = httpx.post(url + "/v1/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        return r.json()

    def metrics(self, url: str) -> dict[str, float]:
        return scrape_metrics(url)

    def scope(self):
        """The scope the engines registered (with their weights fingerprint), read once."""
        if self._scope is None:
            self._scope = registered_scope(self.redis.url, self.preset, self.model)
        return self._scope

    def wait_stored(self, prompt: list[int], chunks: int, timeout: float = 20.0) -> int:
        """Wait until the directory lists ``chunks`` leading chunks of ``prompt``."""
        from turbowire.store.directory import Directory

        directory = Directory(self.redis.url, ttl_seconds=3600)
        deadline = time.monotonic() + timeout
        try:
            while True:
                n = directory.longest_prefix(self.scope(), hashes(prompt))
                if n >= chunks or time.monotonic() > deadline:
                    return n
                time.sleep(0.2)
        finally:
            directory.close()

    def redis_blob_bytes(self, prompt: list[int]) -> list[int]:
        """STRLEN of each stored chunk's bytes in Redis (found by the chunk's hash)."""
        client = redis_py.Redis.from_url(self.redis.url)
        try:
            sizes = []
            for h in hashes(prompt):
                keys = [k for k in client.scan_iter(match=f"{NAMESPACE}/*{h.hex()}*")
                        if client.type(k) == b"string"]
                sizes.append(sum(client.strlen(k) for k in keys))
            return sizes
        finally:
            client.close()


def registered_scope(redis_url: str, preset: str, model: Path):
    """The store scope the engines registered (all agree): the expected model, preset, chunk
    size and TP, plus the weights fingerprint the engine computed from the model's files."""
    from turbowire.store.directory import Directory
    from turbowire.store.fingerprint import weights_fingerprint
    from turbowire.store.keys import StoreScope, model_slug

    directory = Directory(redis_url, ttl_seconds=3600)
    try:
        deadline = time.monotonic() + 30
        while not (entries := directory.engines(NAMESPACE)):  # at the engine's first lookup
            assert time.monotonic() < deadline, "an engine registers within seconds"
            time.sleep(0.2)
    finally:
        directory.close()
    (scope,) = {StoreScope.from_dict(e.scope) for e in entries}
    expect = StoreScope(NAMESPACE, model_slug(f"{MODEL_NAME}.bfloat16"), preset, 1, CHUNK, 1,
                        weights=scope.weights)
    assert scope == expect and len(scope.weights) == 16
    settings = {"quantization": None, "hf_overrides": {}, "load_format": "auto"}
    assert scope.weights == weights_fingerprint(str(model), settings=settings), \
        "the engines' fingerprint is the tiny model's"
    return scope


def hashes(prompt: list[int]) -> list[bytes]:
    from turbowire.store.keys import chunk_hashes

    return chunk_hashes(prompt, CHUNK)


def external_tokens(samples: dict[str, float]) -> float:
    return metric_sum(samples, EXTERNAL, source="external_kv_transfer")


def _start(tiny_model, preset: str, log_dir, redis: RedisServer):
    group = ProcessGroup()
    try:
        cfg = {
            "kv_connector": "TurboWireConnector",
            "kv_connector_module_path": "turbowire.connector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "preset": preset, "transport": "store", "store_url": redis.url,
                "store_namespace": NAMESPACE, "store_local_cpu_bytes": "64MiB",
                "store_ttl_seconds": 600,
            },
        }
        common = dict(kvcache_gib=1, block_size=BLOCK_SIZE, max_model_len=2048, max_num_seqs=8,
                      max_num_batched_tokens=1024, served_model_name=MODEL_NAME)
        a = group.add(start_engine(EngineSpec("store-a", tiny_model, free_port(), cpu=0,
                                              kv_transfer_config=cfg, **common), log_dir))
        b = group.add(start_engine(EngineSpec("store-b", tiny_model, free_port(), cpu=1,
                                              kv_transfer_config=cfg, **common), log_dir))
        a.wait_healthy(900)
        b.wait_healthy(900)
        return group, StorePair(preset, a, b, redis, Path(tiny_model))
    except BaseException:
        group.stop()
        raise


@pytest.fixture(scope="module", params=["raw", "tq4"])
def pair(request, tiny_model, engine_slot, tmp_path_factory):
    redis = RedisServer()
    redis.start()
    group, st = _start(tiny_model, request.param, tmp_path_factory.mktemp(f"logs-store-"
                                                                          f"{request.param}"),
                       redis)
    yield st
    group.stop()
    redis.stop()


def test_same_prompt_and_shared_prefix_load_from_the_store(pair):
    prompt = prompt_ids(9100, 2 * CHUNK + 100)
    ref = pair.complete(pair.a.url, prompt)
    assert pair.wait_stored(prompt, 2) == 2, "A must have stored both full chunks"

    before = pair.metrics(pair.b.url)
    out = pair.complete(pair.b.url, prompt)
    load = (out.get("kv_transfer_params") or {}).get("turbowire_load")
    assert load is not None and load["source"] == "store" and load["failed"] is None, out
    assert load["tokens"] == 2 * CHUNK
    time.sleep(1.5)  # vLLM publishes metrics on its logging interval
    after = pair.metrics(pair.b.url)
    assert external_tokens(after) - external_tokens(before) == 2 * CHUNK
    assert metric_sum(after, "turbowire_store_lookups_total", result="hit") - metric_sum(
        before, "turbowire_store_lookups_total", result="hit") == 2
    if pair.preset == "raw":
        assert out["choices"][0]["text"] == ref["choices"][0]["text"]
    else:
        assert out["choices"][0]["text"].strip()

    # shares only the first chunk: B loads 256 tokens and computes the rest
    other = prompt[:CHUNK] + prompt_ids(9101, CHUNK + 40)
    ref_other = pair.complete(pair.a.url, other)
    out_other = pair.complete(pair.b.url, other)
    load = out_other["kv_transfer_params"]["turbowire_load"]
    assert load["tokens"] == CHUNK and load["source"] == "store"
    if pair.preset == "raw":
        assert out_other["choices"][0]["text"] == ref_other["choices"][0]["text"]


def test_bytes_held_in_redis_are_the_codec_size(pair):
    from turbowire.codec import Codec
    from turbowire.store.blob import header_nbytes

    prompt = prompt_ids(9200, 3 * CHUNK)
    pair.complete(pair.a.url, prompt, max_tokens=2)
    assert pair.wait_stored(prompt, 3) == 3
    held = pair.redis_blob_bytes(prompt)
    codec = Codec(pair.preset, HEAD_DIM, LAYERS)
    dense = CHUNK * DENSE_PER_TOKEN
    for i, nbytes in enumerate(held):
        chunk_bytes = sum(codec.encoded_nbytes(layer, CHUNK, KV_HEADS, i * CHUNK)
                          for layer in range(LAYERS))
        # framing: the blob header, the tier's frame (its key name, a checksum), a length
        assert chunk_bytes <= nbytes <= chunk_bytes + header_nbytes(LAYERS) + 256
        if i > 0:  # the first chunk carries the sequence's sink rows
            ratio = dense / chunk_bytes
            assert abs(nbytes - dense / ratio) <= 0.03 * dense / ratio, (nbytes, dense, ratio)
    if pair.preset == "tq4":
        assert max(held[1:]) <= 0.3 * dense


def test_prefix_cache_hit_not_chunk_aligned(pair):
    """B's own prefix cache holds 10 blocks (320 tokens: block- but not chunk-aligned); the
    store holds 2 chunks: B loads tokens 320..511 only, never writing the cached blocks."""
    prompt = prompt_ids(9300, 2 * CHUNK + 30)
    ref = pair.complete(pair.a.url, prompt)
    assert pair.wait_stored(prompt, 2) == 2
    warm = prompt[: 10 * BLOCK_SIZE] + prompt_ids(9301, 40)
    pair.complete(pair.b.url, warm, max_tokens=2, params={"turbowire_store": False})
    out = pair.complete(pair.b.url, prompt)
    load = out["kv_transfer_params"]["turbowire_load"]
    assert load["source"] == "store" and load["failed"] is None
    assert load["tokens"] == 2 * CHUNK - 10 * BLOCK_SIZE, load
    if pair.preset == "raw":
        assert out["choices"][0]["text"] == ref["choices"][0]["text"]
    # the cached blocks were not overwritten: the warm prompt answers as A answers it
    warm_ref = pair.complete(pair.a.url, warm, max_tokens=8, params={"turbowire_store": False})
    warm_b = pair.complete(pair.b.url, warm, max_tokens=8, params={"turbowire_store": False})
    if pair.preset == "raw":
        assert warm_b["choices"][0]["text"] == warm_ref["choices"][0]["text"]


def test_short_prompts_and_opt_out(pair):
    for n in (5, CHUNK - 1, CHUNK):
        prompt = prompt_ids(9400 + n, n)
        ref = pair.complete(pair.a.url, prompt)
        out = pair.complete(pair.b.url, prompt)
        if pair.preset == "raw":
            assert out["choices"][0]["text"] == ref["choices"][0]["text"]
        load = (out.get("kv_transfer_params") or {}).get("turbowire_load")
        if n < CHUNK:
            assert load is None, "nothing to load below one chunk"
    opted = prompt_ids(9450, CHUNK + 10)
    pair.complete(pair.a.url, opted, max_tokens=2, params={"turbowire_store": False})
    time.sleep(1.0)
    assert pair.wait_stored(opted, 1, timeout=1.0) == 0, "an opted-out prompt is not stored"


def test_corrupt_chunk_is_a_counted_miss_and_recomputed(pair):
    prompt = prompt_ids(9500, CHUNK + 20)
    ref = pair.complete(pair.a.url, prompt)
    assert pair.wait_stored(prompt, 1) == 1
    client = redis_py.Redis.from_url(pair.redis.url)
    (key,) = [k for k in client.scan_iter(match=f"{NAMESPACE}/*{hashes(prompt)[0].hex()}*")
              if client.type(k) == b"string"]
    value = bytearray(client.get(key))
    value[len(value) // 2] ^= 0x40
    client.set(key, bytes(value), keepttl=True)
    client.close()
    before = pair.metrics(pair.b.url)
    out = pair.complete(pair.b.url, prompt)
    if pair.preset == "raw":
        assert out["choices"][0]["text"] == ref["choices"][0]["text"]
    time.sleep(1.5)
    after = pair.metrics(pair.b.url)
    failures = metric_sum(after, "turbowire_store_failures_total", operation="load") - \
        metric_sum(before, "turbowire_store_failures_total", operation="load")
    assert failures >= 1
    load = out["kv_transfer_params"]["turbowire_load"]
    assert load["failed"] is not None and load["tokens"] == 0


def test_redis_killed_and_restarted_during_traffic(pair):
    pair.redis.kill()
    try:
        for i in range(3):
            prompt = prompt_ids(9600 + i, CHUNK + 50)
            t0 = time.monotonic()
            out = pair.complete(pair.a.url, prompt, max_tokens=4)
            assert out["choices"][0]["text"] is not None
            assert time.monotonic() - t0 < 30
            pair.complete(pair.b.url, prompt, max_tokens=4)
    finally:
        pair.redis.start()
    time.sleep(3)  # the circuit breakers retry
    prompt = prompt_ids(9700, 2 * CHUNK)
    ref = pair.complete(pair.a.url, prompt)
    assert pair.wait_stored(prompt, 2) == 2, "the store works again after Redis returns"
    out = pair.complete(pair.b.url, prompt)
    load = out["kv_transfer_params"]["turbowire_load"]
    assert load["source"] == "store" and load["tokens"] == 2 * CHUNK
    if pair.preset == "raw":
        assert out["choices"][0]["text"] == ref["choices"][0]["text"]


def test_proxy_routes_stored_prompts_past_prefill(pair, tmp_path):
    """The real proxy with ``--directory``: a new prompt goes through P/D (the prefill engine
    computes and stores it, the decode engine loads it from the store); the same prompt again is
    a store hit, sent straight to the decode engine."""
    from turbowire.serving.launch import start_proxy

    proxy = start_proxy([pair.a.url], [pair.b.url], free_port(), tmp_path,
                        ["--directory", pair.redis.url, "--store-namespace", NAMESPACE,
                         "--expose-internals"])  # this test reads the route header
    from turbowire.store.directory import Directory

    directory = Directory(pair.redis.url, ttl_seconds=600)
    try:
        proxy.wait_healthy(120)
        # both engines are in the registry (they re-register within a second of a Redis restart)
        deadline = time.monotonic() + 30
        while len(directory.engines(NAMESPACE)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(directory.engines(NAMESPACE)) == 2
        prompt = prompt_ids(9800, 2 * CHUNK + 10)
        routes = []
        for _ in range(2):
            r = httpx.post(proxy.url + "/v1/completions", timeout=300, json={
                "model": MODEL_NAME, "prompt": prompt, "max_tokens": 8, "temperature": 0})
            assert r.status_code == 200, r.text
            routes.append(r.headers.get("x-turbowire-route"))
            if len(routes) == 1:
                assert pair.wait_stored(prompt, 2) == 2
        assert routes[0] == "pd_miss", routes
        assert routes[1] == "store_hit", routes
    finally:
        directory.close()
        proxy.stop()


@pytest.mark.parametrize("preset", ["raw", "tq4"])
def test_an_mla_model_goes_through_the_store(preset, engine_slot, tmp_path_factory):
    """The DeepSeek-V2-style MLA model (4 layers, a 512 latent + 64 RoPE row; vLLM CPU's MLA
    backend picks its own 16-token blocks): A stores each full chunk as every layer's latent
    chunk, B loads them; with ``raw`` B's greedy output equals A's."""
    from turbowire.codec import Codec
    from turbowire.codec.latent import latent_nbytes
    from turbowire.models import ensure_tiny_model
    from turbowire.store.blob import header_nbytes

    layers, model = 4, ensure_tiny_model("deepseek-v2")
    redis = RedisServer()
    redis.start()
    try:
        group, pair = _start(model, preset, tmp_path_factory.mktemp(f"logs-store-mla-{preset}"),
                             redis)
        try:
            prompt = prompt_ids(9700, 2 * CHUNK + 100)
            ref = pair.complete(pair.a.url, prompt)
            assert pair.wait_stored(prompt, 2) == 2, "A must have stored both full chunks"
            out = pair.complete(pair.b.url, prompt)
            load = (out.get("kv_transfer_params") or {}).get("turbowire_load")
            assert load is not None and load["source"] == "store" and load["failed"] is None, out
            assert load["tokens"] == 2 * CHUNK
            codec = Codec(preset, 128, layers)  # the 512 latent as 4 vectors of 128
            for i, nbytes in enumerate(pair.redis_blob_bytes(prompt)):
                chunk_bytes = sum(latent_nbytes(codec, layer, CHUNK, 512, 64, i * CHUNK)
                                  for layer in range(layers))
                # framing: the blob header, the tier's frame (its key name, a checksum), a length
                assert chunk_bytes <= nbytes <= chunk_bytes + header_nbytes(layers) + 256
            if preset == "raw":
                assert out["choices"][0]["text"] == ref["choices"][0]["text"]
            else:
                assert out["choices"][0]["text"].strip()
        finally:
            group.stop()
    finally:
        redis.stop()
