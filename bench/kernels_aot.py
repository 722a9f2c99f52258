"""Compile the codec kernels for a Hopper GPU on a machine without one: registers, spills, layouts.

Triton compiles for a target it is told about (``GPUTarget("cuda", 90, 32)``) with the ptxas it
ships, no driver needed, so register counts, spills and the layouts the compiler picked (TTGIR:
``convert_layout`` count, load layouts) can be read before spending device time. Pointers and
strides are declared 16-byte aligned, as the launcher specializes them at run time (without
that the row loads are not vectorized). Numbers come from the local triton, which may differ
from the GPU machine's; the bench (``bench/kernels.py``) prints the registers the GPU build used.

    python -m bench.kernels_aot --preset tq4 --head-dim 128 --lanes 4 16
    python -m bench.kernels_aot --preset tq3 --head-dim 256 --ttgir /tmp/enc.ttgir
    PYTHONPATH=/tmp/triton36 python -m bench.kernels_aot --sass   # another Triton, SASS opcodes

``--sass`` adds the cubin's instruction count and most frequent opcodes (nvdisasm): static
counts, a proxy for the work per coordinate (SHFL = lane exchanges, LDL/STL = spills, STS/LDS =
layout conversions through shared memory). Triton versions differ in the layouts they pick
(see ``kernels/triton_codec.py`` ``_rows_first``), so compare builds of the version you run.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.pop("TRITON_INTERPRET", None)  # compile, do not interpret

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from turbowire.codec import Codec  # noqa: E402
from turbowire.kernels import triton_codec as tk  # noqa: E402
from turbowire.kernels import triton_launch as td  # noqa: E402
from turbowire.kernels.triton_common import kernel_constants  # noqa: E402

POINTERS = {"kv_ptr": "*bf16", "out_ptr": "*u8", "src_ptr": "*u8", "items_ptr": "*i64",
            "blocks_ptr": "*i32", "tab_ptr": "*fp32", "acc_ptr": "*i32", "fail_ptr": "*i32",
            "status_ptr": "*i32"}


def compile_kernel(fn: Any, constexprs: dict[str, Any], cfg: td.KernelConfig,
                   max_registers: int | None = None) -> Any:
    """One kernel for sm_90 with the runtime's alignment assumptions (``max_registers``: the
    encoder's cap, as ``KernelConfig.encode_registers_for`` picks it)."""
    sig: dict[str, str] = {}
    attrs: dict[tuple[int], list[list[Any]]] = {}
    for i, p in enumerate(fn.params):
        if p.is_constexpr:
            sig[p.name] = "constexpr"
        else:
            sig[p.name] = POINTERS.get(p.name, "i32")
            if sig[p.name].startswith("*") or p.name.startswith("stride"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    opts: dict[str, Any] = {"enable_fp_fusion": False, **cfg.launch_options(max_registers)}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)


def resources(kernel: Any) -> str:
    """The cubin's resource line (registers, stack = spills, shared memory)."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True,
                             text=True, check=False).stdout
    line = next((ln for ln in out.splitlines() if "REG" in ln), "")
    return " ".join(w for w in line.split() if w.split(":")[0] in ("REG", "STACK", "SHARED"))


def sass_summary(kernel: Any, top: int = 12) -> str:
    """Instruction count and the most frequent opcodes of the cubin (static, not executed)."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run([str(tool), "-c", f.name], capture_output=True, text=True,
                             check=False).stdout
    ops: dict[str, int] = {}
    for line in out.splitlines():
        if "*/" not in line or ";" not in line or not line.strip().startswith("/*"):
            continue
        words = line.split("*/", 1)[1].split()
        if not words:
            continue
        op = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
        op = op.split(".")[0].rstrip(";")
        ops[op] = ops.get(op, 0) + 1
    common = sorted(ops.items(), key=lambda kv: -kv[1])[:top]
    return f"sass={sum(ops.values())} " + " ".join(f"{k}:{v}" for k, v in common)


def constants(preset: str, dim: int, cfg: td.KernelConfig, encode: bool) -> dict[str, Any]:
    codec = Codec(preset, dim, 32)
    pol = codec.policy(codec.num_layers // 2)
    return kernel_constants(pol.k, pol.v, dim, cfg, encode)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tq4")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--lanes", type=int, nargs="*", default=[0], help="0: the default")
    ap.add_argument("--num-warps", type=int, default=4)
    ap.add_argument("--max-registers", type=int, default=None)
    ap.add_argument("--qmode", type=int, default=1, choices=(0, 1, 2),
                    help="encoder quantizer: 1 select tree (default), 2 bucketed table, 0 gathers")
    ap.add_argument("--ttgir", type=Path, default=None, help="write the last encoder's TTGIR here")
    ap.add_argument("--sass", action="store_true", help="also count SASS instructions by opcode")
    args = ap.parse_args()
    for lanes in args.lanes:
        cfg = td.KernelConfig(num_warps=args.num_warps, lanes=lanes or None,
                              decode_lanes=lanes or None, max_registers=args.max_registers,
                              qmode=args.qmode)
        for name, fn, encode in (("encode", tk.encode_kernel, True),
                                 ("decode", tk.decode_kernel, False)):
            cx = constants(args.preset, args.head_dim, cfg, encode)
            cap = None
            if encode:
                pol = Codec(args.preset, args.head_dim, 32).policy(16)
                cap = cfg.encode_registers_for(pol.k, pol.v, args.head_dim)
            k = compile_kernel(fn, cx, cfg, cap)
            ttgir = k.asm["ttgir"]
            print(f"triton {triton.__version__} {args.preset} hd{args.head_dim} {name} "
                  f"lanes={cx['L']} rows={cx['BT']} warps={args.num_warps}: {resources(k)} "
                  f"convert_layout={ttgir.count('convert_layout')}", flush=True)
            if args.sass:
                print("    " + sass_summary(k), flush=True)
            if encode and args.ttgir:
                args.ttgir.write_text(ttgir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
