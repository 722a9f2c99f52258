"""The codec kernels against an earlier commit's, in the same run: a table that shows a change.

A kernel change that costs 10% is invisible across sittings (an H200's timings move that much
from one machine to the next); timed side by side in one run, it is not. Two steps:

1. Here, in a git checkout: extract a commit's ``codec/`` and ``kernels/`` as an importable
   package tree (it travels with the working tree to the GPU machine)::

       python -m bench.kernels_vs baseline ccbacde .bench_baseline

2. On the GPU machine, with turbowire installed: time the installed kernels and the baseline's
   on the same shapes, each in its own process, and print one table::

       python -m bench.kernels_vs run --baseline .bench_baseline --out OUT

Shapes: Llama-3.1-8B KV (32 layers, 8 KV heads, hd128, bf16, block size 16), 4096 tokens, block
ids shuffled, all layers in one plan; chunks of 256 tokens (the store path, the batched figures)
and of one block (the P2P path). Each side also reports a digest of its encoded bytes and of the
decoded cache, so the table says whether the two commits still agree bit for bit.
Smoke run on CPU (Triton interpreter, tiny shapes): ``TW_BENCH_SMOKE=1``.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

SMOKE = os.environ.get("TW_BENCH_SMOKE") == "1"
PRESETS = ("tq4", "k4v3", "k8v4", "tq3")
CHUNKS = (256, 16)
LAYERS, HEADS, DIM, TOKENS, BLOCK = 32, 8, 128, 4096, 16
if SMOKE:
    LAYERS, HEADS, TOKENS = 2, 2, 64
    PRESETS, CHUNKS = ("tq4",), (32, 16)


def make_baseline(ref: str, dest: Path) -> None:
    """``dest/turbowire/{codec,kernels}`` (+ the top-level modules they import) from ``ref``."""
    files = ["codec", "kernels", "turbowire/__init__.py", "turbowire/errors.py"]
    tar = subprocess.run(["git", "archive", ref, *files], check=True, capture_output=True).stdout
    if dest.exists():
        shutil.rmtree(dest)
    pkg = dest / "turbowire"
    pkg.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(tar)) as tf:
        for m in tf.getmembers():
            if not m.isfile() or m.name.endswith(".so"):
                continue
            name = m.name.removeprefix("turbowire/")
            out = pkg / name
            out.parent.mkdir(parents=True, exist_ok=True)
            data = tf.extractfile(m)
            assert data is not None
            out.write_bytes(data.read())
    (dest / "REF").write_text(
        subprocess.run(["git", "rev-parse", "--short", ref], check=True, capture_output=True,
                       text=True).stdout.strip() + "\n")


def _time(fn: Any) -> float:
    if SMOKE:
        fn()
        return 0.0
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median"))


def time_side(out: Path, presets: tuple[str, ...] = PRESETS,
              chunks: tuple[int, ...] = CHUNKS) -> None:
    """Time the importable turbowire's kernels on every (preset, chunk) shape; write JSON."""
    import torch

    from turbowire.codec import Codec
    from turbowire.kernels import DecodeItem, EncodeItem, PagedKVLayout
    try:
        from turbowire.kernels.triton_launch import DecodePlan, EncodePlan
    except ImportError:  # a baseline from before 2026-12-04 (the module's earlier name)
        from turbowire.kernels.triton_dispatch import DecodePlan, EncodePlan  # type: ignore

    dev = "cpu" if SMOKE else "cuda"
    nb = TOKENS // BLOCK + 64
    gen = torch.Generator(device=dev).manual_seed(1)
    src = (torch.randn((LAYERS, 2, nb, BLOCK, HEADS, DIM), generator=gen, device=dev) * 1.5
           + torch.linspace(-2, 2, DIM, device=dev))
    src[..., 3] *= 6.0  # an outlier channel
    src = src.to(torch.bfloat16)
    dst = torch.zeros_like(src)
    layout = PagedKVLayout.from_cache(src[0])
    perm = torch.Generator().manual_seed(3)
    ids = torch.randperm(nb, generator=perm)[: TOKENS // BLOCK].tolist()
    dids = torch.randperm(nb, generator=perm)[: TOKENS // BLOCK].tolist()
    rows = []
    for preset in presets:
        codec = Codec(preset, DIM, LAYERS)
        for chunk in chunks:
            enc, off = [], 0
            for layer in range(LAYERS):
                row = []
                for start in range(0, TOKENS, chunk):
                    row.append(EncodeItem(ids, start, chunk, off, tag=(layer << 20) + start + 1))
                    off += (codec.encoded_nbytes(layer, chunk, HEADS, start) + 63) // 64 * 64
                enc.append(row)
            staging = torch.zeros(off, dtype=torch.uint8, device=dev)
            eplan = EncodePlan(codec, [(i, src[i], layout, enc[i]) for i in range(LAYERS)],
                               staging)
            eplan.launch()
            dec = [[DecodeItem(dids, it.token_start, it.num_tokens, it.out_offset, n, it.tag)
                    for it, n in zip(r, w)] for r, w in zip(enc, eplan.written)]
            dst.zero_()
            dplan = DecodePlan(codec, [(i, dst[i], layout, dec[i]) for i in range(LAYERS)],
                               staging)
            dplan.launch()
            dplan.check()
            rows.append({
                "preset": preset, "chunk": chunk,
                "dense_bytes": LAYERS * 2 * TOKENS * HEADS * DIM * src.element_size(),
                "encode_ms": _time(eplan.launch), "decode_ms": _time(dplan.launch),
                "wire_digest": hashlib.sha256(staging.cpu().numpy().tobytes()).hexdigest()[:16],
                "cache_digest": hashlib.sha256(
                    dst.view(torch.int16).cpu().numpy().tobytes()).hexdigest()[:16],
                "registers": [[getattr(k, "n_regs", None), getattr(k, "n_spills", None)]
                              for k in eplan.compiled + dplan.compiled],
            })
            print(json.dumps(rows[-1]), flush=True)
            out.write_text(json.dumps(rows, indent=1))  # a run cut short keeps what it timed
            del staging


def table(base: list[dict[str, Any]], cur: list[dict[str, Any]], ref: str) -> str:
    """Markdown, at most 80 columns."""
    old = {(r["preset"], r["chunk"]): r for r in base}
    lines = [f"ms; then = {ref}, x = now / then, same = bit-identical bytes and cache", "",
             "| preset | chunk | enc then | enc now | x | dec then | dec now | x | same |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in cur:
        b = old.get((r["preset"], r["chunk"]))
        if b is None:
            continue
        same = ("yes" if b["wire_digest"] == r["wire_digest"]
                and b["cache_digest"] == r["cache_digest"] else "NO")

        def ratio(key: str, b: dict[str, Any] = b, r: dict[str, Any] = r) -> str:
            return f"{r[key] / b[key]:.2f}" if b[key] else "-"

        lines.append(f"| {r['preset']} | {r['chunk']} | {b['encode_ms']:.3f} "
                     f"| {r['encode_ms']:.3f} | {ratio('encode_ms')} | {b['decode_ms']:.3f} "
                     f"| {r['decode_ms']:.3f} | {ratio('decode_ms')} | {same} |")
    return "\n".join(lines)


def run(baseline: Path, out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    ref = (baseline / "REF").read_text().strip() if (baseline / "REF").exists() else "base"
    env = dict(os.environ)
    cmd = [sys.executable, "-m", "bench.kernels_vs", "time"]
    sides = {"base": out / "baseline.json", "now": out / "current.json"}
    for side in ("base", "now", "base"):  # the baseline twice: its spread bounds the noise
        e = dict(env)
        if side == "base":
            e["PYTHONPATH"] = os.pathsep.join([str(baseline.resolve()), env.get("PYTHONPATH", "")])
        path = sides[side]
        subprocess.run([*cmd, str(path.with_suffix(f".{side}.tmp"))], env=e, check=True)
        path.with_suffix(f".{side}.tmp").replace(path)
        if side == "base" and not (out / "baseline_first.json").exists():
            shutil.copy(path, out / "baseline_first.json")
    base = json.loads(sides["base"].read_text())
    first = {(r["preset"], r["chunk"]): r
             for r in json.loads((out / "baseline_first.json").read_text())}
    for r in base:  # the faster of the two baseline runs, so noise can only favour it
        f = first[(r["preset"], r["chunk"])]
        r["encode_ms"] = min(r["encode_ms"], f["encode_ms"])
        r["decode_ms"] = min(r["decode_ms"], f["decode_ms"])
    md = table(base, json.loads(sides["now"].read_text()), ref)
    (out / "results.md").write_text(md + "\n")
    print(md)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.kernels_vs",
        description="The codec kernels against an earlier commit's, timed in the same run.",
        epilog="example: python -m bench.kernels_vs baseline ccbacde .bench_baseline; then, on "
               "the GPU: python -m bench.kernels_vs run --baseline .bench_baseline --out OUT",
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("baseline", help="extract REF's codec/ and kernels/ into DIR (git)")
    b.add_argument("ref")
    b.add_argument("dir", type=Path)
    r = sub.add_parser("run", help="time the installed kernels and the baseline's, one table")
    r.add_argument("--baseline", type=Path, required=True)
    r.add_argument("--out", type=Path, required=True)
    t = sub.add_parser("time", help="time the importable kernels alone, write JSON (`run` "
                       "calls it; alone with --presets all it feeds `turbowire recommend`)")
    t.add_argument("out", type=Path)
    t.add_argument("--presets", default=",".join(PRESETS),
                   help="comma-separated presets, or 'all' (every lossy preset)")
    t.add_argument("--chunks", default=",".join(map(str, CHUNKS)),
                   help="comma-separated chunk sizes in tokens")
    args = ap.parse_args()
    if args.cmd == "baseline":
        make_baseline(args.ref, args.dir)
        return 0
    if args.cmd == "time":
        from turbowire.codec import list_presets

        presets = tuple(p for p in list_presets() if p != "raw") if args.presets == "all" \
            else tuple(p for p in args.presets.split(",") if p)
        unknown = sorted(set(presets) - set(list_presets()))
        if unknown:
            ap.error(f"unknown presets {unknown}; known: {', '.join(list_presets())}")
        chunks = tuple(int(c) for c in args.chunks.split(",") if c)
        if SMOKE:
            presets, chunks = PRESETS, CHUNKS
        time_side(args.out, presets, chunks)
        return 0
    return run(args.baseline, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
