"""``python -m bench.gpu_path``: the connector's worker-side GPU path, driven as vLLM's model
runner drives it (issue 18), against the installed turbowire's public names only.

On the GPU machine (torch, triton, grpc; vLLM and NIXL stood in for where missing):
``PYTHONPATH=/tmp/site python3 -m bench.gpu_path --out $OUT``. ``TW_BENCH_SMOKE=1``: CPU and
Triton's interpreter, tiny shapes (the code paths run, nothing is timed meaningfully).

1. checks: the kernels' (``bench/kernels.py``) and the connector path's bit-exactness against
   the reference codec on this device (``check.py``; KV cache groups ``groups.py``, a hybrid's
   state layers ``state.py``, an MLA model's latent rows ``latent.py``);
2. per case (tokens x preset): what saving adds to a stand-in forward (``save.py``), a held
   load's landed -> finished vs the one-launch decode (``load.py``), with ``--load-timeline``
   where that time goes (``timeline.py``).

Prints a table (<= 80 columns); writes results.json, results.md and log.txt under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.gpu_path import check, groups, latent, state, tp
from bench.gpu_path.case import CaseConfig, case_ok, run_case
from bench.gpu_path.load import DECODE_VARIANTS
from bench.gpu_path.rig import DEVICE, PRESETS, SMOKE, STUBS, TOKENS, fit

COLUMNS = ["tokens", "preset", "fwd_ms", "save_%", "batch_%", "aa_%", "load_ms", "dec_ms",
           "load/dec", "exact"]


def table(rows: list[dict[str, Any]]) -> str:
    """One line per case: forward ms, what the per-layer and one-launch saves add (% of the
    forward), the A/A noise, a held load's landed -> finished and the one-launch decode (ms),
    their ratio, bit-exact."""
    widths = [6, 6, 8, 7, 7, 6, 8, 7, 8, 5]
    lines = [" ".join(f"{c:>{w}}" for c, w in zip(COLUMNS, widths, strict=True))]
    for r in rows:
        cells = [str(r["tokens"]), r["preset"], fit(r["forward_ms"], 8, 2),
                 fit(r["layer_pct"], 7, 2, "+"), fit(r["batched_pct"], 7, 2, "+"),
                 fit(r["aa_pct"], 6, 2, "+"), fit(r["load_ms"], 8, 3),
                 fit(r["decode_one_launch_ms"], 7, 3), fit(r["load_vs_one_launch"], 7, 2) + "x",
                 "yes" if case_ok(r) else "NO"]
        lines.append(" ".join(f"{c:>{w}}" for c, w in zip(cells, widths, strict=True)))
    return "\n".join(lines)


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m bench.gpu_path",
        description="The connector's GPU path as vLLM drives it: bit-exactness checks, the save "
                    "vs a stand-in forward, a load vs the one-launch decode.")
    ap.add_argument("--out", type=Path,
                    default=Path(os.environ.get("OUT", "bench/results/gpu_connector_path")))
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--iters", type=int, default=0,
                    help="paired rounds of the save variants (0: 30 up to 8k tokens, else 6)")
    ap.add_argument("--skip-kernel-check", action="store_true")
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--decode-variants", default="",
                    help=f"one-launch decode shapes to time too: {', '.join(DECODE_VARIANTS)}")
    ap.add_argument("--load-timeline", action="store_true",
                    help="where held loads' landed -> finished goes (the connector's probe marks)")
    ap.add_argument("--encode-cap", type=int, default=0,
                    help="also time per-layer saves with the encoder capped at N registers")
    ap.add_argument("--tp", action="store_true",
                    help="also time the save with chunks cut per decode rank's heads "
                         "(decode_tp_size 2 and 8) and a decode rank's window decode (tp.py)")
    ap.add_argument("--deadline", type=float, default=0.0,
                    help="seconds after which no further case starts (0: none)")
    args = ap.parse_args(argv)
    args.decode_variants = [v for v in args.decode_variants.split(",") if v]
    for v in args.decode_variants:
        if v not in DECODE_VARIANTS:
            ap.error(f"unknown decode variant {v!r} (one of {', '.join(DECODE_VARIANTS)})")
    return args


def run_checks(presets: list[str], args: argparse.Namespace, report: dict[str, Any],
               log: Callable[[str], None]) -> None:
    if not args.skip_kernel_check:
        from bench import kernels as kernel_bench

        for preset in presets:
            for layout in ("LBNHC", "LBHNC"):
                c = kernel_bench.run_check(kernel_bench.CheckCase(preset, 128, 8, layout))
                c.pop("traceback", None)
                report["kernel_checks"].append(c)
                log(f"[kernel check] {c['case']}: ok={c.get('ok')} {c.get('error', '')}")
    if args.skip_check:
        return
    for preset in presets:
        for part in (check.connector_check, check.store_check, groups.groups_check,
                     state.state_check, latent.latent_check, tp.tp_check):
            try:
                report["checks"].append(part(preset, log))
            except Exception as exc:  # noqa: BLE001 - reported, the other parts still run
                log(f"[{part.__name__}] {preset} failed: {exc}\n{traceback.format_exc()}")
                report["checks"].append({"preset": preset, "check": part.__name__,
                                         "ok": False, "error": repr(exc)})


def environment() -> dict[str, Any]:
    import torch
    import triton

    return {"gpu": torch.cuda.get_device_name(0) if DEVICE == "cuda" else "cpu (interpreter)",
            "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
            "python": sys.version.split()[0], "stand_ins": STUBS, "smoke": SMOKE,
            "command": " ".join(["python -m bench.gpu_path", *sys.argv[1:]])}


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "log.txt", "a") as logf:
        def log(msg: str) -> None:
            print(msg, flush=True)
            logf.write(msg + "\n")
            logf.flush()

        return run(args, log)


def run(args: argparse.Namespace, log: Callable[[str], None]) -> int:
    env = environment()
    log(json.dumps(env))
    report: dict[str, Any] = {"env": env, "checks": [], "kernel_checks": [], "results": []}

    def write() -> None:
        (args.out / "results.json").write_text(json.dumps(report, indent=1, default=str))

    presets = [x for x in args.presets.split(",") if x]
    t0 = time.time()
    run_checks(presets, args, report, log)
    write()
    log(f"checks done in {time.time() - t0:.0f}s")
    for tokens in [int(x) for x in args.tokens.split(",") if x]:
        for preset in presets:
            if args.deadline and time.time() - t0 > args.deadline:
                log(f"{tokens} {preset}: skipped, past the --deadline")
                continue
            rounds = args.iters or (1 if SMOKE else 30 if tokens <= 8192 else 6)
            cfg = CaseConfig(tokens, preset, rounds, 1 if SMOKE else max(8, min(rounds, 20)),
                             args.encode_cap, args.decode_variants, args.load_timeline)
            try:
                report["results"].append(run_case(cfg, log))
                if args.tp:
                    report.setdefault("tp", []).append(tp.tp_save(tokens, preset, rounds, log))
            except Exception as exc:  # noqa: BLE001 - reported, the other cases still run
                log(f"{tokens} {preset} failed: {exc}\n{traceback.format_exc()}")
                report["failed_cases"] = [*report.get("failed_cases", []), cfg.tag]
            write()
    checks = report["checks"] + report["kernel_checks"]
    cases = report["results"]
    # a checks-only run (--tokens '') is judged by its checks: something must have run
    ok = (all(c.get("ok") for c in checks) and all(case_ok(r) for r in cases)
          and bool(cases or checks) and not report.get("failed_cases"))
    report["bit_exact"] = ok
    md = ["## GPU connector path", "", f"`{env['command']}` on {env['gpu']}, torch "
          f"{env['torch']}, triton {env['triton']}, CUDA {env['cuda']}", "",
          f"bit-exact on this device: {'yes' if ok else 'NO'} (kernel checks "
          f"{sum(bool(c.get('ok')) for c in report['kernel_checks'])}/"
          f"{len(report['kernel_checks'])}, connector checks "
          f"{sum(bool(c.get('ok')) for c in report['checks'])}/{len(report['checks'])}, "
          f"cases {sum(case_ok(r) for r in cases)}/{len(cases)})", "", "```", table(cases),
          "```"]
    if report.get("tp"):
        md += ["", "Save with chunks cut per decode rank's heads (% of the forward; cutN: "
               "decode_tp_size N), a TP 2 rank's window decode of its runs and the "
               "reference's (ms):", "", "```", tp.table(report["tp"]), "```"]
    (args.out / "results.md").write_text("\n".join(md) + "\n")
    write()
    log("\n".join(md))
    log(f"total {time.time() - t0:.0f}s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
