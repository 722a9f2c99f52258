"""``turbowire eval``: the quality table of the presets against baselines on the real model."""

from __future__ import annotations

from pathlib import Path

import typer


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated integers, got {text!r}") from None


def register(app: typer.Typer) -> None:
    @app.command("eval")
    def eval_cmd(
        lengths: str = typer.Option(
            "512,2048", "--lengths", help="Prompt lengths (comma-separated)."),
        windows: int = typer.Option(
            16, "--windows", min=2, help="Corpus windows per prompt length."),
        continuation: int = typer.Option(
            32, "--continuation", min=1, help="Continuation tokens scored per window."),
        presets: str = typer.Option(
            "", "--presets",
            help="Presets to evaluate (comma-separated; default: all but raw)."),
        baselines: bool = typer.Option(
            True, "--baselines/--no-baselines",
            help="Include fp8, KIVI and vLLM TurboQuant reproductions."),
        model: str = typer.Option(
            "", "--model", help="HF model folder (default: the bundled SmolLM2-135M-Instruct)."),
        markdown: Path | None = typer.Option(
            None, "--markdown", help="Also write the tables as Markdown here."),
        plot: Path | None = typer.Option(None, "--plot", help="Write a KL-vs-bits PNG here."),
        threads: int = typer.Option(2, "--threads", min=1, help="torch CPU threads."),
    ) -> None:
        """Measure what each codec does to the model in the P/D handoff scenario.

        The prompt's KV (every layer, post-RoPE K, bf16) goes through encode/decode; the
        continuation runs against it; KL(ref||test), top-1 agreement and perplexity are compared
        with the exact run. Baselines run in the same process on the same windows.

        Examples:

          turbowire eval                                   # full table: P=512 and 2048, 16 windows

          turbowire eval --lengths 512 --windows 4 --presets tq4,tq3 --no-baselines   # quick look

          turbowire eval --markdown table.md --plot kl_vs_bits.png
        """
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        from turbowire.codec import list_presets
        from turbowire.quality.harness import EvalConfig, ModelUnderTest, evaluate
        from turbowire.quality.methods import CodecMethod, baseline_methods
        from turbowire.quality.report import markdown as to_markdown
        from turbowire.quality.report import plot as to_plot
        from turbowire.quality.report import rich_tables
        from turbowire.quality.targets import check_targets

        console = Console()
        names = [p for p in presets.split(",") if p] or [p for p in list_presets() if p != "raw"]
        unknown = sorted(set(names) - set(list_presets()))
        if unknown:
            raise typer.BadParameter(f"unknown presets {unknown}; known: {list_presets()}")
        config = EvalConfig(prompt_lengths=_ints(lengths), windows=windows,
                            continuation=continuation, threads=threads)
        with console.status("loading the model"):
            mut = ModelUnderTest(model or None)
        methods = [CodecMethod(n, mut.head_dim, mut.num_layers) for n in names]
        if baselines:
            methods += baseline_methods(mut.num_layers)
        console.print(f"model {mut.name}: {mut.num_layers} layers, {mut.num_kv_heads} KV heads, "
                      f"head_dim {mut.head_dim}; {len(methods)} methods")
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=console) as progress:
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
            markdown.write_text(to_markdown(results))
            console.print(f"wrote {markdown}")
        if plot:
            to_plot(results, plot)
            console.print(f"wrote {plot}")
