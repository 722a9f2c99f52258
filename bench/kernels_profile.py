"""One launch of each codec kernel on Llama-3.1-8B-shaped KV, for Nsight Compute.

``ncu --profile-from-start off --clock-control none python3 -m bench.kernels_profile``: the
kernels are compiled and warmed before cudaProfilerStart, so only the timed launches (raw encode,
tq4 encode, verify + tq4 decode) are profiled. Prints each launch's time for reference.
"""

from __future__ import annotations

import argparse
import sys

import torch

from bench import kernels as kb  # caches, items, shapes (and TW_BENCH_SMOKE=1's CPU mode)
from turbowire.codec import Codec
from turbowire.kernels import PagedKVLayout
from turbowire.kernels.triton_launch import DecodePlan, EncodePlan


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.kernels_profile",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("presets", nargs="*", default=["raw", "tq4"])
    presets = ap.parse_args().presets
    geom = kb.MODELS["Llama-3.1-8B"]
    layers, heads, dim = geom["layers"], geom["heads"], geom["dim"]
    nreq = kb.TOKENS // kb.BLOCK
    nb = nreq + 64
    _, caches = kb.make_caches(layers, heads, dim, nb, "LBNHC", torch.bfloat16, kb.DEVICE, seed=1)
    _, dst = kb.make_caches(layers, heads, dim, nb, "LBNHC", torch.bfloat16, kb.DEVICE, fill=0.0)
    layout = PagedKVLayout.from_cache(caches[0])
    gen = torch.Generator().manual_seed(3)
    ids = torch.randperm(nb, generator=gen)[:nreq].tolist()
    dids = torch.randperm(nb, generator=gen)[:nreq].tolist()
    chunks = [(c, kb.CHUNK) for c in range(0, kb.TOKENS, kb.CHUNK)]
    plans = []
    for preset in presets:
        codec = Codec(preset, dim, layers)
        enc, total = kb.make_items(codec, layers, heads, ids, chunks)
        staging = torch.zeros(total, dtype=torch.uint8, device=kb.DEVICE)
        ep = EncodePlan(codec, [(i, caches[i], layout, enc[i]) for i in range(layers)], staging)
        ep.launch()
        dec = kb.decode_items(enc, ep.written, dids)
        dp = DecodePlan(codec, [(i, dst[i], layout, dec[i]) for i in range(layers)], staging)
        dp.launch()
        dp.check()
        plans.append((preset, ep, dp))
    if kb.DEVICE != "cuda":  # TW_BENCH_SMOKE=1: the plans built and ran, nothing to profile
        print(f"smoke: {len(plans)} presets encoded and decoded")
        return 0
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for preset, ep, dp in plans:
        for what, fn in (("encode", ep.launch), ("verify+decode", dp.launch)):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            print(f"{preset} {what}: {a.elapsed_time(b):.3f} ms (under the profiler)", flush=True)
    torch.cuda.cudart().cudaProfilerStop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
