"""Two engines on two cores without pinning: vLLM NixlConnector vs turbowire, same prompts.

With ``VLLM_CPU_OMP_THREADS_BIND`` unset (vLLM's default ``auto``) both engines bind their OpenMP
threads to every core, so the prefill and decode engines fight for the same cores. This bench
starts each connector's P/D pair that way (``--bind auto``) or pinned to its own core (``--bind
pinned``) with the same tiny random Llama, sends the same prompts through turbowire's proxy, and
prints per-request latency, outcome and, for turbowire, the load report's phases (waiting,
handshake, transfer, decode), which show where a slow load spends its time.

    python -m bench.starved_cpu --connectors nixl,turbowire --bind auto,pinned --requests 6
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import httpx

from turbowire.models import ensure_tiny_llama
from turbowire.serving.launch import (
    EngineSpec,
    ProcessGroup,
    engine_lock,
    free_port,
    start_engine,
    start_proxy,
    turbowire_kv_config,
)

NAME = "tiny"


def kv_config(connector: str, role: str, side_port: int, timeout_s: float,
              extra: dict[str, Any]) -> dict[str, Any]:
    if connector == "nixl":
        return {"kv_connector": "NixlConnector", "kv_role": role,
                "kv_connector_extra_config": {"backends": ["UCX"]}}
    return turbowire_kv_config(role, **{"preset": "raw", "side_channel_port": side_port,
                                        "staging_bytes": "256MiB",
                                        "transfer_timeout_seconds": timeout_s, **extra})


def parse_set(items: list[str]) -> dict[str, Any]:
    """``key=value`` pairs, the value JSON if it parses (numbers, objects), else a string."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--set {item!r}: use key=value, e.g. connector_thread_cpus=auto")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def prompts(n: int, length: int) -> list[list[int]]:
    import random

    rng = random.Random(7)
    return [[rng.randrange(3, 1990) for _ in range(length)] for _ in range(n)]


def run_pair(connector: str, bind: str, model: Path, args: argparse.Namespace,
             log_dir: Path) -> list[dict[str, Any]]:
    group = ProcessGroup()
    rows: list[dict[str, Any]] = []
    try:
        common = dict(kvcache_gib=1, block_size=128,
                      max_model_len=2048, max_num_seqs=8, max_num_batched_tokens=1024,
                      served_model_name=NAME)
        engines = []
        for i, (name, role) in enumerate((("prefill", "kv_producer"), ("decode", "kv_consumer"))):
            side = free_port()
            env = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(side)}
            if bind == "auto":
                env["VLLM_CPU_OMP_THREADS_BIND"] = "auto"
            spec = EngineSpec(f"{connector}-{bind}-{name}", model, free_port(),
                              cpu=i if bind == "pinned" else None,
                              kv_transfer_config=kv_config(connector, role, side, args.timeout,
                                                           parse_set(args.set)),
                              env=env, **common)
            engines.append(group.add(start_engine(spec, log_dir)))
        for e in engines:
            e.wait_healthy(900)
        proxy = group.add(start_proxy([engines[0].url], [engines[1].url], free_port(), log_dir,
                                      ["--expose-internals"]))  # load reports
        proxy.wait_healthy(120)
        for i, ids in enumerate(prompts(args.requests, args.prompt_tokens)):
            t0 = time.perf_counter()
            try:
                r = httpx.post(proxy.url + "/v1/completions", timeout=args.timeout + 60,
                               json={"model": NAME, "prompt": ids, "max_tokens": 16,
                                     "temperature": 0})
                status = r.status_code
                body = r.json() if status == 200 else {}
            except httpx.HTTPError as exc:
                status, body = f"error {type(exc).__name__}", {}
            seconds = time.perf_counter() - t0
            report = (body.get("kv_transfer_params") or {}).get("turbowire_load") or {}
            rows.append({"connector": connector, "bind": bind, "request": i, "status": status,
                         "seconds": round(seconds, 2), "load": report})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        group.stop()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--connectors", default="nixl,turbowire")
    ap.add_argument("--bind", default="auto,pinned", help="auto (vLLM default) and/or pinned")
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--prompt-tokens", type=int, default=1000)
    ap.add_argument("--timeout", type=float, default=120.0,
                    help="turbowire transfer_timeout_seconds (and the client's, + 60 s)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a turbowire config key for both engines (repeatable; JSON values), "
                         "e.g. --set connector_thread_cpus=auto")
    ap.add_argument("--out", type=Path, default=Path("bench/results/starved_cpu"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model = ensure_tiny_llama()
    rows: list[dict[str, Any]] = []
    with engine_lock():
        for bind in args.bind.split(","):
            for connector in args.connectors.split(","):
                rows += run_pair(connector, bind, model, args, args.out / "logs")
    (args.out / "rows.json").write_text(json.dumps(rows, indent=1))
    print(f"\nmachine: {platform.processor() or platform.machine()}, cores {os.cpu_count()}")
    print("| connector | bind | requests ok | median s | max s |")
    print("|---|---|---|---|---|")
    for bind in args.bind.split(","):
        for connector in args.connectors.split(","):
            sel = [r for r in rows if r["connector"] == connector and r["bind"] == bind]
            ok = [r["seconds"] for r in sel if r["status"] == 200]
            med = f"{statistics.median(ok):.2f}" if ok else "-"
            mx = f"{max(ok):.2f}" if ok else "-"
            print(f"| {connector} | {bind} | {len(ok)}/{len(sel)} | {med} | {mx} |")


if __name__ == "__main__":
    main()
