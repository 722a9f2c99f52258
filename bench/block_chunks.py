"""The encoder on the connector's chunks: one KV block (16 tokens) per chunk, all layers.

The P2P save path codes every KV block as a chunk of its own (so a decode worker can take any
subset of a request's blocks), 16x more chunks than the 256-token chunks of bench/kernels.py.
This bench measures, on one GPU and in one run, the Llama-3.1-8B slice (32 layers x 8 KV heads
x hd128 x 4096 tokens, bf16, block size 16, shuffled block ids):

* the encode of block-sized chunks with the connector's launch shape (``turbowire.kernels.
  block_kernel_config``) and variants of it (``--configs``: program order, warps, rows,
  register caps);
* the same slice in 256-token chunks with the default launch shape (bench/kernels.py's case),
  or any other chunk length (``t=``);

each as one launch for all layers and as 32 per-layer launches (replayed from a CUDA graph, so
host launch costs do not count), with the staging bytes of every variant compared to those of
the first variant of the same chunk length and a few chunks to the reference codec.
``--profile`` runs one batched launch per variant between cudaProfilerStart/Stop for Nsight
Compute (``ncu --profile-from-start off``).

``python3 -m bench.block_chunks --out DIR [--presets tq4,k4v3] [--configs "sm=0;sm=1"]`` (from the
repository root, against the installed package: ``make bench-block-chunks``).
Smoke run on CPU (Triton interpreter, tiny shapes): ``TW_BENCH_SMOKE=1``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

SMOKE = os.environ.get("TW_BENCH_SMOKE") == "1"
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernel module is imported

import numpy as np  # noqa: E402
import torch  # noqa: E402

from turbowire.codec import Codec  # noqa: E402
from turbowire.kernels import EncodeItem, PagedKVLayout, encode_into  # noqa: E402
from turbowire.kernels.triton_launch import KernelConfig  # noqa: E402
from turbowire.kernels.triton_plans import ChunkSet, EncodeLayersPlan  # noqa: E402

LAYERS, HEADS, DIM, TOKENS, BLOCK = 32, 8, 128, 4096, 16
DEVICE = "cuda"
if SMOKE:
    LAYERS, HEADS, TOKENS, DEVICE = 2, 2, 64, "cpu"
# turbowire.kernels.block_kernel_config, its cap BLOCK_ENCODE_REGISTERS (kernels/triton_common.py;
# written out here as when it lived in the connector); runs before pass 9 had no cap;
# ``regs=N`` sets max_registers, which overrides it
CONNECTOR_SHAPE = dict(num_warps=2, tile_rows=16, encode_max_registers=96)


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def bench_ms(fn: Callable[[], None], graph: bool = False) -> float:
    if SMOKE:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    import triton.testing

    if graph:
        return float(triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median"))
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def make_caches(seed: int) -> tuple[list[torch.Tensor], np.ndarray]:
    """vLLM's GPU layout per layer, ``[2, blocks, block_size, heads, dim]``, and the request's
    shuffled block ids."""
    n_blocks = TOKENS // BLOCK
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    bias = torch.linspace(-2, 2, DIM, device=DEVICE)
    caches = [(torch.randn(2, n_blocks + 8, BLOCK, HEADS, DIM, generator=g, device=DEVICE)
               + bias).to(torch.bfloat16) for _ in range(LAYERS)]
    ids = np.random.default_rng(seed).permutation(n_blocks + 8)[:n_blocks].astype(np.int64)
    return caches, ids


def chunk_set(ids: np.ndarray, chunk_tokens: int) -> ChunkSet:
    n = TOKENS // chunk_tokens
    rng = np.random.default_rng(7)
    return ChunkSet([ids], np.zeros(n, np.int64), np.arange(n, dtype=np.int64) * chunk_tokens,
                    np.full(n, chunk_tokens, np.int64),
                    rng.integers(0, 2**63, n, dtype=np.int64).astype(np.uint64))


def offsets(codec: Codec, chunks: ChunkSet) -> tuple[np.ndarray, int]:
    """[layers, chunks] staging offsets, each chunk in a 16-byte-aligned room of the largest
    size, and the buffer size."""
    room = max(int(codec.encoded_nbytes(layer, int(chunks.tokens[0]), HEADS, s))
               for layer in range(LAYERS) for s in (0, int(chunks.tokens[0])))
    room = -(-room // 16) * 16
    n = len(chunks)
    out = np.arange(LAYERS * n, dtype=np.int64).reshape(LAYERS, n) * room
    return out, LAYERS * n * room


def reference_check(codec: Codec, caches: list[torch.Tensor], ids: np.ndarray, chunks: ChunkSet,
                    out: np.ndarray, written: np.ndarray, staging: torch.Tensor) -> bool:
    """First, second and last chunk of the first and last layer equal to the reference codec's
    bytes (the reference run on the same device)."""
    layout = PagedKVLayout.from_cache(caches[0])
    ok = True
    for layer in sorted({0, LAYERS - 1}):
        for n in sorted({0, 1, len(chunks) - 1}):
            o, w = int(out[layer, n]), int(written[layer, n])
            ref = torch.zeros(o + w, dtype=torch.uint8, device=staging.device)
            item = EncodeItem(ids.tolist(), int(chunks.start[n]), int(chunks.tokens[n]), o,
                              int(chunks.tags[n]))
            encode_into(codec, layer, caches[layer], layout, [item], ref, impl="reference")
            ok &= bool(torch.equal(ref[o:o + w], staging[o:o + w]))
    return ok


SHORT = {"sm": "encode_stream_major", "w": "num_warps", "rows": "tile_rows",
         "regs": "max_registers", "sum": "sum_rows"}


def parse_configs(spec: str) -> list[dict[str, Any]]:
    """``"sm=1;sm=0;w=1,rows=8;t=256,base=0"``: launch shapes, ``;``-separated, each a
    ``,``-separated list of ``key=value`` over the connector's shape (``CONNECTOR_SHAPE``;
    ``base=0``: over the default ``KernelConfig`` instead); keys: ``SHORT``'s, ``t`` (chunk
    tokens, default one block) and ``base``."""
    rows = []
    for part in [p for p in spec.split(";") if p.strip()]:
        pairs = dict(kv.split("=") for kv in part.split(","))
        pairs = {k.strip(): int(v) for k, v in pairs.items()}
        tokens = pairs.pop("t", BLOCK)
        cfg: dict[str, Any] = dict(CONNECTOR_SHAPE) if pairs.pop("base", 1) else {}
        for k, v in pairs.items():
            cfg[SHORT.get(k, k)] = v
        if "encode_stream_major" in cfg:
            cfg["encode_stream_major"] = bool(cfg["encode_stream_major"])
        rows.append(dict(name=part.strip(), chunk_tokens=min(tokens, TOKENS), config=cfg))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--presets", default="tq4,k4v3")
    ap.add_argument("--configs", default="sm=0;sm=1;t=256,base=0,sm=0;t=256,base=0,sm=1",
                    help="launch shapes of block-chunk encodes, ';'-separated, each "
                         "key=value[,key=value] over the connector's shape; keys: "
                         + ", ".join(f"{k} ({v})" for k, v in SHORT.items()))
    ap.add_argument("--profile", action="store_true",
                    help="after the timings, one batched launch per variant inside "
                         "cudaProfilerStart/Stop (for ncu --profile-from-start off)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    env = dict(torch=torch.__version__, device=(torch.cuda.get_device_name() if DEVICE == "cuda"
                                                else "cpu"))
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    results: list[dict[str, Any]] = []
    caches, ids = make_caches(1)
    layout = PagedKVLayout.from_cache(caches[0])
    profile_runs: list[Callable[[], None]] = []
    for preset in [p for p in args.presets.split(",") if p]:
        codec = Codec(preset, DIM, LAYERS)
        first: dict[int, torch.Tensor] = {}
        for var in parse_configs(args.configs):
            ct = var["chunk_tokens"]
            chunks = chunk_set(ids, ct)
            out, size = offsets(codec, chunks)
            staging = torch.full((size,), 0xA5, dtype=torch.uint8, device=DEVICE)
            cfg = KernelConfig(**var["config"])
            t0 = time.perf_counter()
            plan = EncodeLayersPlan(codec, range(LAYERS), caches, layout, chunks, out, staging,
                                    cfg, check_disjoint=False)
            plan.launch()
            sync()
            first_ms = (time.perf_counter() - t0) * 1e3  # compile included
            same = None
            if ct in first:
                same = bool(torch.equal(first[ct], staging))
            else:
                first[ct] = staging.clone()
            ref_ok = reference_check(codec, caches, ids, chunks, out, plan.written, staging)
            one = bench_ms(plan.launch)

            def per_layer(plan: EncodeLayersPlan = plan) -> None:
                for i in range(LAYERS):
                    plan.launch_layer(i)

            per_layer()
            sync()
            layered = bench_ms(per_layer, graph=True)
            dense = LAYERS * TOKENS * HEADS * DIM * 2 * 2
            row = dict(preset=preset, variant=var["name"], chunk_tokens=ct,
                       config=var["config"], one_launch_ms=one, per_layer_graph_ms=layered,
                       wire_MB=float(plan.written.sum()) / 1e6, dense_MB=dense / 1e6,
                       equal_to_first_variant=same, reference_spot_check=ref_ok,
                       first_launch_ms=first_ms)
            results.append(row)
            print(json.dumps(row), flush=True)
            (args.out / "results.json").write_text(json.dumps(dict(env=env, rows=results),
                                                              indent=1))
            profile_runs.append(plan.launch)
            del staging
    lines = [f"# encode of block-sized chunks ({env})", "",
             "| preset | variant | one launch ms | 32 per-layer launches (graph) ms | wire MB "
             "| bytes equal to the first variant | reference spot check |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        same = r["equal_to_first_variant"]
        lines.append(f"| {r['preset']} | {r['variant']} | {r['one_launch_ms']:.3f} | "
                     f"{r['per_layer_graph_ms']:.3f} | {r['wire_MB']:.1f} | "
                     f"{'-' if same is None else same} | {r['reference_spot_check']} |")
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    if args.profile and DEVICE == "cuda":
        sync()
        torch.cuda.profiler.start()
        for fn in profile_runs:
            fn()
        sync()
        torch.cuda.profiler.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
