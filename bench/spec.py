"""Speculative decoding on the decode engine: decode tokens/s with and without ngram speculation,
and the draft acceptance rate, for ``raw`` and a compressed preset, on repetitive and
non-repetitive prompts.

Real components: SmolLM2-135M-Instruct on every engine (vLLM CPU), the prefill engine plain on
core 0; two decode engines on core 1, one plain and one with ngram speculation; one proxy each.
Per preset the three engines are started once; every prompt goes through both proxies, one
request at a time, greedy, ``ignore_eos``. Tokens/s = output tokens / whole request time,
client side (prefill and KV hand-off included, the same for both decode engines).
Acceptance = accepted / drafted from the connector's per-request reports. Same run: read ratios.

    python -m bench.spec --presets raw,tq4 --k 3 --max-tokens 96
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import httpx

from turbowire.models import ensure_smollm2
from turbowire.serving.launch import (
    EngineSpec,
    ProcessGroup,
    engine_lock,
    free_port,
    start_engine,
    start_proxy,
    turbowire_kv_config,
)

NAME = "smollm2"


def prompt_sets() -> dict[str, list[str]]:
    import pydoc_data.topics as topics

    texts = [t for t in topics.topics.values() if len(t) > 1500][:4]
    phrases = ["the cat sat on the mat and looked at the door. ",
               "one two three four five six seven eight nine ten. ",
               "red green blue yellow red green blue yellow. ",
               "to be or not to be, that is the question. "]
    return {
        "repetitive": [p * 12 + "Continue the pattern: " for p in phrases],
        "non-repetitive": ["Summarise this text in your own words:\n" + t[:1200] for t in texts],
    }


def start(group: ProcessGroup, model: Path, preset: str, k: int, log_dir: Path):
    common = dict(kvcache_gib=2, block_size=32, max_model_len=4096, max_num_seqs=4,
                  max_num_batched_tokens=2048, served_model_name=NAME)

    def engine(name: str, cpu: int, extra=()):
        cfg = turbowire_kv_config(side_channel_port=free_port(), preset=preset,
                                  staging_bytes=256 << 20, lease_seconds=30)
        return group.add(start_engine(EngineSpec(name, model, free_port(), cpu=cpu,
                                                 kv_transfer_config=cfg, extra_args=list(extra),
                                                 **common), log_dir))

    spec = ["--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": k,
                                                "prompt_lookup_max": 4, "prompt_lookup_min": 2})]
    p = engine(f"{preset}-prefill", 0)
    plain = engine(f"{preset}-decode-plain", 1)
    sd = engine(f"{preset}-decode-ngram", 1, spec)
    for e in (p, plain, sd):
        e.wait_healthy(900)
    proxies = {}
    for label, d in (("plain", plain), ("ngram", sd)):
        proxies[label] = group.add(start_proxy([p.url], [d.url], free_port(), log_dir,
                                               ["--expose-internals"]))  # load reports
        proxies[label].wait_healthy(120)
    return proxies


def run(url: str, prompt: str, max_tokens: int) -> tuple[int, float, dict]:
    body = {"model": NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/completions", json=body, timeout=600)
    dt = time.perf_counter() - t0
    r.raise_for_status()
    out = r.json()
    load = (out.get("kv_transfer_params") or {}).get("turbowire_load") or {}
    return int(out["usage"]["completion_tokens"]), dt, load


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="raw,tq4")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--log-dir", type=Path, default=Path("/tmp/turbowire-bench-spec"))
    args = ap.parse_args()
    args.log_dir.mkdir(parents=True, exist_ok=True)
    model = ensure_smollm2()
    sets = prompt_sets()
    rows = []
    with engine_lock():
        for preset in args.presets.split(","):
            group = ProcessGroup()
            try:
                proxies = start(group, model, preset, args.k, args.log_dir)
                for label in proxies:  # warm-up
                    run(proxies[label].url, "hello there", 4)
                for kind, prompts in sets.items():
                    tps: dict[str, list[float]] = {"plain": [], "ngram": []}
                    drafted = accepted = 0
                    for prompt in prompts:
                        for label, proxy in proxies.items():
                            n, dt, load = run(proxy.url, prompt, args.max_tokens)
                            tps[label].append(n / dt)
                            drafted += int(load.get("spec_drafted_tokens", 0))
                            accepted += int(load.get("spec_accepted_tokens", 0))
                    plain, sd = statistics.median(tps["plain"]), statistics.median(tps["ngram"])
                    rows.append((preset, kind, plain, sd, sd / plain,
                                 accepted / drafted if drafted else float("nan")))
            finally:
                group.stop()
    print(f"machine: {platform.processor() or platform.machine()}, K={args.k}, "
          f"max_tokens={args.max_tokens}, prompts per set: {len(sets['repetitive'])}")
    print("| preset | prompts | tok/s plain D | tok/s ngram D | ratio | acceptance |")
    print("| --- | --- | --- | --- | --- | --- |")
    for preset, kind, plain, sd, ratio, acc in rows:
        print(f"| {preset} | {kind} | {plain:.1f} | {sd:.1f} | {ratio:.2f}x | {acc:.3f} |")


if __name__ == "__main__":
    main()
