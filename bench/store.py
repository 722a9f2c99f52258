"""Store path benchmark: TTFT of a prompt computed cold (engine A) vs loaded from the store
(engine B), and the bytes the store holds per 1k tokens, per preset and prompt length.

Real components: two vLLM CPU engines (SmolLM2-135M-Instruct, A on core 0, B on core 1) with
``transport: store`` sharing a loopback redis-server, LMCache tiers inside each engine. For each
preset the pair is started once; for each prompt length, ``--repeats`` fresh prompts (no shared
prefix) are sent to A (cold: computes and stores) and then to B (hit: loads every full chunk,
computes the tail). TTFT is the time to the first streamed token, client side; bytes held are
what Redis stores for the prompt's chunks (``STRLEN``, framing included). Same run, same machine:
read the ratios.

    python -m bench.store --presets raw,tq4,k4v3 --lengths 2048,4096 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import httpx

from turbowire.serving.launch import (
    EngineSpec,
    ProcessGroup,
    engine_lock,
    free_port,
    start_engine,
    turbowire_kv_config,
)
from turbowire.serving.redis_server import RedisServer
from turbowire.store.keys import StoreScope

NAMESPACE = "bench"
CHUNK = 256


def prompt_ids(seed: int, n: int, vocab: int = 49000) -> list[int]:
    """Deterministic token ids; different seeds share no prefix."""
    x = seed * 7919 + 17
    out = []
    for _ in range(n):
        x = (x * 1103515245 + 12345) % (1 << 31)
        out.append(100 + x % (vocab - 200))
    return out


def ttft(url: str, prompt: list[int]) -> float:
    body = {"model": "bench", "prompt": prompt, "max_tokens": 2, "temperature": 0,
            "stream": True}
    t0 = time.perf_counter()
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                payload = json.loads(line[6:])
                if (payload.get("choices") or [{}])[0].get("text"):
                    return time.perf_counter() - t0
    return time.perf_counter() - t0


def held_bytes(redis_url: str, prompt: list[int]) -> int:
    import redis as redis_py

    from turbowire.store.directory import store_credentials
    from turbowire.store.keys import chunk_hashes

    client = redis_py.Redis.from_url(redis_url, **store_credentials(redis_url))
    try:
        total = 0
        for h in chunk_hashes(prompt, CHUNK):
            for key in client.scan_iter(match=f"{NAMESPACE}/*{h.hex()}*"):
                if client.type(key) == b"string":
                    total += client.strlen(key)
        return total
    finally:
        client.close()


def wait_stored(redis_url: str, scope: StoreScope, prompt: list[int], timeout: float = 60) -> int:
    from turbowire.store.directory import Directory
    from turbowire.store.keys import chunk_hashes

    directory = Directory(redis_url, ttl_seconds=3600)
    hashes = chunk_hashes(prompt, CHUNK)
    deadline = time.monotonic() + timeout
    try:
        while True:
            n = directory.longest_prefix(scope, hashes)
            if n >= len(hashes) or time.monotonic() > deadline:
                return n
            time.sleep(0.2)
    finally:
        directory.close()


def registered_scope(redis_url: str, timeout: float = 30) -> StoreScope:
    """The store scope the engines registered (it carries their weights fingerprint)."""
    from turbowire.store.directory import Directory

    directory = Directory(redis_url, ttl_seconds=3600)
    deadline = time.monotonic() + timeout
    try:
        while True:
            entries = directory.engines(NAMESPACE)
            if entries:
                return StoreScope.from_dict(entries[0].scope)
            if time.monotonic() > deadline:
                raise RuntimeError(f"no engine registered in namespace {NAMESPACE!r}")
            time.sleep(0.2)
    finally:
        directory.close()


def run_preset(model: Path, preset: str, lengths: list[int], repeats: int, redis_url: str,
               log_dir: Path) -> list[dict]:
    cfg = turbowire_kv_config(
        "kv_both", preset=preset, transport="store", store_url=redis_url,
        store_namespace=NAMESPACE, store_local_cpu_bytes="512MiB",
    )
    common = dict(kvcache_gib=2, block_size=128, max_model_len=max(lengths) + 64,
                  max_num_seqs=4, max_num_batched_tokens=max(lengths) + 64,
                  served_model_name="bench")
    rows = []
    with ProcessGroup() as group:
        a = group.add(start_engine(EngineSpec(f"store-a-{preset}", model, free_port(), cpu=0,
                                              kv_transfer_config=cfg, **common), log_dir))
        b = group.add(start_engine(EngineSpec(f"store-b-{preset}", model, free_port(), cpu=1,
                                              kv_transfer_config=cfg, **common), log_dir))
        a.wait_healthy(900)
        b.wait_healthy(900)
        scope = registered_scope(redis_url)  # what the engines key on (weights fingerprint too)
        warm = prompt_ids(1, 300)  # first requests pay graph/allocator warm-up on both
        ttft(a.url, warm)
        ttft(b.url, prompt_ids(2, 300))
        for n in lengths:
            cold, hit, held = [], [], []
            for r in range(repeats):
                prompt = prompt_ids(1000 * n + 10 * r + sum(map(ord, preset)), n)
                cold.append(ttft(a.url, prompt))
                stored = wait_stored(redis_url, scope, prompt)
                if stored < n // CHUNK:
                    print(f"warning: only {stored} of {n // CHUNK} chunks stored",
                          file=sys.stderr)
                hit.append(ttft(b.url, prompt))
                held.append(held_bytes(redis_url, prompt) / ((n // CHUNK) * CHUNK) * 1000)
            rows.append(dict(preset=preset, tokens=n, cold_ms=statistics.median(cold) * 1e3,
                             hit_ms=statistics.median(hit) * 1e3,
                             held_per_1k=statistics.median(held), repeats=repeats))
            row = rows[-1]
            print(f"  {preset} {n} tokens: cold {row['cold_ms']:.0f} ms, hit {row['hit_ms']:.0f} "
                  f"ms, held {row['held_per_1k']:,.0f} B / 1k tokens", file=sys.stderr)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default="raw,tq4,k4v3")
    parser.add_argument("--lengths", default="2048,4096")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench/results/store"))
    args = parser.parse_args(argv)
    from turbowire.models import ensure_smollm2

    model = ensure_smollm2()
    presets = [p for p in args.presets.split(",") if p]
    lengths = [int(n) for n in args.lengths.split(",") if n]
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    with engine_lock(), RedisServer() as redis:
        for preset in presets:
            print(f"preset {preset}: starting engines A (core 0) and B (core 1)", file=sys.stderr)
            rows += run_preset(model, preset, lengths, args.repeats, redis.url,
                               args.out / "logs")
    raw = {r["tokens"]: r["held_per_1k"] for r in rows if r["preset"] == "raw"}
    amx = "amx_tile" in Path("/proc/cpuinfo").read_text()
    lines = [
        f"machine: {platform.node()}, {platform.processor() or platform.machine()}, "
        f"AMX {'yes' if amx else 'no'}; SmolLM2-135M-Instruct bf16, block size 128, chunks of "
        f"{CHUNK} tokens, median of {args.repeats}",
        "",
        "| preset | prompt tokens | TTFT cold (A) ms | TTFT store hit (B) ms | hit / cold | "
        "bytes held per 1k tokens | vs raw |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        vs_raw = r["held_per_1k"] / raw[r["tokens"]] if r["tokens"] in raw else float("nan")
        lines.append(
            f"| {r['preset']} | {r['tokens']} | {r['cold_ms']:.0f} | {r['hit_ms']:.0f} | "
            f"{r['hit_ms'] / r['cold_ms']:.2f}x | {r['held_per_1k']:,.0f} | {vs_raw:.3f}x |"
        )
    table = "\n".join(lines)
    (args.out / "table.md").write_text(table + "\n")
    (args.out / "rows.json").write_text(json.dumps(rows, indent=2) + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
