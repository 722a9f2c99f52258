"""Triton codec kernels on a CUDA GPU: bit-exactness against the reference, then throughput.

Run on the GPU machine (``make bench-kernels``, or ``python3 -m bench.kernels --out DIR`` from the
repository root against the installed package; bench/README.md says how on a machine without a
venv):

1. Correctness, each configuration in its own process (a faulting kernel cannot poison the rest;
   the processes also compile the kernels in parallel): for every preset x head_dim 64/128/256 x
   cache layout LBNHC/LBHNC (+ fp16 caches), chunks encoded by the Triton kernels must be
   byte-identical to the reference codec run on the same GPU, and caches decoded by the kernels
   must equal the reference decode (bitwise), with every other slot untouched.
2. Throughput on KV shaped like Llama-3.1-8B (32 layers, 8 KV heads, hd128) and SmolLM2-135M
   (30 layers, 3 KV heads, hd64): 4096 tokens, bf16, block size 16, chunks of 256 tokens, block
   ids shuffled. Encode and decode of all layers, per layer as the connector calls them (one
   launch per layer) and batched (one launch per layer policy), with bytes counted as
   (read + written) / time against a device-to-device copy and the paged gather of the same
   blocks measured in the same run.

Prints Markdown tables; writes results.json (as it goes), results.md and log.txt under --out.
Inside a device call's time limit: ``--check-deadline S`` abandons unfinished checks after S
seconds so the tables still run; ``--check-presets=`` and ``--skip-table`` leave the sweep alone.
Smoke run on CPU (Triton interpreter, tiny shapes): ``TW_BENCH_SMOKE=1``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

if os.environ.get("TW_BENCH_SMOKE") == "1":
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernel module is imported

import torch  # noqa: E402

from turbowire.codec import Codec, list_presets  # noqa: E402
from turbowire.kernels import (  # noqa: E402
    DecodeItem,
    EncodeItem,
    KVScales,
    PagedKVLayout,
    decode_into,
    encode_into,
)
from turbowire.kernels.triton_launch import (  # noqa: E402
    DecodePlan,
    EncodePlan,
    KernelConfig,
)

MODELS = {
    "Llama-3.1-8B": dict(layers=32, heads=8, dim=128),
    "SmolLM2-135M": dict(layers=30, heads=3, dim=64),
}
TOKENS = 4096
BLOCK = 16
CHUNK = 256
DEVICE = "cuda"
SMOKE = os.environ.get("TW_BENCH_SMOKE") == "1"  # CPU + Triton interpreter, tiny shapes
if SMOKE:
    DEVICE = "cpu"
    MODELS = {"Llama-3.1-8B": dict(layers=2, heads=2, dim=128),
              "SmolLM2-135M": dict(layers=2, heads=3, dim=64)}
    TOKENS = 64
    CHUNK = 32


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------------------
# caches and items
# ------------------------------------------------------------------------------------------
FP8_SCALES = (0.0625, 0.0625)  # (k, v) scale of the fp8-cache checks


def make_caches(layers: int, heads: int, dim: int, num_blocks: int, layout: str,
                dtype: torch.dtype, device: str, fill: float | None = None, seed: int = 0):
    """One allocation for all layers, per-layer views as vLLM hands them to connectors."""
    g = torch.Generator(device=device).manual_seed(seed)
    if layout == "LBNHC":
        shape = (layers, 2, num_blocks, BLOCK, heads, dim)
    else:
        shape = (layers, 2, num_blocks, heads, BLOCK, dim)
    if fill is None:
        big = torch.randn(shape, generator=g, device=device, dtype=torch.float32)
        big = big * 1.5 + torch.linspace(-2, 2, dim, device=device)  # channel offsets (K-like)
        big[..., 3] *= 6.0  # an outlier channel
        if dtype == torch.float8_e4m3fn:  # vLLM's fp8 cache: values / the layer's scale
            big = (big / FP8_SCALES[0]).clamp(-448, 448)
        big = big.to(dtype)
    else:
        big = torch.full(shape, fill, device=device, dtype=torch.float32).to(dtype)
    views = [big[i] if layout == "LBNHC" else big[i].permute(0, 1, 3, 2, 4) for i in range(layers)]
    return big, views


def make_items(codec: Codec, layers: int, heads: int, block_ids: list[int],
               chunks: list[tuple[int, int]], align: int = 64):
    """Encode items per layer (layer-major staging offsets) and the total staging size."""
    enc: list[list[EncodeItem]] = []
    off = 0
    for layer in range(layers):
        row = []
        for start, n in chunks:
            row.append(EncodeItem(block_ids, start, n, off, tag=(layer << 20) + start + 1))
            size = codec.encoded_nbytes(layer, n, heads, start)
            off += (size + align - 1) // align * align
        enc.append(row)
    return enc, off


def decode_items(enc: list[list[EncodeItem]], written: list[list[int]], block_ids: list[int]):
    return [
        [DecodeItem(block_ids, it.token_start, it.num_tokens, it.out_offset, n, it.tag)
         for it, n in zip(row, sizes)]
        for row, sizes in zip(enc, written)
    ]


# ------------------------------------------------------------------------------------------
# 1. correctness (one process per configuration)
# ------------------------------------------------------------------------------------------
@dataclass
class CheckCase:
    preset: str
    dim: int
    heads: int
    layout: str
    dtype: str = "bfloat16"
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        extra = ",".join(f"{k}={v}" for k, v in self.config.items())
        return (f"{self.preset} hd{self.dim} H{self.heads} {self.layout} {self.dtype} "
                f"{extra}").strip()


def run_check(case: CheckCase) -> dict[str, Any]:
    """Encode/decode a few chunks with the kernels and the reference on the GPU; compare."""
    t0 = time.time()
    out: dict[str, Any] = {"case": case.name, **asdict(case)}
    try:
        dtype = getattr(torch, case.dtype)
        cfg = KernelConfig(**case.config)
        layers = 2
        nb = 40
        big, caches = make_caches(layers, case.heads, case.dim, nb, case.layout, dtype, DEVICE,
                                  seed=7)
        layout = PagedKVLayout.from_cache(caches[0])
        codec = Codec(case.preset, case.dim, layers)
        gen = torch.Generator().manual_seed(5)
        src_ids = torch.randperm(nb, generator=gen)[:24].tolist()
        dst_ids = torch.randperm(nb, generator=gen)[:24].tolist()
        # sequence start (sink row), partial blocks, a chunk not starting at a block boundary
        chunks = [(0, 40), (40, 9)] if SMOKE else [(0, 256), (256, 100), (356, 17)]
        ntok = chunks[-1][0] + chunks[-1][1]
        enc, total = make_items(codec, layers, case.heads, src_ids, chunks)
        fp8 = dtype == torch.float8_e4m3fn
        scales = [KVScales(*FP8_SCALES)] * layers if fp8 else None
        kw = {"kv_scales": FP8_SCALES} if fp8 else {}
        ref = torch.zeros(total, dtype=torch.uint8, device=DEVICE)
        tri = torch.full((total,), 0xA5, dtype=torch.uint8, device=DEVICE)
        for layer in range(layers):
            encode_into(codec, layer, caches[layer], layout, enc[layer], ref, impl="reference",
                        **kw)
        if DEVICE == "cuda" or os.environ.get("TW_BENCH_CPUREF") == "1":
            # informative: the reference on the CPU should write the same bytes as on the GPU
            try:
                cpu_caches = [c.cpu() for c in caches]
                cpu_layout = PagedKVLayout.from_cache(cpu_caches[0])
                if cpu_layout != layout:
                    raise ValueError(f"CPU copy reads as {cpu_layout}, not {layout}")
                cref = torch.zeros(total, dtype=torch.uint8)
                for layer in range(layers):
                    encode_into(codec, layer, cpu_caches[layer], cpu_layout, enc[layer], cref,
                                impl="reference", **kw)
                out["cpu_ref_equal"] = bool(torch.equal(cref, ref.cpu()))
            except Exception as exc:  # noqa: BLE001 - reported, not part of the verdict
                out["cpu_ref_equal"] = f"{type(exc).__name__}: {exc}"

        t1 = time.time()
        written = EncodePlan(codec, [(i, caches[i], layout, enc[i]) for i in range(layers)], tri,
                             cfg, scales)
        written.launch()
        sync()
        out["compile_encode_s"] = round(time.time() - t1, 2)
        bad = []
        for layer in range(layers):
            for it, n in zip(enc[layer], written.written[layer]):
                a = ref[it.out_offset : it.out_offset + n]
                b = tri[it.out_offset : it.out_offset + n]
                if not torch.equal(a, b):
                    diff = (a != b).nonzero().flatten()
                    bad.append(f"layer {layer} chunk@{it.token_start}: "
                               f"{diff.numel()} bytes differ, "
                               f"first at {int(diff[0])}/{n}")
        out["encode_bitexact"] = not bad
        out["encode_mismatch"] = bad[:4]
        dec = decode_items(enc, written.written, dst_ids)
        _, dst_ref = make_caches(layers, case.heads, case.dim, nb, case.layout, dtype, DEVICE,
                                 fill=7.0)
        big_tri, dst_tri = make_caches(layers, case.heads, case.dim, nb, case.layout, dtype, DEVICE,
                                       fill=7.0)
        for layer in range(layers):
            decode_into(codec, layer, dst_ref[layer], layout, dec[layer], ref, impl="reference",
                        **kw)
        t2 = time.time()
        plan = DecodePlan(codec, [(i, dst_tri[i], layout, dec[i]) for i in range(layers)], tri, cfg,
                          scales)
        plan.launch()
        plan.check()
        sync()
        out["compile_decode_s"] = round(time.time() - t2, 2)
        same = all(torch.equal(a.view(torch.uint8) if fp8 else a, b.view(torch.uint8) if fp8 else b)
                   for a, b in zip(dst_ref, dst_tri))
        out["decode_bitexact"] = same
        if not same:
            d = max(float((a.float() - b.float()).abs().max()) for a, b in zip(dst_ref, dst_tri))
            n = sum(int((a != b).sum()) for a, b in zip(dst_ref, dst_tri))
            out["decode_max_abs_diff"] = d
            out["decode_elems_differ"] = n
        # untouched slots keep the guard
        k, v = layout.views(dst_tri[0])
        touched = torch.zeros(nb, BLOCK, dtype=torch.bool, device=DEVICE)
        for t in range(ntok):
            touched[dst_ids[t // BLOCK], t % BLOCK] = True
        out["guard_intact"] = (bool((k[~touched].float() == 7.0).all())
                               and bool((v[~touched].float() == 7.0).all()))
        # a corrupted chunk (layer 1, chunk 1) is refused and nothing of it is written; each
        # program verifies the chunk it decodes, so the launch's valid chunks are decoded
        bad = dec[1][1]
        tri[bad.in_offset + 200] ^= 0x40
        _, dst_bad = make_caches(layers, case.heads, case.dim, nb, case.layout, dtype, DEVICE,
                                 fill=7.0)
        try:
            p = DecodePlan(codec, [(i, dst_bad[i], layout, dec[i]) for i in range(layers)], tri,
                           cfg, scales)
            p.launch()
            p.check()
            out["corruption_refused"] = False
        except Exception as exc:  # noqa: BLE001 - the type is reported
            out["corruption_refused"] = type(exc).__name__
        blocks, slots = layout.token_index(bad.block_ids, bad.token_start, bad.num_tokens,
                                           torch.device(DEVICE))
        kb, vb = layout.views(dst_bad[1])
        out["corruption_wrote_nothing"] = (bool((kb[blocks, slots].float() == 7.0).all())
                                           and bool((vb[blocks, slots].float() == 7.0).all()))
        want = [c.clone() for c in dst_ref]  # the reference everywhere but the refused chunk
        kw_, vw_ = layout.views(want[1])
        kw_[blocks, slots] = kb[blocks, slots]
        vw_[blocks, slots] = vb[blocks, slots]
        out["corruption_others_decoded"] = all(
            torch.equal(a.view(torch.uint8) if fp8 else a, b.view(torch.uint8) if fp8 else b)
            for a, b in zip(want, dst_bad))
        out["ok"] = bool(out["encode_bitexact"] and out["decode_bitexact"] and out["guard_intact"]
                         and out["corruption_refused"] and out["corruption_wrote_nothing"]
                         and out["corruption_others_decoded"])
    except Exception as exc:  # noqa: BLE001
        out["ok"] = False
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["traceback"] = traceback.format_exc()[-3000:]
    out["seconds"] = round(time.time() - t0, 1)
    return out


def check_cases(presets: list[str]) -> list[CheckCase]:
    """head_dim outer, the slowest compiles (hd256) first: the first wave's critical path."""
    if SMOKE:
        return [CheckCase(p, 64, 2, "LBNHC") for p in presets[:1]] + [
            CheckCase("k8v4", 128, 2, "LBHNC", "float16"),
            CheckCase("tq4", 64, 2, "LBNHC", "float8_e4m3fn")]
    cases = []
    for dim, heads in ((256, 2), (128, 8), (64, 3)):
        for preset in presets:
            for layout in ("LBNHC", "LBHNC"):
                cases.append(CheckCase(preset, dim, heads, layout))
    for preset in ("k8v4", "tq4", "k3v2"):
        if preset in presets:
            cases.append(CheckCase(preset, 128, 8, "LBNHC", "float16"))
    for preset in ("raw", "k8v4", "tq4", "k4v3"):  # fp8 e4m3 caches with a per-layer scale
        if preset in presets:
            cases.append(CheckCase(preset, 128, 8, "LBNHC", "float8_e4m3fn"))
            cases.append(CheckCase(preset, 64, 3, "LBHNC", "float8_e4m3fn"))
    return cases


HD256 = dict(layers=8, heads=4, dim=256)  # the head_dim 256 comparison below
SWEEP_GEOMS = {**MODELS, "hd256 x4 heads": HD256}
# launch shapes tried on the --sweep-presets (LBNHC), each checked and timed in the same run:
# (geometry, KernelConfig fields); {} = the default (e.g. dict(qmode=2) for the table quantizer)
SWEEP: list[tuple[str, dict[str, Any]]] = [
    ("Llama-3.1-8B", dict()),
    # register caps at the occupancy steps of a 128-thread program: <= 128 registers give 4
    # programs per SM, <= 168 give 3 (the uncapped encoders use 138-193, i.e. 2 or 3)
    ("Llama-3.1-8B", dict(max_registers=128)),
    ("Llama-3.1-8B", dict(max_registers=168)),
]


# ------------------------------------------------------------------------------------------
# 2. throughput
# ------------------------------------------------------------------------------------------
def bench_ms(fn: Callable[[], None]) -> float:
    if SMOKE:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def copy_baselines(dense_bytes: int) -> dict[str, float]:
    src = torch.empty(dense_bytes // 2, dtype=torch.bfloat16, device=DEVICE).normal_()
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return {"copy_ms": ms, "copy_GBps": 2 * dense_bytes / ms / 1e6}


def run_model(name: str, geom: dict[str, int], presets: list[str], layout: str,
              cfg: KernelConfig, log: Callable[[str], None],
              results: list[dict[str, Any]] | None = None,
              on_result: Callable[[], None] = lambda: None,
              cache_dtype: torch.dtype = torch.bfloat16) -> list[dict[str, Any]]:
    """Time every preset on one KV geometry; rows are appended to ``results`` as they come
    (``on_result`` after each), a preset that fails is logged and skipped. ``cache_dtype``
    float8_e4m3fn: vLLM's fp8 cache (1 byte per element, a scale per layer)."""
    layers, heads, dim = geom["layers"], geom["heads"], geom["dim"]
    nblocks_req = TOKENS // BLOCK
    nb = nblocks_req + 64
    big, caches = make_caches(layers, heads, dim, nb, layout, cache_dtype, DEVICE, seed=1)
    big_dst, dst = make_caches(layers, heads, dim, nb, layout, cache_dtype, DEVICE, fill=0.0)
    scales = [KVScales(*FP8_SCALES)] * layers if cache_dtype == torch.float8_e4m3fn else None
    layout_obj = PagedKVLayout.from_cache(caches[0])
    gen = torch.Generator().manual_seed(3)
    ids = torch.randperm(nb, generator=gen)[:nblocks_req].tolist()
    dids = torch.randperm(nb, generator=gen)[:nblocks_req].tolist()
    dense = layers * TOKENS * heads * dim * 2 * big.element_size()
    base = copy_baselines(dense)
    # the paged gather of the same blocks (all layers, K and V) into a contiguous buffer
    rows = (big.view(torch.uint8) if big.element_size() == 1 else big).view(layers * 2 * nb, -1)
    gidx = torch.tensor([(layer * 2 + kv) * nb + b
                         for layer in range(layers) for kv in range(2) for b in ids],
                        device=DEVICE)
    gout = torch.empty(gidx.numel(), rows.shape[1], dtype=rows.dtype, device=DEVICE)
    gather_ms = bench_ms(lambda: torch.index_select(rows, 0, gidx, out=gout))
    base["gather_ms"] = gather_ms
    base["gather_GBps"] = 2 * dense / gather_ms / 1e6
    log(f"{name} {layout} {str(cache_dtype).replace('torch.', '')}: "
        f"dense {dense / 1e6:.1f} MB; copy {base['copy_GBps']:.0f} GB/s, "
        f"paged gather {base['gather_GBps']:.0f} GB/s")
    results = [] if results is None else results
    chunks = [(c, CHUNK) for c in range(0, TOKENS, CHUNK)]
    for preset in presets:
        try:
            results.append(_time_preset(name, preset, layout, layers, heads, dim, caches, dst,
                                        layout_obj, ids, dids, chunks, dense, base, cfg, log,
                                        scales))
            on_result()
        except Exception as exc:  # noqa: BLE001 - reported, the other presets still run
            log(f"  {preset} failed: {type(exc).__name__}: {exc}\n{traceback.format_exc()[-2000:]}")
    del big, big_dst
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return results


def _time_preset(name, preset, layout, layers, heads, dim, caches, dst, layout_obj, ids, dids,
                 chunks, dense, base, cfg, log, scales=None) -> dict[str, Any]:
    codec = Codec(preset, dim, layers)
    enc, total = make_items(codec, layers, heads, ids, chunks)
    staging = torch.zeros(total, dtype=torch.uint8, device=DEVICE)
    jobs = [(i, caches[i], layout_obj, enc[i]) for i in range(layers)]
    batched = EncodePlan(codec, jobs, staging, cfg, scales)
    per_layer = [EncodePlan(codec, [job], staging, cfg, None if scales is None else [scales[i]])
                 for i, job in enumerate(jobs)]
    batched.launch()
    sync()
    comp = sum(sum(w) for w in batched.written)
    dec = decode_items(enc, batched.written, dids)
    djobs = [(i, dst[i], layout_obj, dec[i]) for i in range(layers)]
    dbatched = DecodePlan(codec, djobs, staging, cfg, scales)
    dper_layer = [DecodePlan(codec, [job], staging, cfg, None if scales is None else [scales[i]])
                  for i, job in enumerate(djobs)]
    dbatched.launch()
    dbatched.check()
    r: dict[str, Any] = {"model": name + (" fp8 cache" if scales else ""), "layout": layout,
                         "preset": preset,
                         "dense_MB": dense / 1e6, "wire_MB": comp / 1e6, "ratio": dense / comp}
    # registers / spill bytes per thread of each launch (encode; decode, verification fused in)
    r["regs"] = [[getattr(k, "n_regs", None), getattr(k, "n_spills", None)]
                 for k in getattr(batched, "compiled", []) + getattr(dbatched, "compiled", [])]
    r["enc_batched_ms"] = bench_ms(batched.launch)
    r["enc_layer_ms"] = bench_ms(lambda: [p.launch() for p in per_layer])
    r["dec_batched_ms"] = bench_ms(dbatched.launch)
    r["dec_layer_ms"] = bench_ms(lambda: [p.launch() for p in dper_layer])
    # the full API per layer (host validation and tables included), as the connector calls it
    r["enc_api_ms"] = bench_ms(lambda: [
        encode_into(codec, i, caches[i], layout_obj, enc[i], staging,
                    kv_scales=None if scales is None else FP8_SCALES) for i in range(layers)])
    # CUDA graph of the per-layer launches
    try:
        if SMOKE:
            raise RuntimeError("no CUDA graphs on CPU")
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for p in per_layer:
                p.launch()
            torch.cuda.synchronize()
            with torch.cuda.graph(g, stream=s):
                for p in per_layer:
                    p.launch()
        torch.cuda.current_stream().wait_stream(s)
        r["enc_graph_ms"] = bench_ms(g.replay)
    except Exception as exc:  # noqa: BLE001
        r["enc_graph_ms"] = None
        log(f"  cuda graph capture failed: {type(exc).__name__}: {exc}")
    for k in ("enc_batched", "enc_layer", "dec_batched", "dec_layer", "enc_api", "enc_graph"):
        ms = r.get(f"{k}_ms")
        if ms:
            r[f"{k}_eff_GBps"] = (dense + comp) / ms / 1e6
            r[f"{k}_dense_GBps"] = dense / ms / 1e6
            r[f"{k}_vs_copy"] = r[f"{k}_eff_GBps"] / base["copy_GBps"]
    r.update(base)
    log(f"  {preset:5s} x{r['ratio']:.2f} enc {r['enc_batched_ms']:.3f} ms "
        f"({r['enc_batched_eff_GBps']:.0f} GB/s, {100 * r['enc_batched_vs_copy']:.0f}% of copy) "
        f"per-layer {r['enc_layer_ms']:.3f} ms | dec {r['dec_batched_ms']:.3f} ms "
        f"({r['dec_batched_eff_GBps']:.0f} GB/s, {100 * r['dec_batched_vs_copy']:.0f}%) "
        f"per-layer {r['dec_layer_ms']:.3f} ms | api {r['enc_api_ms']:.2f} ms | regs {r['regs']}")
    return r


def table(results: list[dict[str, Any]]) -> str:
    head = ("| model | layout | preset | ratio | encode ms | enc GB/s eff | enc dense GB/s "
            "| enc % copy "
            "| enc per-layer ms | enc graph ms | decode ms | dec GB/s eff | dec dense GB/s "
            "| dec % copy "
            "| dec per-layer ms | api enc ms | copy GB/s | paged gather GB/s |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        g = r.get("enc_graph_ms")
        lines.append(
            f"| {r['model']} | {r['layout']} | {r['preset']} | {r['ratio']:.2f} "
            f"| {r['enc_batched_ms']:.3f} "
            f"| {r['enc_batched_eff_GBps']:.0f} | {r['enc_batched_dense_GBps']:.0f} "
            f"| {100 * r['enc_batched_vs_copy']:.0f}% | {r['enc_layer_ms']:.3f} | "
            f"{'%.3f' % g if g else '-'} | {r['dec_batched_ms']:.3f} "
            f"| {r['dec_batched_eff_GBps']:.0f} "
            f"| {r['dec_batched_dense_GBps']:.0f} | {100 * r['dec_batched_vs_copy']:.0f}% "
            f"| {r['dec_layer_ms']:.3f} | {r['enc_api_ms']:.2f} | {r['copy_GBps']:.0f} "
            f"| {r['gather_GBps']:.0f} |"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path,
                    default=Path(os.environ.get("OUT", "bench/results/kernels")))
    ap.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 4))
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--skip-sweep", action="store_true")
    ap.add_argument("--presets", default=",".join(list_presets()))
    ap.add_argument("--layouts", default="LBNHC,LBHNC")
    ap.add_argument("--check-presets", default=None,
                    help="presets of the correctness pass (default: --presets; '' for none)")
    ap.add_argument("--fp8", action="store_true",
                    help="also time each model on an fp8 e4m3 cache "
                         "(bytes counted at 1 per element)")
    ap.add_argument("--sweep-presets", default="tq4,tq3",
                    help="presets of the launch-shape sweep (checked and timed per configuration)")
    ap.add_argument("--skip-table", action="store_true",
                    help="no model tables (e.g. a run of the launch-shape sweep alone)")
    ap.add_argument("--check-deadline", type=float, default=0.0,
                    help="seconds after which unfinished checks are abandoned (0: none) so the "
                    "throughput table still runs inside a device call's limit")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    logf = open(args.out / "log.txt", "a")

    def log(msg: str) -> None:
        print(msg, flush=True)
        logf.write(msg + "\n")
        logf.flush()

    import triton

    if SMOKE:
        env = {"gpu": "cpu (Triton interpreter smoke run)", "sms": 0}
    else:
        props = torch.cuda.get_device_properties(0)
        env = {"gpu": props.name, "sms": props.multi_processor_count}
    env.update({"torch": torch.__version__, "triton": triton.__version__,
                "cuda": torch.version.cuda, "python": sys.version.split()[0],
                "command": " ".join(sys.argv)})
    log(json.dumps(env))
    report: dict[str, Any] = {"env": env}
    t0 = time.time()

    def save() -> None:
        """results.json as it stands (a run cut off by a time limit keeps what it measured)."""
        (args.out / "results.json").write_text(json.dumps(report, indent=1, default=str))

    # 1. correctness + parallel compilation, one process per configuration
    check_presets = [p for p in (args.presets if args.check_presets is None
                                 else args.check_presets).split(",") if p]
    cases = [] if args.skip_check else check_cases(check_presets)
    if not args.skip_sweep:
        for preset in args.sweep_presets.split(","):
            for gname, c in SWEEP:
                g = SWEEP_GEOMS[gname]
                if c:
                    cases.append(CheckCase(preset, g["dim"], min(g["heads"], 8), "LBNHC", config=c))
    checks: list[dict[str, Any]] = []
    report["checks"] = checks
    first = [c for c in cases if c.layout == "LBNHC"]
    waves = [first, [c for c in cases if c.layout != "LBNHC"]]  # 2nd wave: compiled kernels reused
    ctx = __import__("multiprocessing").get_context("spawn")
    abandoned: list[str] = []
    for wave in waves:
        if not wave:
            continue
        if args.check_deadline and time.time() - t0 > args.check_deadline:
            abandoned += [c.name for c in wave]
            continue
        ex = ProcessPoolExecutor(max_workers=args.jobs, mp_context=ctx)
        futs = {ex.submit(run_check, c): c for c in wave}
        pending = set(futs)
        while pending:
            left = args.check_deadline - (time.time() - t0) if args.check_deadline else None
            if left is not None and left <= 0:
                break
            done, pending = wait(pending, timeout=left, return_when=FIRST_COMPLETED)
            for f in done:
                try:
                    r = f.result()
                except Exception as exc:  # noqa: BLE001 - a crashed worker
                    r = {"case": futs[f].name, "ok": False, "error": f"worker died: {exc}"}
                checks.append(r)
                flag = "OK  " if r.get("ok") else "FAIL"
                log(f"[check {len(checks)}/{len(cases)} {time.time() - t0:5.0f}s] {flag} "
                    f"{r['case']} "
                    f"enc={r.get('encode_bitexact')} dec={r.get('decode_bitexact')} "
                    f"guard={r.get('guard_intact')} corrupt={r.get('corruption_refused')} "
                    f"cpu_ref={r.get('cpu_ref_equal')} ({r.get('seconds')}s) {r.get('error', '')}")
                if r.get("traceback"):
                    logf.write(r["traceback"] + "\n")
            save()
        if pending:  # deadline: stop the workers this script started
            abandoned += [futs[f].name for f in pending]
            procs = list(getattr(ex, "_processes", {}).values())
            ex.shutdown(wait=False, cancel_futures=True)
            for proc in procs:
                proc.kill()
        else:
            ex.shutdown()
    n_ok = sum(1 for r in checks if r.get("ok"))
    report["checks_abandoned"] = abandoned
    log(f"correctness: {n_ok}/{len(checks)} configurations bit-exact ({time.time() - t0:.0f}s)"
        + (f"; {len(abandoned)} abandoned at the deadline: {abandoned}" if abandoned else ""))
    save()
    # 2. sweep of launch shapes on hd128 (kernels compiled above)
    cfg = KernelConfig()
    sweep = []
    if not args.skip_sweep:
        for gname, c in SWEEP:
            try:
                res = run_model(gname, SWEEP_GEOMS[gname], args.sweep_presets.split(","), "LBNHC",
                                KernelConfig(**c), log)
                for r in res:
                    r["config"] = c
                    r["model"] = f"{gname} " + (
                        ",".join(f"{k}={v}" for k, v in c.items()) or "default")
                    sweep.append(r)
                    log(f"sweep {gname} {c}: {r['preset']} enc {r['enc_batched_ms']:.3f} ms "
                        f"({100 * r['enc_batched_vs_copy']:.0f}%) dec {r['dec_batched_ms']:.3f} ms "
                        f"({100 * r['dec_batched_vs_copy']:.0f}%) regs {r.get('regs')}")
            except Exception as exc:  # noqa: BLE001
                log(f"sweep {c} failed: {type(exc).__name__}: {exc}")
    report["sweep"] = sweep
    results: list[dict[str, Any]] = []
    hd: list[dict[str, Any]] = []
    report["results"] = results
    report["hd256"] = hd

    def markdown() -> list[str]:
        n_ok = sum(1 for r in checks if r.get("ok"))
        md = ["## Kernels (H200)", "",
              f"`{env['command']}` on {env['gpu']} ({env['sms']} SMs), torch "
              f"{env['torch']}, triton {env['triton']}, CUDA {env['cuda']}", "",
              f"correctness: {n_ok}/{len(checks)} configurations bit-exact"
              + (f", {len(abandoned)} abandoned at the deadline" if abandoned else ""), ""]
        fail_fields = ('encode_bitexact', 'decode_bitexact', 'guard_intact', 'corruption_refused',
                       'corruption_wrote_nothing', 'corruption_others_decoded')
        md += [f"- FAIL {r['case']}: {r.get('error') or {k: r.get(k) for k in fail_fields}}"
               for r in checks if not r.get("ok")]
        md += ["", table(results), "", "### head_dim 256 vs two 128 groups", "", table(hd)]
        if sweep:
            md += ["", "### launch shapes", "", table(sweep)]
        return md

    def save_all() -> None:
        save()
        (args.out / "results.md").write_text("\n".join(markdown()) + "\n")

    # 3. the table
    for name, geom in ({} if args.skip_table else MODELS).items():
        for layout in args.layouts.split(","):
            presets = args.presets.split(",") if layout == "LBNHC" else ["tq4", "tq3"]
            try:
                run_model(name, geom, presets, layout, cfg, log, results, save_all)
            except Exception as exc:  # noqa: BLE001
                log(f"{name} {layout} failed: {type(exc).__name__}: {exc}\n"
                    f"{traceback.format_exc()}")
        if args.fp8:  # the same model on vLLM's fp8 cache (1 byte per element, a scale per layer)
            try:
                run_model(name, geom, args.presets.split(","), "LBNHC", cfg, log, results,
                          save_all, cache_dtype=torch.float8_e4m3fn)
            except Exception as exc:  # noqa: BLE001
                log(f"{name} fp8 failed: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    # 4. head_dim 256: one 256-wide transform vs two 128-wide groups (same bytes), throughput only
    nl = 1 if SMOKE else 8
    # smoke: the first --presets only (hd256 tq4/tq3 take minutes in the Triton interpreter)
    hd_presets = args.presets.split(",")[:1] if SMOKE else ["tq4", "tq3"]
    for name, geom in () if args.skip_table else (
            ("hd256 x4 heads", dict(HD256, layers=nl)),
            ("hd128 x8 heads (2x128 groups)", dict(layers=nl, heads=8, dim=128))):
        try:
            run_model(name, geom, hd_presets, "LBNHC", cfg, log, hd, save_all)
        except Exception as exc:  # noqa: BLE001
            log(f"{name} failed: {type(exc).__name__}: {exc}")
    save_all()
    log("\n".join(markdown()))
    log(f"total {time.time() - t0:.0f}s")
    return 0 if all(r.get("ok") for r in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
