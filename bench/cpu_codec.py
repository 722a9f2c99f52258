"""CPU codec throughput: the C kernels (kernels/cpu/) against the reference codec, on one core.

Both run through the public entry points (``turbowire.kernels.encode_into`` / ``decode_into``
with ``impl="cpu"`` and ``impl="reference"``) on a real vLLM CPU-layout paged cache
[num_blocks, H, block_size, 2*D] bf16, chunks of 256 tokens, so the numbers include the gather,
header, checksums, verification and scatter. Rates are K+V elements per second (and GB/s of the
dense bf16 KV they stand for); "wall" is the best of the repeats in wall-clock time, "cpu" the best
in thread CPU time (the two differ when the machine is shared). The last table times a whole
Llama-3-8B-like 2k-token prompt (8 layers x 8 KV heads x 128 = 33.5M elements).

``--layouts`` picks how the cache is laid out, side by side in one run: ``packed`` (K|V per
token in the last dim, unit-stride rows), and vLLM CPU attention's own placements as its
``cpu_attn_reshape_and_cache`` writes them for an ISA (``vec``: keys transposed per block;
``amx``: K and V in VNNI pairs for AMX tiles), probed exactly as the connector does.

Run pinned to one core (engines are pinned too)::

    taskset -c 1 python -m bench.cpu_codec
    taskset -c 1 python -m bench.cpu_codec --head-dims 128 --presets tq4,k8v4 --markdown
    taskset -c 1 python -m bench.cpu_codec --layouts vec,amx --block-size 128 --markdown
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from turbowire.codec import Codec, list_presets
from turbowire.kernels import (
    DecodeItem,
    EncodeItem,
    PagedKVLayout,
    cpu_binding,
    decode_into,
    encode_into,
)

CHUNK = 256


@dataclass(frozen=True)
class Rate:
    wall: float  # elements per second
    cpu: float


def best_rate(fn: Callable[[], object], elements: int, repeats: int) -> Rate:
    fn()  # warm-up (tables, page faults)
    wall = cpu = float("inf")
    for _ in range(repeats):
        w0, c0 = time.perf_counter(), time.thread_time()
        fn()
        wall = min(wall, time.perf_counter() - w0)
        cpu = min(cpu, time.thread_time() - c0)
    return Rate(elements / wall, elements / max(cpu, 1e-9))


@dataclass
class Case:
    """One layer's paged cache with ``tokens`` tokens and its chunked encode/decode items."""

    codec: Codec
    cache: torch.Tensor
    layout: PagedKVLayout
    enc: list[EncodeItem]
    dec: list[DecodeItem]
    staging: torch.Tensor
    elements: int

    @classmethod
    def build(
        cls, preset: str, dim: int, tokens: int, heads: int, block_size: int, seed: int = 0,
        layout_name: str = "packed",
    ) -> Case:
        g = torch.Generator().manual_seed(seed)
        nb = tokens // block_size + 2
        cache = torch.randn(nb, heads, block_size, 2 * dim, generator=g)
        cache[..., 3] += 8.0  # a key outlier channel with an offset, as real keys have
        cache = cache.to(torch.bfloat16)
        layout = cache_layout(cache, dim, layout_name)
        codec = Codec(preset, dim, num_layers=8)
        ids = torch.randperm(nb, generator=g)[: (tokens + block_size - 1) // block_size].tolist()
        enc, off = [], 0
        for start in range(0, tokens, CHUNK):
            n = min(CHUNK, tokens - start)
            enc.append(EncodeItem(ids, start, n, off, tag=7))
            off += (codec.encoded_nbytes(3, n, heads, start) + 63) // 64 * 64
        staging = torch.zeros(off, dtype=torch.uint8)
        sizes = encode_into(codec, 3, cache, layout, enc, staging, impl="cpu")
        dec = [
            DecodeItem(ids, e.token_start, e.num_tokens, e.out_offset, s, 7)
            for e, s in zip(enc, sizes, strict=True)
        ]
        return cls(codec, cache, layout, enc, dec, staging, 2 * tokens * heads * dim)

    def encode(self, impl: str) -> None:
        encode_into(self.codec, 3, self.cache, self.layout, self.enc, self.staging, impl=impl)

    def decode(self, impl: str, dst: torch.Tensor) -> None:
        decode_into(self.codec, 3, dst, self.layout, self.dec, self.staging, impl=impl)


def cache_layout(cache: torch.Tensor, dim: int, name: str) -> PagedKVLayout:
    """``packed``: K|V per token; any other name: vLLM CPU attention's placement for that ISA."""
    if name == "packed":
        return PagedKVLayout.from_cache(cache)
    from turbowire.kernels.cpu_attn_layout import cpu_attn_layout

    return cpu_attn_layout(cache, dim, name)


def encode_all(cases: list[Case]) -> None:
    for c in cases:
        c.encode("cpu")


def decode_all(cases: list[Case], dsts: list[torch.Tensor]) -> None:
    for c, d in zip(cases, dsts, strict=True):
        c.decode("cpu", d)


def fmt(rate: float) -> str:
    return f"{rate / 1e6:,.1f}"


def gbs(rate: float) -> str:
    return f"{rate * 2 / 1e9:.2f}"  # bf16: 2 bytes per dense element


def run(args: argparse.Namespace) -> tuple[list[list[str]], list[list[str]], list[dict]]:
    rows: list[list[str]] = []
    records: list[dict] = []  # the per-layer rates as numbers (--json)
    for dim, preset, lay in itertools.product(args.head_dims, args.presets, args.layouts):
        c = Case.build(preset, dim, args.tokens, args.heads, args.block_size, layout_name=lay)
        r = Case.build(preset, dim, args.ref_tokens, args.heads, args.block_size,
                       layout_name=lay)
        dst_c, dst_r = torch.empty_like(c.cache), torch.empty_like(r.cache)
        ce = best_rate(partial(c.encode, "cpu"), c.elements, args.repeats)
        cd = best_rate(partial(c.decode, "cpu", dst_c), c.elements, args.repeats)
        re = best_rate(partial(r.encode, "reference"), r.elements, args.ref_repeats)
        rd = best_rate(partial(r.decode, "reference", dst_r), r.elements, args.ref_repeats)
        records.append(dict(head_dim=dim, preset=preset, layout=lay, chunk_tokens=CHUNK,
                            c_encode_elements_per_s=ce.wall, c_decode_elements_per_s=cd.wall,
                            ref_encode_elements_per_s=re.wall, ref_decode_elements_per_s=rd.wall))
        rows.append(
            [
                f"hd{dim}",
                preset,
                lay,
                fmt(re.wall),
                fmt(ce.wall),
                fmt(ce.cpu),
                gbs(ce.wall),
                f"{ce.wall / re.wall:.0f}x",
                fmt(rd.wall),
                fmt(cd.wall),
                fmt(cd.cpu),
                gbs(cd.wall),
                f"{cd.wall / rd.wall:.0f}x",
            ]
        )
    prompt_rows: list[list[str]] = []
    for preset, lay in itertools.product(args.prompt_presets, args.layouts):
        cases = [
            Case.build(preset, 128, 2048, 8, args.block_size, seed=layer, layout_name=lay)
            for layer in range(8)
        ]
        dsts = [torch.empty_like(c.cache) for c in cases]
        elements = sum(c.elements for c in cases)
        enc = best_rate(partial(encode_all, cases), elements, args.repeats)
        dec = best_rate(partial(decode_all, cases, dsts), elements, args.repeats)
        wire = sum(sum(i.nbytes for i in c.dec) for c in cases)
        link = wire * 8 / 1e9  # seconds on a 1 Gbit/s link
        prompt_rows.append(
            [
                preset,
                lay,
                f"{elements / 1e6:.1f}M",
                f"{wire / 1e6:.1f} MB",
                f"{elements * 2 / wire:.2f}x",
                f"{elements / enc.wall * 1e3:.0f} ms ({elements / enc.cpu * 1e3:.0f})",
                f"{elements / dec.wall * 1e3:.0f} ms ({elements / dec.cpu * 1e3:.0f})",
                f"{link * 1e3:.0f} ms",
                f"{elements * 2 * 8 / 1e9 * 1e3:.0f} ms",
            ]
        )
    return rows, prompt_rows, records


HEAD = [
    "hd",
    "preset",
    "layout",
    "ref enc M/s",
    "C enc M/s",
    "C enc M/s (cpu)",
    "C enc GB/s",
    "enc x",
    "ref dec M/s",
    "C dec M/s",
    "C dec M/s (cpu)",
    "C dec GB/s",
    "dec x",
]
PROMPT_HEAD = [
    "preset",
    "layout",
    "KV elements",
    "wire bytes",
    "ratio",
    "C encode wall (cpu)",
    "C decode wall (cpu)",
    "wire @1 Gbit/s",
    "dense bf16 @1 Gbit/s",
]


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--presets", default=",".join(list_presets()), help="comma-separated presets")
    p.add_argument("--head-dims", default="64,128", help="comma-separated head dims")
    p.add_argument("--tokens", type=int, default=2048, help="tokens per layer for the C path")
    p.add_argument("--ref-tokens", type=int, default=512, help="tokens per layer for the reference")
    p.add_argument("--heads", type=int, default=8, help="KV heads")
    p.add_argument("--block-size", type=int, default=16, help="paged cache block size")
    p.add_argument(
        "--layouts", default="packed",
        help="comma-separated cache layouts: packed, or a vLLM CPU attention ISA (vec, amx, ...)",
    )
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--ref-repeats", type=int, default=2)
    p.add_argument(
        "--prompt-presets", default="tq4,k8v4,tq3", help="presets of the 2k-prompt table"
    )
    p.add_argument(
        "--markdown", action="store_true", help="also print Markdown tables for bench/RESULTS.md"
    )
    p.add_argument(
        "--json", type=Path, default=None,
        help="also write the per-layer rates here (read by `turbowire recommend`)",
    )
    args = p.parse_args()
    args.presets = [s for s in args.presets.split(",") if s]
    args.prompt_presets = [s for s in args.prompt_presets.split(",") if s]
    args.head_dims = [int(d) for d in args.head_dims.split(",") if d]
    args.layouts = [s for s in args.layouts.split(",") if s]
    torch.set_num_threads(1)
    if not cpu_binding.available():
        raise SystemExit("the C codec is not built: pip install --no-build-isolation -e .")
    console = Console(width=200)
    amx = "yes" if "amx_tile" in open("/proc/cpuinfo").read() else "no"
    affinity = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else "?"
    machine = (
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"affinity {affinity}, ISA {cpu_binding.isa()}, AMX {amx}, block size {args.block_size}, "
        f"load average {os.getloadavg()[0]:.1f}, torch {torch.__version__}"
    )
    console.print(f"[bold]CPU codec[/bold]  {machine}")
    rows, prompt_rows, records = run(args)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(
            {"command": "python -m bench.cpu_codec " + " ".join(sys.argv[1:]),
             "machine": machine, "date": time.strftime("%Y-%m-%d"), "per_layer": records},
            indent=1))
    for title, head, body in [
        ("per layer (chunks of 256 tokens, bf16 cache)", HEAD, rows),
        ("2k-token prompt, 8 layers x 8 KV heads x 128", PROMPT_HEAD, prompt_rows),
    ]:
        table = Table(title=title)
        for h in head:
            table.add_column(h, justify="right")
        for r in body:
            table.add_row(*r)
        console.print(table)
        if args.markdown:
            print("| " + " | ".join(head) + " |")
            print("|" + "---|" * len(head))
            for r in body:
                print("| " + " | ".join(r) + " |")
            print()


if __name__ == "__main__":
    main()
