"""RSS of one CPU prefill engine under prompts of random lengths: which part grows, and why.

Starts one vLLM CPU engine at a time (pinned to core 0, tiny random Llama unless ``--model``),
sends ``--requests`` prompts of uniformly random length (3 to ``--max-prompt`` tokens,
``max_tokens`` 1) at ``--concurrency``, and samples the RSS of the engine's worker process every
``--every`` requests. Variants, run one after another in one sitting:

* ``--connectors none,turbowire``: vLLM alone, or with TurboWireConnector as the prefill side
  (``do_remote_decode`` on every request, nobody reads: leases expire);
* ``--onednn-cache default,64,0``: ``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` of the engine (oneDNN's
  cache of JIT-compiled GEMM primitives, one per shape; vLLM's CPU linear layers go through it).

Prints a table (RSS after the first sample, at the end, growth per request after the first
sample, requests/s) and writes the samples as JSON.

    python -m bench.prefill_rss --connectors none,turbowire --onednn-cache default,64,0 \\
        --requests 600 --out bench/results/prefill_rss/rss.json
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import platform
import random
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

from turbowire.models import ensure_tiny_llama
from turbowire.serving.launch import (
    EngineSpec,
    ProcessGroup,
    engine_lock,
    free_port,
    start_engine,
    turbowire_kv_config,
)
from turbowire.serving.proxy import PREFILL_PARAMS

MiB = 1 << 20


def worker_rss(pid: int) -> dict[str, int]:
    """RSS of every process in the engine's tree, by name."""
    root = psutil.Process(pid)
    out: dict[str, int] = {}
    for proc in [root, *root.children(recursive=True)]:
        try:
            out[proc.name()] = out.get(proc.name(), 0) + proc.memory_info().rss
        except psutil.Error:
            pass
    return out


def run_variant(connector: str, onednn: str, model: Path, args: argparse.Namespace,
                log_dir: Path) -> dict[str, Any]:
    env = {} if onednn == "default" else {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": onednn}
    kv = None
    if connector == "turbowire":
        kv = turbowire_kv_config(side_channel_port=free_port(), preset="tq4",
                                 lease_seconds=2.0)
    rng = random.Random(args.seed)
    plans = [[rng.randint(10, 500) for _ in range(rng.randint(3, args.max_prompt))]
             for _ in range(args.requests)]
    with ProcessGroup() as group:
        engine = group.add(start_engine(EngineSpec(
            "prefill", model, free_port(), cpu=0, kv_transfer_config=kv,
            max_num_batched_tokens=1024, env=env), log_dir / f"{connector}-{onednn}"))
        engine.wait_healthy(600)

        def one(prompt: list[int]) -> int:
            body: dict[str, Any] = {"model": str(model), "prompt": prompt, "max_tokens": 1}
            if connector == "turbowire":
                body["kv_transfer_params"] = dict(PREFILL_PARAMS)  # what the proxy sends
            return httpx.post(engine.url + "/v1/completions", json=body, timeout=300).status_code

        samples: list[dict[str, Any]] = []
        t_start = time.perf_counter()
        with cf.ThreadPoolExecutor(args.concurrency) as pool:
            for lo in range(0, args.requests, args.every):
                batch = plans[lo:lo + args.every]
                codes = list(pool.map(one, batch))
                samples.append({"done": lo + len(batch), "errors": sum(c != 200 for c in codes),
                                "elapsed_s": time.perf_counter() - t_start,
                                "rss": worker_rss(engine.popen.pid)})
                print(f"  {connector:9s} onednn={onednn:7s} {lo + len(batch):5d} requests  "
                      f"worker {samples[-1]['rss'].get('VLLM::Worker', 0) / MiB:,.0f} MiB",
                      flush=True)
    first, last = samples[0], samples[-1]
    grow = last["rss"].get("VLLM::Worker", 0) - first["rss"].get("VLLM::Worker", 0)
    n = last["done"] - first["done"]
    return {"connector": connector, "onednn_cache": onednn, "samples": samples,
            "worker_first_mib": first["rss"].get("VLLM::Worker", 0) / MiB,
            "worker_last_mib": last["rss"].get("VLLM::Worker", 0) / MiB,
            "growth_mib_per_request": grow / MiB / max(1, n),
            "errors": sum(s["errors"] for s in samples),
            "requests_per_s": n / max(1e-9, last["elapsed_s"] - first["elapsed_s"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--connectors", default="none,turbowire", help="none and/or turbowire")
    ap.add_argument("--onednn-cache", default="default,64",
                    help="ONEDNN_PRIMITIVE_CACHE_CAPACITY values ('default': unset)")
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--every", type=int, default=50, help="requests between RSS samples")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-prompt", type=int, default=1984)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", type=Path, default=None, help="default: the tiny random Llama")
    ap.add_argument("--out", type=Path, default=Path("bench/results/prefill_rss/rss.json"))
    ap.add_argument("--log-dir", type=Path, default=Path("/tmp/tw-prefill-rss"))
    args = ap.parse_args()
    model = args.model or ensure_tiny_llama()
    results = []
    with engine_lock():
        for connector in args.connectors.split(","):
            for onednn in args.onednn_cache.split(","):
                results.append(run_variant(connector, onednn, model, args, args.log_dir))
    print(f"\n{platform.node()} {platform.processor() or platform.machine()}, model {model.name}, "
          f"{args.requests} requests, prompts 3..{args.max_prompt} tokens, concurrency "
          f"{args.concurrency}; worker RSS growth counted from the first sample")
    print("| connector | ONEDNN_PRIMITIVE_CACHE_CAPACITY | worker MiB first -> last "
          "| MiB per request | requests/s | errors |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['connector']} | {r['onednn_cache']} | {r['worker_first_mib']:,.0f} -> "
              f"{r['worker_last_mib']:,.0f} | {r['growth_mib_per_request']:.3f} | "
              f"{r['requests_per_s']:.1f} | {r['errors']} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                    "results": results}, indent=1) + "\n")
    print(f"written {args.out}")


if __name__ == "__main__":
    main()
