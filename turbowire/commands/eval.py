"""``turbowire eval``: what the codecs do to the real model in the P/D handoff scenario.

Three tasks: ``quality`` (KL/top-1/perplexity of a continuation over corpus windows),
``retrieval`` (passkey and multi-key needles at long prompts: accuracy, answer NLL and KL) and
``layers`` (KL when only one layer is compressed: the boundary-layer policy).
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import typer

TASKS = ("quality", "retrieval", "layers")
DEFAULT_LENGTHS = {"quality": "512,2048", "retrieval": "1024,2048,4096,8192", "layers": "1024"}
DEFAULT_WINDOWS = {"quality": 16, "layers": 4}


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated integers, got {text!r}") from None


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def register(app: typer.Typer) -> None:
    @app.command("eval")
    def eval_cmd(
        task: str = typer.Option(
            "quality", "--task",
            help="quality (continuation KL/top-1/PPL), retrieval (passkey and multi-key "
                 "needles), layers (one layer compressed at a time)."),
        lengths: str = typer.Option(
            "", "--lengths",
            help="Prompt lengths in tokens, comma-separated (default: quality 512,2048; "
                 "retrieval 1024,2048,4096,8192, the whole prompt with its chat template, "
                 "capped to leave the answer room in the model's positions; layers 1024)."),
        windows: int = typer.Option(
            0, "--windows", min=0,
            help="Corpus windows per prompt length (quality: 16, layers: 4)."),
        continuation: int = typer.Option(
            32, "--continuation", min=1,
            help="Continuation tokens scored per window (quality, layers)."),
        presets: str = typer.Option(
            "", "--presets",
            help="Presets to evaluate (comma-separated; default: all but raw)."),
        baselines: bool = typer.Option(
            True, "--baselines/--no-baselines",
            help="Include the baselines: quality: fp8, KIVI-4/2 and the vLLM TurboQuant "
                 "reproductions; retrieval: the anchors fp8, KIVI-4, vLLM 4bit_nc and 3bit_nc."),
        depths: str = typer.Option(
            "0,25,50,75,100", "--depths", help="Retrieval: needle depths in percent."),
        cases: int = typer.Option(
            2, "--cases", min=1,
            help="Retrieval: cases per (task, length, depth), each with its own seed; the "
                 "haystacks rotate over depths and cases."),
        needles: str = typer.Option(
            "passkey,multikey", "--needles", help="Retrieval: needle tasks."),
        haystacks: str = typer.Option(
            "corpus,filler", "--haystacks",
            help="Retrieval: haystacks (the bundled corpus, RULER's repeated filler, or paths "
                 "of UTF-8 text files)."),
        keys: int = typer.Option(
            4, "--keys", min=1, help="Retrieval: keys per multikey prompt (one is asked)."),
        seed: int = typer.Option(
            0, "--seed", help="Retrieval: base seed of needles and haystacks."),
        model: str = typer.Option(
            "", "--model", help="HF model folder (default: the bundled SmolLM2-135M-Instruct)."),
        markdown: Path | None = typer.Option(
            None, "--markdown", help="Also write the tables as Markdown here."),
        plot: Path | None = typer.Option(
            None, "--plot",
            help="Write a PNG here (quality: KL vs bits; retrieval: accuracy vs length and "
                 "depth, NLL ratio; layers: KL per layer)."),
        json_out: Path | None = typer.Option(
            None, "--json", help="Write every measurement as JSON here."),
        from_json: Path | None = typer.Option(
            None, "--from-json",
            help="Do not run: print and write the tables, Markdown and plot of a run saved "
                 "with --json (the task must match)."),
        protect: str = typer.Option(
            "", "--protect",
            help="Also run each preset with protected tokens, simulated: SINK:RECENT pairs "
                 "(comma-separated) of prompt tokens kept exact at the start and the end, their "
                 "bf16 bytes counted in place of the preset's share."),
        recompute: str = typer.Option(
            "", "--recompute",
            help="Also run each preset with its last N prompt tokens recomputed by the decode "
                 "engine instead of loaded (the connector's recompute_recent_tokens): token "
                 "counts, comma-separated (quality and retrieval tasks)."),
        threads: int = typer.Option(
            2, "--threads", min=1,
            help="torch CPU threads (on a machine shared with other work, 1 is often faster)."),
    ) -> None:
        """Measure what each codec does to the model in the P/D handoff scenario.

        The prompt's KV (every layer, post-RoPE K, bf16) goes through encode/decode; the decode
        side runs against it and is compared with the exact run. Baselines run in the same
        process on the same inputs.

        quality: the continuation of corpus windows; KL(ref||test), top-1 agreement, perplexity.

        retrieval: passkey and multi-key (RULER-style) needles in corpus or filler haystacks at
        several lengths and depths, in the chat template; greedy answer scored for exact
        retrieval (Wilson 95% CI), answer-token NLL vs the exact KV's, KL on the answer tokens.

        layers: KL when only layer i is compressed, per preset; prints the boundary-layer
        policy it suggests (Preset.boundary_layers).

        Examples:

          turbowire eval                                   # quality: P=512 and 2048, 16 windows

          turbowire eval --lengths 512 --windows 4 --presets tq4,tq3 --no-baselines   # quick look

          turbowire eval --markdown table.md --plot kl_vs_bits.png

          # 1k-8k, depths 0-100%, 2 cases a cell, presets and anchors: ~30 min
          turbowire eval --task retrieval --markdown r.md --plot r.png --json r.json

          turbowire eval --task retrieval --lengths 1024,2048 --depths 0,50,100

          turbowire eval --task retrieval --lengths 512 --depths 50 --presets tq4

          turbowire eval --task layers --presets tq4,tq3,tq2 --plot layers.png   # minutes

          turbowire eval --presets tq3,tq2 --protect 4:64,0:128   # what exact tokens buy
          turbowire eval --presets tq3,k3v2 --recompute 64   # the recent window recomputed

          turbowire eval --task retrieval --from-json r.json --markdown r.md   # re-render
        """
        from rich.console import Console

        from turbowire.codec import list_presets

        if task not in TASKS:
            raise typer.BadParameter(f"unknown task {task!r}; known: {', '.join(TASKS)}")
        console = Console()
        names = _names(presets) or [p for p in list_presets() if p != "raw"]
        unknown = sorted(set(names) - set(list_presets()))
        if unknown:
            raise typer.BadParameter(f"unknown presets {unknown}; known: {list_presets()}")
        plens = _ints(lengths or DEFAULT_LENGTHS[task])
        command = shlex.join(["turbowire", "eval", *sys.argv[sys.argv.index("eval") + 1:]]
                             if "eval" in sys.argv else ["turbowire", "eval"])
        saved = None
        if from_json:
            saved = json.loads(from_json.read_text())
            command = saved.get("command") or command
            if ("kl" in saved) != (task == "layers") or (
                    "config" in saved and "depths" in saved["config"]) != (task == "retrieval"):
                raise typer.BadParameter(f"{from_json} is not a saved --task {task} run")
        from turbowire.quality.methods import parse_protect, parse_tokens

        try:
            pairs = parse_protect(protect)
            tails = parse_tokens(recompute, "--recompute")
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None
        if tails and task == "layers":
            raise typer.BadParameter("--recompute applies to --task quality and retrieval")
        args = dict(console=console, names=names, plens=plens, model=model, threads=threads,
                    markdown=markdown, plot=plot, json_out=json_out, command=command,
                    saved=saved, protect=pairs)
        if task == "quality":
            _quality(windows=windows or DEFAULT_WINDOWS["quality"], continuation=continuation,
                     baselines=baselines, tails=tails, **args)
        elif task == "retrieval":
            _retrieval(depths=_ints(depths), cases=cases, needles=_names(needles),
                       haystacks=_names(haystacks), keys=keys, seed=seed, baselines=baselines,
                       tails=tails, **args)
        else:
            if len(plens) != 1:
                raise typer.BadParameter("--task layers takes one prompt length")
            _layers(windows=windows or DEFAULT_WINDOWS["layers"], continuation=continuation,
                    **args)


def _progress(console):
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), TimeRemainingColumn(), console=console)


def _load(console, model: str):
    from turbowire.quality.harness import ModelUnderTest

    with console.status("loading the model"):
        mut = ModelUnderTest(model or None)
    return mut


def _codec_methods(names, mut, protect, tails=()):
    from turbowire.quality.methods import CodecMethod, ProtectedMethod, RecomputedTailMethod

    methods = [CodecMethod(n, mut.head_dim, mut.num_layers) for n in names]
    return (methods
            + [ProtectedMethod(m, sink, recent) for m in methods for sink, recent in protect]
            + [RecomputedTailMethod(m, n) for m in methods for n in tails])


def _write(console, path: Path | None, text: str) -> None:
    if path:
        path.write_text(text)
        console.print(f"wrote {path}")


def _quality(*, console, names, plens, model, threads, markdown, plot, json_out, command,
             saved, protect, windows, continuation, baselines, tails) -> None:
    from dataclasses import asdict

    from turbowire.quality.harness import EvalConfig, MethodResult, evaluate
    from turbowire.quality.methods import baseline_methods
    from turbowire.quality.report import markdown as to_markdown
    from turbowire.quality.report import plot as to_plot
    from turbowire.quality.report import rich_tables
    from turbowire.quality.targets import check_targets

    if saved is not None:
        results = [MethodResult(**r) for r in saved["results"]]
    else:
        try:
            config = EvalConfig(prompt_lengths=plens, windows=windows,
                                continuation=continuation, threads=threads)
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None
        mut = _load(console, model)
        methods = _codec_methods(names, mut, protect, tails)
        if baselines:
            methods += baseline_methods(mut.num_layers)
        console.print(f"model {mut.name}: {mut.num_layers} layers, {mut.num_kv_heads} KV heads, "
                      f"head_dim {mut.head_dim}; {len(methods)} methods")
        with _progress(console) as progress:
            task = progress.add_task("windows", total=len(config.prompt_lengths) * config.windows)
            results = evaluate(methods, config, mut,
                               progress=lambda label, done, total: progress.update(
                                   task, completed=done, description=label))
    for table in rich_tables(results):
        console.print(table)
    for check in check_targets(results):
        mark = "[green]met[/]" if check.met else "[red]not met[/]"
        console.print(
            f"P={check.prompt_len} target {check.description}: {mark} ({check.detail})")
    if markdown:
        _write(console, markdown, to_markdown(results))
    if plot:
        to_plot(results, plot)
        console.print(f"wrote {plot}")
    if json_out:
        _write(console, json_out, json.dumps(
            {"command": command, "results": [asdict(r) for r in results]}, indent=1))


def _retrieval(*, console, names, plens, model, threads, markdown, plot, json_out, command,
               saved, protect, depths, cases, needles, haystacks, keys, seed, baselines,
               tails) -> None:
    from turbowire.quality.methods import anchor_methods
    from turbowire.quality.retrieval import RetrievalConfig, RetrievalRun, evaluate_retrieval
    from turbowire.quality.retrieval_report import (
        CAPTION,
        NLL_TARGET_BITS,
        NLL_TARGET_RATIO,
        check_targets,
        rich_tables,
    )
    from turbowire.quality.retrieval_report import markdown as to_markdown
    from turbowire.quality.retrieval_report import plot as to_plot

    if saved is not None:
        run = RetrievalRun.from_json(saved)
    else:
        try:
            config = RetrievalConfig(lengths=plens, depths=depths, cases=cases, tasks=needles,
                                     haystacks=haystacks, keys=keys, seed=seed, threads=threads)
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None
        mut = _load(console, model)
        methods = _codec_methods(names, mut, protect, tails)
        if baselines:
            methods += anchor_methods(mut.num_layers)
        grid = config.grid()
        console.print(f"model {mut.name}: {mut.num_layers} layers, {mut.max_positions} "
                      f"positions; {len(grid)} prompts x {len(methods) + 1} methods (exact KV "
                      "included)")
        with _progress(console) as progress:
            bar = progress.add_task("cases", total=1)
            run = evaluate_retrieval(methods, config, mut,
                                     progress=lambda label, done, total: progress.update(
                                         bar, completed=done, total=total, description=label))
    for table in rich_tables(run):
        console.print(table)
    console.print(CAPTION, style="dim")
    for check in check_targets(run):
        mark = "[green]met[/]" if check.met else "[red]not met[/]"
        console.print(f"{check.length} tokens, {check.method} ({check.bits:.2f} b/e): answer NLL "
                      f"{check.ratio:.3f}x exact, target <= {NLL_TARGET_RATIO}x at <= "
                      f"{NLL_TARGET_BITS} b/e: {mark}")
    _write(console, markdown, to_markdown(run, command) if markdown else "")
    if plot:
        to_plot(run, plot)
        console.print(f"wrote {plot}")
    if json_out:
        _write(console, json_out, json.dumps({"command": command, **run.to_json()}, indent=1))


def _layers(*, console, names, plens, model, threads, markdown, plot, json_out, command,
            saved, protect, windows, continuation) -> None:
    from turbowire.quality.layers import (
        LayersConfig,
        LayerSweep,
        evaluate_layers,
        policy_lines,
        rich_tables,
    )
    from turbowire.quality.layers import markdown as to_markdown
    from turbowire.quality.layers import plot as to_plot

    if saved is not None:
        sweep = LayerSweep.from_json(saved)
    else:
        try:
            config = LayersConfig(prompt_len=plens[0], windows=windows,
                                  continuation=continuation, threads=threads)
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None
        mut = _load(console, model)
        methods = _codec_methods(names, mut, protect)
        console.print(f"model {mut.name}: {mut.num_layers} layers; {len(methods)} presets x "
                      f"{mut.num_layers} layers x {windows} windows")
        with _progress(console) as progress:
            bar = progress.add_task("layers", total=1)
            sweep = evaluate_layers(methods, config, mut,
                                    progress=lambda label, done, total: progress.update(
                                        bar, completed=done, total=total, description=label))
    for table in rich_tables(sweep):
        console.print(table)
    for line in policy_lines(sweep):
        console.print(line)
    _write(console, markdown, to_markdown(sweep, command) if markdown else "")
    if plot:
        to_plot(sweep, plot)
        console.print(f"wrote {plot}")
    if json_out:
        _write(console, json_out, json.dumps({"command": command, **sweep.to_json()}, indent=1))
