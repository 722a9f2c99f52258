"""``turbowire bench``: benchmarks (sub-app: ``e2e``, ``serve``, ``multiround``, ``projection``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from turbowire.bench_e2e.serve import ServePlan

bench = typer.Typer(help="Benchmarks: end-to-end P/D over a shaped link, vllm bench serve "
                          "sweeps, multi-round QA, a GPU-scale projection.",
                    no_args_is_help=True)


def _rate(text: str) -> float | None:
    if text.lower() in ("none", "unshaped", "inf"):
        return None
    try:
        value = float(text)
    except ValueError as exc:
        raise typer.BadParameter(f"link rate {text!r}: use Gbit/s such as 0.2 or 'none'") from exc
    if value <= 0:
        raise typer.BadParameter(f"link rate {text!r} must be > 0 Gbit/s (or 'none')")
    return value


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


@bench.command("e2e")
def e2e(
    full: bool = typer.Option(False, "--full", help="The whole matrix: prompts 1k/2k/4k/8k."),
    configs: str = typer.Option(
        "", "--configs",
        help="Comma list: 'nixl' and 'tw:<preset>' (default: nixl, tw:raw, tw:<--presets>)."),
    presets: str = typer.Option(
        "tq4", "--presets", help="turbowire presets to run when --configs is not given."),
    rates: str = typer.Option(
        "0.2,1,10,none", "--rates", help="Link rates, Gbit/s ('none' = unshaped)."),
    lengths: str = typer.Option(
        "", "--lengths", help="Prompt lengths in tokens (default 2000; --full 1k-8k)."),
    concurrency: str = typer.Option("1,4", "--concurrency", help="Concurrency levels."),
    mode: str = typer.Option("primed", "--mode", help="primed (P prefix-cached prompts) or fresh."),
    requests: int = typer.Option(
        0, "--requests", help="Sequential requests per conc-1 cell (0: plan default)."),
    out: Path = typer.Option(Path("bench/e2e/out"), "--out", help="Output folder."),
) -> None:
    """Prefill engine (root netns) and decode engine (own netns behind a tbf-shaped veth),
    vLLM's NixlConnector against turbowire's connector; per cell: KV handoff time, decode request
    time, TTFT through the proxy, wire bytes and ratios to NixlConnector. Needs root (ip/tc) and
    takes the machine-wide engine lock (/tmp/tw-engine.lock).

    Examples:

      turbowire bench e2e                                   # reduced default (make bench-e2e)

      turbowire bench e2e --full                            # 1k/2k/4k/8k prompts

      turbowire bench e2e --configs nixl,tw:tq4 --rates 1 --lengths 2000 --concurrency 1
    """
    from turbowire.bench_e2e.engines import ConnectorConfig
    from turbowire.bench_e2e.run import BenchPlan, run_bench
    from turbowire.serving.launch import engine_lock

    try:
        conns = (tuple(ConnectorConfig.parse(c) for c in _csv(configs)) if configs
                 else BenchPlan.default_configs(_csv(presets)))
        kw: dict = {"rates": tuple(_rate(r) for r in _csv(rates)),
                    "concurrencies": tuple(int(c) for c in _csv(concurrency)), "mode": mode}
        if lengths:
            kw["lengths"] = tuple(int(n) for n in _csv(lengths))
        if requests:
            kw["sequential_requests"] = requests
        plan = BenchPlan.full(conns, **kw) if full else BenchPlan.reduced(conns, **kw)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    import signal

    def _terminate(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)  # unwind: engines, proxy and the link are removed

    signal.signal(signal.SIGTERM, _terminate)
    with engine_lock():
        result = run_bench(plan, out)
    typer.echo((out / "results.md").read_text())
    if result.errors:
        raise typer.Exit(code=1)


def _ints(text: str, what: str, minimum: int = 1) -> tuple[int, ...]:
    try:
        values = tuple(int(t) for t in _csv(text))
    except ValueError as exc:
        raise typer.BadParameter(f"{what} {text!r}: use a comma list of integers") from exc
    if not values or any(v < minimum for v in values):
        raise typer.BadParameter(f"{what} {text!r}: each must be >= {minimum}")
    return values


def _progress_printer() -> Callable[[str], None]:
    """Timestamped progress lines (rich; messages are printed as text, not markup)."""
    from rich.console import Console
    from rich.markup import escape

    console = Console()

    def progress(msg: str) -> None:
        console.print(f"[dim]{time.strftime('%H:%M:%S')}[/dim] {escape(msg)}", highlight=False)

    return progress


def _command_line() -> str:
    """How this command was started, for the results (``turbowire ...``)."""
    import shlex
    import sys

    return shlex.join(["turbowire", *sys.argv[1:]])


def _terminate_on_sigterm() -> None:
    import signal

    def _terminate(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)  # unwind: engines, proxy and the link are removed

    signal.signal(signal.SIGTERM, _terminate)


@bench.command("serve", short_help="vllm bench serve sweeps through the P/D proxy: "
               "NixlConnector vs turbowire presets; CSV, tables, Pareto plot.")
def serve(
    configs: str = typer.Option(
        "nixl,tw:raw,tw:tq4", "--configs", help="Comma list: 'nixl' and 'tw:<preset>'."),
    links: str = typer.Option(
        "none,1", "--links", help="Link rates, Gbit/s ('none' = unshaped veth)."),
    datasets: str = typer.Option(
        "random,sharegpt", "--datasets", help="random and/or sharegpt (built offline)."),
    concurrency: str = typer.Option("1,2,4,8", "--concurrency", help="--max-concurrency values."),
    num_prompts: int = typer.Option(
        0, "--num-prompts", min=0, help="Prompts per run (0: 2 x concurrency + 4)."),
    input_len: int = typer.Option(1024, "--input-len", min=1, help="random: prompt tokens."),
    output_len: int = typer.Option(64, "--output-len", min=1, help="random: output tokens."),
    sharegpt_size: int = typer.Option(
        200, "--sharegpt-size", min=1, help="Conversations in the built ShareGPT-like file."),
    seed: int = typer.Option(0, "--seed", help="Dataset and client seed."),
    out: Path = typer.Option(Path("bench/e2e/out/serve"), "--out", help="Output folder."),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="Print the plan and the first client command; start nothing."),
) -> None:
    """vLLM's own client, `vllm bench serve`, through the P/D proxy: NixlConnector and turbowire
    presets side by side, on the e2e benchmark's stack (prefill engine in the root netns, decode
    engine behind a tbf-shaped veth). Per config the stack starts once; per link, dataset and
    concurrency both prefix caches are reset, then one `vllm bench serve` run. Writes serve.csv,
    results.md (tables), pareto.png (output tokens/s per user vs output tokens/s) and
    commands.txt. Needs root (ip/tc) and takes the engine lock (/tmp/tw-engine.lock). The
    default (3 configs x 2 links x 2 datasets x 4 concurrencies, 48 runs) took 18.5 min on 2
    shared cores.

    Examples:

      turbowire bench serve              # the default sweep (make bench-serve)

      turbowire bench serve --dry-run    # the plan and the first client command

      turbowire bench serve --configs nixl,tw:tq4 --links 1 --concurrency 1,4
    """
    from turbowire.bench_e2e.engines import ConnectorConfig
    from turbowire.bench_e2e.serve import ServePlan

    try:
        plan = ServePlan(
            configs=tuple(ConnectorConfig.parse(c) for c in _csv(configs)),
            links=tuple(_rate(r) for r in _csv(links)), datasets=tuple(_csv(datasets)),
            concurrencies=_ints(concurrency, "--concurrency"), num_prompts=num_prompts,
            input_len=input_len, output_len=output_len, sharegpt_size=sharegpt_size, seed=seed)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    if dry_run:
        _print_serve_plan(plan, out)
        return
    _run_serve(plan, out)


def _print_serve_plan(plan: ServePlan, out: Path) -> None:
    from turbowire.bench_e2e.model import BenchModelSpec
    from turbowire.bench_e2e.results import rate_label
    from turbowire.bench_e2e.serve import SHAREGPT_FILE, bench_serve_args, shell_line
    from turbowire.models import cache_root

    runs = plan.runs()
    typer.echo(f"{len(plan.configs)} stacks ({', '.join(c.label for c in plan.configs)}), "
               f"links {', '.join(rate_label(r) for r in plan.links)}, "
               f"{len(runs)} runs, {sum(r.num_prompts for r in runs)} prompts in all")
    for n in plan.concurrencies:
        typer.echo(f"  concurrency {n}: {plan.prompts_for(n)} prompts per run")
    model = cache_root() / "models" / BenchModelSpec().name
    first = runs[0]
    argv = bench_serve_args(plan, first, base_url="http://127.0.0.1:PROXY_PORT", tokenizer=model,
                            result_dir=out / "runs", dataset_path=out / SHAREGPT_FILE)
    typer.echo(f"first run ({first.name}):")
    typer.echo("  " + shell_line(argv))


def _run_serve(plan: ServePlan, out: Path) -> None:
    from turbowire.bench_e2e.serve import run_serve
    from turbowire.serving.launch import engine_lock

    progress = _progress_printer()

    _terminate_on_sigterm()
    progress(f"{len(plan.runs())} runs; waiting for the engine lock if another workload has it")
    with engine_lock():
        result = run_serve(plan, out, on_progress=progress, command=_command_line())
    typer.echo((out / "results.md").read_text())
    typer.echo(f"files: {out}/serve.csv, results.md, pareto.png, commands.txt, runs/")
    if result.errors:
        raise typer.Exit(code=1)


@bench.command("multiround", short_help="Multi-round QA (shared system prompt, growing "
               "history): TTFT per round with and without the store.")
def multiround(
    configs: str = typer.Option(
        "tw:tq4,tw:tq4+store", "--configs",
        help="Comma list: 'nixl', 'tw:<preset>', 'tw:<preset>+store' (transport both + Redis)."),
    link: str = typer.Option("none", "--link", help="Link rate, Gbit/s ('none' = unshaped)."),
    users: int = typer.Option(4, "--users", min=1, help="Users; each round they ask at once."),
    rounds: int = typer.Option(6, "--rounds", min=1, help="Rounds per user."),
    system_tokens: int = typer.Option(
        1536, "--system-tokens", min=0, help="Shared system prompt, tokens."),
    question_tokens: int = typer.Option(96, "--question-tokens", min=1, help="Per question."),
    answer_tokens: int = typer.Option(64, "--answer-tokens", min=1, help="Per answer."),
    cache: str = typer.Option(
        "evict", "--cache",
        help="evict (reset prefix caches before every round) and/or keep (only before round 1)."),
    seed: int = typer.Option(0, "--seed", help="Workload seed."),
    out: Path = typer.Option(Path("bench/e2e/out/multiround"), "--out", help="Output folder."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan; start nothing."),
) -> None:
    """Multi-round QA (LMCache's benchmark shape) for the store path: a shared system prompt,
    users whose history grows by a question and an answer per round, TTFT per round measured
    client side through the proxy, with and without turbowire's store. Runs on the e2e stack
    (decode engine behind a veth; the store's redis-server listens on the link, so the decode
    engine reaches it as a remote store). Writes multiround.csv (one row per request) and
    results.md (TTFT p50 per round; prompt tokens by source). Needs root, takes the engine lock.
    The default takes ~5 min on 2 cores (--cache evict,keep took 6 min).

    Examples:

      turbowire bench multiround           # tw:tq4 vs tw:tq4+store, evict

      turbowire bench multiround --cache evict,keep --rounds 4

      turbowire bench multiround --configs nixl,tw:tq4+store --link 1 --dry-run
    """
    from turbowire.bench_e2e.multiround import MultiroundPlan, StackConfig

    try:
        plan = MultiroundPlan(
            configs=tuple(StackConfig.parse(c) for c in _csv(configs)), link=_rate(link),
            users=users, rounds=rounds, system_tokens=system_tokens,
            question_tokens=question_tokens, answer_tokens=answer_tokens,
            cache_modes=tuple(_csv(cache)), seed=seed)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    if dry_run:
        typer.echo(f"configs {', '.join(c.label for c in plan.configs)}; cache "
                   f"{', '.join(plan.cache_modes)}; link {link}")
        typer.echo(f"{plan.users} users x {plan.rounds} rounds = {plan.users * plan.rounds} "
                   "requests per config and cache mode")
        typer.echo("prompt tokens per round: "
                   + ", ".join(str(plan.prompt_tokens(r)) for r in range(plan.rounds)))
        return
    from turbowire.bench_e2e.multiround import run_multiround
    from turbowire.serving.launch import engine_lock

    progress = _progress_printer()
    _terminate_on_sigterm()
    progress("waiting for the engine lock if another workload has it")
    with engine_lock():
        result = run_multiround(plan, out, on_progress=progress, command=_command_line())
    typer.echo((out / "results.md").read_text())
    typer.echo(f"files: {out}/multiround.csv, results.md, results.json, logs/")
    if result.errors or any(not r.ok for r in result.records):
        raise typer.Exit(code=1)


@bench.command("projection")
def projection(
    presets: str = typer.Option("tq4,k4v3,tq3", "--presets", help="Codec presets (comma list)."),
    kernel: list[str] = typer.Option(
        [], "--kernel",
        help="PRESET=ENC:DEC kernel throughputs in TB/s counted as bytes read + written "
             "(the kernels benchmark's effective bandwidth); repeat per preset. Default: the "
             "naive H200 kernels of ENVIRONMENT.md (0.93 / 1.43 TB/s)."),
    source: str = typer.Option("", "--source", help="Where --kernel numbers come from (printed)."),
    efficiency: float = typer.Option(1.0, "--efficiency", min=0.01, max=1.0,
                                     help="Fraction of the link rate a bulk transfer achieves."),
) -> None:
    """GPU-scale projection (a model, not a measurement): handoff time dense vs compressed for
    Llama-3.1-8B/70B KV, 8k/32k/128k prompts, 25/100/400 Gbit/s links.

    Examples:

      turbowire bench projection

      turbowire bench projection --kernel tq4=2.4:2.6 --source "bench/RESULTS.md kernels, H200"
    """
    from turbowire.bench_e2e.projection import (
        LLAMA_31_8B,
        LLAMA_31_70B,
        NAIVE_H200_RW_BPS,
        NAIVE_SOURCE,
        markdown,
        project,
        rates_from_rw,
    )

    given: dict[str, tuple[float, float]] = {}
    for spec in kernel:
        try:
            name, nums = spec.split("=", 1)
            enc, dec = (float(x) * 1e12 for x in nums.split(":", 1))
        except ValueError as exc:
            raise typer.BadParameter(f"--kernel {spec!r}: use PRESET=ENC:DEC in TB/s") from exc
        given[name] = (enc, dec)
    rates = []
    for p in _csv(presets):
        enc, dec = given.get(p, (NAIVE_H200_RW_BPS["encode"], NAIVE_H200_RW_BPS["decode"]))
        src = (source or "--kernel") if p in given else NAIVE_SOURCE
        rates.append(rates_from_rw(p, enc, dec, src))
    rows = project([LLAMA_31_8B, LLAMA_31_70B], [8192, 32768, 131072], [25, 100, 400], rates,
                   efficiency)
    typer.echo(markdown(rows))
    typer.echo("")
    for r in rates:
        typer.echo(f"- {r.preset}: wire ratio {r.wire_ratio:.2f}x, encode "
                   f"{r.encode_dense_bps / 1e12:.2f} / decode {r.decode_dense_bps / 1e12:.2f} TB/s "
                   f"of dense KV ({r.source}); link efficiency {efficiency:g}")


def register(app: typer.Typer) -> None:
    app.add_typer(bench, name="bench")
