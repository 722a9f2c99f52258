"""MLA latent quality on real engines: a P/D pair per preset on the tiny random DeepSeek-V2-style
model (``turbowire.models``, ``deepseek-v2``: MLA on every layer, a 512 latent + 64 RoPE row),
the decode engine's first-token distribution from the loaded latent rows against the prefill
engine answering alone.

The quality eval (``turbowire eval``) runs transformers models whose caches hold per-head K/V, not
MLA's latent: this runs the connector's real path instead (vLLM CPU engines, real NIXL), so the
latent is coded exactly as served. Per preset: wire bytes per latent row against bf16, the KL of
the first token's distribution (over the reference's top-20, the rest floored at the lowest
listed logprob), top-1 agreement, and how many prompts failed to load. ``raw`` is the control
(KL ~0: the decode engine recomputes nothing but the last token). A random model's numbers are
not a real model's: they rank presets on this latent, nothing more.

    .venv/bin/python -m bench.mla_quality                 # raw, k8v4, tq4, tq3; ~10 min
    .venv/bin/python -m bench.mla_quality --presets raw,tq4 --prompts 4 --json out.json
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from turbowire.models import ensure_tiny_model
from turbowire.serving.launch import (
    EngineSpec,
    ProcessGroup,
    engine_lock,
    free_port,
    start_engine,
    start_proxy,
    turbowire_kv_config,
)

TOP = 20  # vLLM's default max_logprobs
NAME = "tiny-mla"


def complete(url: str, prompt: list[int], **body: Any) -> dict:
    r = httpx.post(url + "/v1/completions", timeout=300, json={
        "model": NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": TOP,
        **body})
    r.raise_for_status()
    return r.json()


def first_token(out: dict) -> dict[str, float]:
    return out["choices"][0]["logprobs"]["top_logprobs"][0]


def kl(ref: dict[str, float], got: dict[str, float]) -> float:
    """KL(ref || got) over ref's listed tokens; a token got does not list takes got's lowest
    listed logprob (an upper bound on its probability)."""
    floor = min(got.values())
    return sum(math.exp(lp) * (lp - got.get(tok, floor)) for tok, lp in ref.items())


def prompts(count: int, lengths: list[int], vocab: int = 1900) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(10, vocab) for _ in range(n)] for n in lengths for _ in range(count)]


def run_preset(model: Path, preset: str, cases: list[list[int]], logs: Path) -> dict:
    """One P/D pair with ``preset``: every case through the proxy and on the prefill engine."""
    common = dict(kvcache_gib=1, max_model_len=2048, max_num_seqs=8,
                  max_num_batched_tokens=2048, served_model_name=NAME)
    cfg = dict(preset=preset, staging_bytes=64 << 20, lease_seconds=30)
    with ProcessGroup() as group:
        p = group.add(start_engine(EngineSpec(
            "prefill", model, free_port(), cpu=0, **common,
            kv_transfer_config=turbowire_kv_config("kv_producer", side_channel_port=free_port(),
                                                   **cfg)), logs))
        d = group.add(start_engine(EngineSpec(
            "decode", model, free_port(), cpu=1, **common,
            kv_transfer_config=turbowire_kv_config("kv_consumer", side_channel_port=free_port(),
                                                   **cfg)), logs))
        p.wait_healthy(900)
        d.wait_healthy(900)
        # --expose-internals: the proxy passes each request's load report back
        proxy = group.add(start_proxy([p.url], [d.url], free_port(), logs,
                                      ["--expose-internals"]))
        proxy.wait_healthy(120)
        complete(proxy.url, [11, 12, 13])  # handshake and NIXL connection
        kls, agree, failed, wire, tokens = [], 0, 0, 0, 0
        for prompt in cases:
            ref = first_token(complete(p.url, prompt))
            out = complete(proxy.url, prompt)
            load = (out.get("kv_transfer_params") or {}).get("turbowire_load")
            if load is None:
                raise RuntimeError(f"no load report from the proxy: {out}")
            if load.get("failed") is not None or not load.get("tokens"):
                failed += 1
                continue
            wire += int(load["wire_bytes"])
            tokens += int(load["tokens"])
            got = first_token(out)
            kls.append(kl(ref, got))
            agree += max(ref, key=ref.get) == max(got, key=got.get)
    done = len(kls)
    return {"preset": preset, "prompts": len(cases), "failed": failed,
            "bytes_per_row_layer": wire / max(tokens, 1) / 4,
            "kl": sum(kls) / max(done, 1), "kl_max": max(kls, default=0.0),
            "top1": agree / max(done, 1)}


def table(rows: list[dict]) -> str:
    bf16 = 576 * 2
    lines = ["| preset | bytes/row | vs bf16 | KL (mean) | KL (max) | top-1 | failed |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| `{r['preset']}` | {r['bytes_per_row_layer']:.0f} | "
                     f"{bf16 / max(r['bytes_per_row_layer'], 1):.2f}x | {r['kl']:.4f} | "
                     f"{r['kl_max']:.4f} | {100 * r['top1']:.1f}% | {r['failed']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  python -m bench.mla_quality\n"
               "  python -m bench.mla_quality --presets raw,tq4 --prompts 4")
    ap.add_argument("--presets", default="raw,k8v4,tq4,tq3", help="comma-separated presets")
    ap.add_argument("--lengths", default="128,512,1500", help="prompt lengths (tokens)")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per length")
    ap.add_argument("--json", type=Path, help="write the rows and the run's settings here")
    args = ap.parse_args(argv)
    model = ensure_tiny_model("deepseek-v2")
    cases = prompts(args.prompts, [int(n) for n in args.lengths.split(",")])
    rows = []
    t0 = time.time()
    with engine_lock(), tempfile.TemporaryDirectory(prefix="tw-mla-") as tmp:
        for preset in args.presets.split(","):
            rows.append(run_preset(model, preset, cases, Path(tmp) / preset))
            print(f"{preset}: done after {time.time() - t0:.0f} s", flush=True)
    print(table(rows))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "rows": rows, "lengths": args.lengths, "prompts_per_length": args.prompts,
            "model": "tiny random deepseek-v2 (turbowire.models)", "cpu": platform.processor()
            or platform.machine(), "date": time.strftime("%Y-%m-%d")}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
