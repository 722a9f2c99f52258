"""``python -m bench.gpu_pipeline``: the P/D handoff on the connector's GPU path, two processes
with one NIXL agent each, against NixlConnector-style and contiguous dense READs (issue 38).

Per case (UCX_TLS x model geometry x tokens) a producer process on cuda:A and a consumer on
cuda:B (``--devices A,B``; ``0,0`` runs both on one GPU, a smoke of the pipeline whose numbers
are not two-GPU numbers, and the output says so) talk over a pipe, which stands in for the
side channel and the proxy's hop (link.py):

- per preset, the producer runs a stand-in forward with the connector worker's per-layer saves
  (producer.py) and the consumer the worker's load path, its READs through the worker's NIXL
  agent and its landed-group decode (consumer.py); the last round's decoded layers are checked
  bit for bit against the reference codec's decode of the received bytes;
- anchor (a), NixlConnector's descriptor lists and prepped READ of the request's blocks, and
  anchor (b), the best contiguous READ of the same bytes (anchors.py).

Reported per path: the handoff (producer's last layer computed -> consumer's last layer
decoded, ``perf_counter_ns`` after a CUDA synchronisation at each mark: CUDA events cannot
cross processes, CLOCK_MONOTONIC is one clock for a host's processes), wire MB and GB/s,
dense-equivalent GB/s and the ratio to anchor (a) (report.py). Writes results.json, results.md,
log.txt, producer.log and consumer.log (UCX's own output included) under --out.

NIXL must be importable (``nixl._api``); on the GPU machine ``make bench-gpu-pipeline``
unpacks it from .whl/ (the Makefile says how). ``TW_BENCH_SMOKE=1``: CPU tensors, Triton's
interpreter, tiny shapes, NIXL on DRAM: every code path, no numbers worth reading.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import textwrap
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

from bench.gpu_pipeline import report
from bench.gpu_pipeline.case import Case, result
from bench.gpu_pipeline.env import SMOKE, UCX_DEFAULT, ucx_environment
from bench.gpu_pipeline.models import MODELS, SMOKE_MODEL

EXAMPLES = """examples:
  two GPUs, the issue's matrix (8b and 70b, 8k and 32k tokens, tq4 and k4v3), UCX's
  default transports, then its TCP path (make bench-gpu-pipeline runs the first):
    python -m bench.gpu_pipeline --devices 0,1 --out $OUT/default
    python -m bench.gpu_pipeline --devices 0,1 --ucx-tls tcp,cuda_copy,self --out $OUT/tcp
  one GPU, both processes on it (a smoke at real shapes, not two-GPU numbers):
    python -m bench.gpu_pipeline --devices 0,0 --models 8b --tokens 8192 --presets tq4
  CPU smoke (CI: tests/unit/test_bench_gpu_pipeline_smoke.py):
    TW_BENCH_SMOKE=1 python -m bench.gpu_pipeline --out /tmp/pipe
"""


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m bench.gpu_pipeline", epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="P/D handoff on the connector's GPU path (producer and consumer "
                    "processes, real NIXL agents) vs NixlConnector-style and contiguous dense "
                    "READs.")
    ap.add_argument("--out", type=Path,
                    default=Path(os.environ.get("OUT", "bench/results/gpu_pipeline/latest")))
    ap.add_argument("--devices", default="0,1",
                    help="producer,consumer CUDA devices (0,0: both on one GPU)")
    ap.add_argument("--models", default="8b,70b", help=f"geometries: {', '.join(MODELS)}")
    ap.add_argument("--tokens", default="8192,32768", help="request lengths, comma-separated")
    ap.add_argument("--presets", default="tq4" if SMOKE else "tq4,k4v3",
                    help="codec presets, comma-separated")
    ap.add_argument("--anchors", default="a,b",
                    help="a: NixlConnector-style block READ, b: contiguous READ ('' for none)")
    ap.add_argument("--contig-descs", default="1,8,64",
                    help="descriptor counts tried for anchor (b); the best is reported")
    ap.add_argument("--ucx-tls", action="append", default=None, metavar="TLS",
                    help=f"a UCX_TLS value per run of every case, repeatable "
                         f"('{UCX_DEFAULT}': unset, UCX's choice; e.g. tcp,cuda_copy,self)")
    ap.add_argument("--ucx-proto-info", action="store_true",
                    help="UCX_PROTO_INFO=y: UCX logs the protocols it picks (in the .log files)")
    ap.add_argument("--warmup", type=int, default=-1, help="rounds dropped (-1: 2; smoke 0)")
    ap.add_argument("--iters", type=int, default=0, help="rounds measured (0: 5; smoke 1)")
    ap.add_argument("--check-layers", default="ends",
                    help="layers checked bit for bit: 'ends' (first, middle, last), 'all' or "
                         "a list")
    ap.add_argument("--groups", type=int, default=8, help="decode_pipeline_groups")
    ap.add_argument("--progress-delay-us", type=int, default=-1,
                    help="nixl_progress_delay_us of the workers' agents (-1: 0, smoke 100)")
    ap.add_argument("--timeout", type=float, default=120.0,
                    help="seconds a load or READ may take")
    ap.add_argument("--case-timeout", type=float, default=600.0,
                    help="seconds a case's processes may run")
    ap.add_argument("--deadline", type=float, default=0.0,
                    help="seconds after which no further case starts (0: none)")
    args = ap.parse_args(argv)
    args.devices = tuple(int(x) for x in args.devices.split(","))
    if len(args.devices) != 2:
        ap.error("--devices takes two CUDA indices, producer,consumer")
    args.models = [SMOKE_MODEL] if SMOKE else [MODELS[x] for x in args.models.split(",") if x]
    args.tokens = [int(x) for x in (("40",) if SMOKE else args.tokens.split(",")) if x]
    args.presets = tuple(x for x in args.presets.split(",") if x)
    args.anchors = tuple(x for x in args.anchors.split(",") if x)
    if set(args.anchors) - {"a", "b"}:
        ap.error("--anchors takes a, b or both")
    args.contig_descs = tuple(int(x) for x in args.contig_descs.split(",") if x)
    args.ucx_tls = args.ucx_tls or [UCX_DEFAULT]
    args.warmup = args.warmup if args.warmup >= 0 else (0 if SMOKE else 2)
    args.iters = args.iters or (1 if SMOKE else 5)
    if args.progress_delay_us < 0:
        args.progress_delay_us = 100 if SMOKE else 0
    return args


def check_layers(spec: str, layers: int) -> tuple[int, ...]:
    if spec == "ends":
        return tuple(sorted({0, layers // 2, layers - 1}))
    if spec == "all":
        return tuple(range(layers))
    return tuple(int(x) for x in spec.split(",") if x)


def run_pair(case: Case, log: Callable[[str], None]) -> tuple[dict, dict, str]:
    """The case's two processes: what each reported (every phase it finished, also when the
    case failed or ran out of time) and the error text ("" when both finished)."""
    from bench.gpu_pipeline import consumer, producer

    ctx = mp.get_context("spawn")
    p_end, c_end = ctx.Pipe()
    got: dict[str, dict[str, Any]] = {"producer": {"presets": {}}, "consumer": {"presets": {}}}
    pipes, procs = {}, {}
    for role, target, end in (("producer", producer.main, p_end),
                              ("consumer", consumer.main, c_end)):
        recv, send = ctx.Pipe(duplex=False)
        procs[role] = ctx.Process(target=target, args=(end, send, case), name=role)
        procs[role].start()
        pipes[role] = recv
    deadline = time.monotonic() + case.case_timeout_s
    finished: set[str] = set()
    error = ""
    while len(finished) < 2 and not error:
        left = deadline - time.monotonic()
        if left <= 0:
            error = f"the case ran past --case-timeout {case.case_timeout_s:.0f} s"
            break
        ready = wait([*pipes.values(), *(p.sentinel for p in procs.values())], timeout=left)
        for role, pipe in pipes.items():
            while role not in finished and pipe.poll():
                try:
                    msg = pipe.recv()
                except EOFError:
                    break
                if msg[0] == "part":  # a phase's result: presets.<name> or anchors
                    _, key, value = msg
                    if key.startswith("presets."):
                        got[role]["presets"][key.split(".", 1)[1]] = value
                    else:
                        got[role][key] = value
                    continue
                finished.add(role)
                if msg[0] == "error":
                    error = f"{role}: {msg[1]}"
                else:
                    got[role].update(msg[1])
        for role, proc in procs.items():
            if proc.sentinel in ready and role not in finished and not pipes[role].poll():
                error = error or f"{role} exited with {proc.exitcode} without a result"
    for proc in procs.values():
        proc.join(timeout=30 if not error else 5)
        if proc.is_alive():
            proc.kill()
            proc.join()
    if error:
        log(f"  case failed: {error} (see producer.log / consumer.log)")
    return got["producer"], got["consumer"], error


def environment(args: argparse.Namespace) -> dict[str, Any]:
    import importlib.metadata as md

    import torch
    import triton

    def version(name: str) -> str:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return "-"

    gpus = ([torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            if torch.cuda.is_available() and not SMOKE else [])
    return {"gpus": gpus, "torch": torch.__version__, "triton": triton.__version__,
            "cuda": torch.version.cuda, "python": sys.version.split()[0],
            "nixl": version("nixl"), "nixl_cu13": version("nixl-cu13"),
            "nixl_cu12": version("nixl-cu12"), "smoke": SMOKE,
            "devices": list(args.devices), "one_gpu": args.devices[0] == args.devices[1],
            "date": time.strftime("%Y-%m-%d"),
            "command": " ".join(["python -m bench.gpu_pipeline", *sys.argv[1:]])}


def header(env: dict[str, Any], shapes: str) -> list[str]:
    """What ran where, and how to read the tables (wrapped at 80 columns)."""
    a, b = env["devices"]
    where = ("CPU, Triton's interpreter, NIXL on DRAM (smoke: no numbers worth reading)"
             if env["smoke"] else f"producer cuda:{a} -> consumer cuda:{b}")
    paragraphs = [f"`{env['command']}` on {', '.join(env['gpus']) or 'cpu'}; torch "
                  f"{env['torch']}, triton {env['triton']}, CUDA {env['cuda']}, NIXL "
                  f"{env['nixl']} (nixl_cu13 {env['nixl_cu13']}), {env['date']}. Devices: "
                  f"{where}. KV geometry (bf16, 16-token blocks, TP 1): {shapes}."]
    if env["one_gpu"] and not env["smoke"]:
        paragraphs.append("**ONE GPU: both processes share it (every READ's source and "
                          "target are in one GPU's memory). A smoke of the whole pipeline at "
                          "real shapes, not the two-GPU numbers.**")
    paragraphs += [
        "handoff: the producer's last layer computed -> the consumer's last layer decoded "
        "(anchors: READ done), perf_counter_ns after a CUDA synchronisation at each mark "
        "(CLOCK_MONOTONIC: one clock for the host's processes). wire GB/s: wire bytes / READ "
        "time; dense-eq GB/s: the request's dense KV bytes / handoff; vs (a): anchor (a)'s "
        "handoff / this path's. (a) a:blocks: NixlConnector's per-block descriptor lists and "
        "one prepped READ; (b) b:contig: the best contiguous READ of the same bytes. exact: "
        "the checked layers equal the reference codec's decode of the received bytes (a: the "
        "source's bytes). Medians of the measured rounds.",
        "Second table, the connector's paths: fwd ms: forward start -> last layer computed "
        "(per-layer saves included); tail ms: -> published (the encodes' tail, wait_for_save, "
        "the step's synchronisation); msg us: -> the consumer has the request id; READ ms, "
        "decode ms: the load's report (posted -> last READ seen landed; the decode calls' "
        "host time and the final wait); polls: get_transfer_results calls of the load."]
    lines: list[str] = []
    for text in paragraphs:
        lines += [*textwrap.wrap(text, 80, break_on_hyphens=False), ""]
    return lines[:-1]


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for name in ("producer.log", "consumer.log"):
        (args.out / name).unlink(missing_ok=True)
    with open(args.out / "log.txt", "a") as logf:
        def log(msg: str) -> None:
            print(msg, flush=True)
            logf.write(msg + "\n")
            logf.flush()

        return run(args, log)


def run(args: argparse.Namespace, log: Callable[[str], None]) -> int:
    env = environment(args)
    log(json.dumps(env))
    out: dict[str, Any] = {"env": env, "cases": []}
    t_start = time.time()

    def write() -> None:
        (args.out / "results.json").write_text(json.dumps(out, indent=1, default=str))

    for model in args.models:  # short cases first: --deadline cuts the long ones
        for tokens in args.tokens:
            for tls in args.ucx_tls:
                tag = f"UCX_TLS={tls} {model.name} {tokens}"
                if args.deadline and time.time() - t_start > args.deadline:
                    log(f"{tag}: skipped, past the --deadline")
                    out["cases"].append({"ucx_tls": tls, "model": model.name, "tokens": tokens,
                                         "skipped": "deadline"})
                    continue
                case = Case(model, tokens, args.presets, args.devices, tls,
                            ucx_environment(tls, args.ucx_proto_info), args.warmup, args.iters,
                            args.anchors, args.contig_descs,
                            check_layers(args.check_layers, model.layers), args.groups,
                            args.progress_delay_us, args.timeout, args.case_timeout,
                            str(args.out.resolve()))
                log(f"{tag}: {len(args.presets)} preset(s), anchors {args.anchors}, "
                    f"{case.rounds} rounds each")
                t0 = time.time()
                try:
                    p, c, error = run_pair(case, log)
                    entry = result(case, p, c, error)
                except Exception as exc:  # noqa: BLE001 - reported, the other cases still run
                    log(f"{tag}: {exc}\n{traceback.format_exc()}")
                    entry = result(case, {}, {}, repr(exc))
                entry["seconds"] = round(time.time() - t0, 1)
                out["cases"].append(entry)
                for r in entry.get("rows", []):
                    log(f"  {r['path']}: handoff {r['handoff_ms']:.3f} ms, READ "
                        f"{r['read_ms']:.3f} ms, wire {r['wire_bytes'] / 1e6:.1f} MB, "
                        f"exact {r['exact']}")
                write()
    md = markdown(out)
    (args.out / "results.md").write_text(md + "\n")
    write()
    log(md)
    cases = [c for c in out["cases"] if "skipped" not in c]
    ok = bool(cases) and all(not c.get("error") and all(r["exact"] is not False
                                                        for r in c.get("rows", []))
                             for c in cases)
    log(f"total {time.time() - t_start:.0f}s, {'ok' if ok else 'FAILED'}")
    return 0 if ok else 1


def markdown(out: dict[str, Any]) -> str:
    """The header, then per case its paths' table and where the connector's handoff goes."""
    names = dict.fromkeys(c["model"] for c in out["cases"])
    shapes = "; ".join(f"{m.name}: {m.layers} layers, {m.kv_heads} KV heads, hd{m.head_dim}"
                       for m in (*MODELS.values(), SMOKE_MODEL) if m.name in names)
    lines = ["## GPU pipeline on the connector's GPU path (issue 38)", "",
             *header(out["env"], shapes)]
    for c in out["cases"]:
        lines += ["", f"### {c['model']}, {c['tokens']} tokens, UCX_TLS={c['ucx_tls']}", ""]
        if c.get("rows"):
            lines += [report.main_table(c["rows"]), "", report.parts_table(c["rows"])]
        if c.get("error") or c.get("skipped"):
            text = (f"Not finished: {c['error']}; the rows above are the phases it finished."
                    if c.get("error") and c.get("rows") else
                    c.get("error") or "skipped: " + c["skipped"])
            lines += ["", *textwrap.wrap(text, 80)] if c.get("rows") else textwrap.wrap(text, 80)
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
