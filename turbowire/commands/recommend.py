"""``turbowire recommend``: which preset to use, from the measured results."""

from __future__ import annotations

from pathlib import Path

import typer

RESULTS = Path("bench/results")
DEFAULTS = {
    "quality": RESULTS / "quality/eval.json",
    # several runs are pooled, a later file's cases replacing the same cases of an earlier one
    "retrieval": [RESULTS / "quality/retrieval.json", RESULTS / "quality/retrieval_short.json"],
    "h200": RESULTS / "kernels_vs/presets.json",
    "cpu": RESULTS / "cpu_codec/results.json",
    "recompute_quality": RESULTS / "quality/recompute.json",
    "recompute_retrieval": [RESULTS / "quality/retrieval_recompute.json",
                            RESULTS / "quality/retrieval_short.json"],
}


def register(app: typer.Typer) -> None:
    @app.command("recommend")
    def recommend(
        quality: Path = typer.Option(DEFAULTS["quality"], help="`turbowire eval --json` output."),
        retrieval: list[Path] = typer.Option(
            DEFAULTS["retrieval"],
            help="`turbowire eval --task retrieval --json` output (repeat the option to pool "
                 "runs; a case a later file repeats is taken from it)."),
        h200: Path = typer.Option(
            DEFAULTS["h200"],
            help="`python -m bench.kernels_vs time OUT --presets all --chunks 256` (H200)."),
        cpu: Path = typer.Option(
            DEFAULTS["cpu"], help="`python -m bench.cpu_codec --json` output (one core)."),
        recompute_quality: Path = typer.Option(
            DEFAULTS["recompute_quality"],
            help="`turbowire eval --recompute N --json` output (rows `<preset>+rN`)."),
        recompute_retrieval: list[Path] = typer.Option(
            DEFAULTS["recompute_retrieval"],
            help="`turbowire eval --task retrieval --recompute N --json` output (repeatable)."),
        markdown: Path | None = typer.Option(
            None, "--markdown", help="Also write the table and verdicts as Markdown here."),
    ) -> None:
        """The recommended-configuration table: per preset bits/element, ratio, KL, top-1,
        retrieval accuracy against the exact KV, codec throughput, and which to use when.

        It only reads results (the defaults are the files committed in bench/results of a
        turbowire checkout); a preset whose retrieval falls more than 1 point below the same
        run's exact KV at any prompt length, or was not measured, is never recommended. Rows
        `<preset>+rN` are the preset with `recompute_recent_tokens: N`, judged the same way on
        the runs made with `turbowire eval --recompute N`.

        Examples:

          turbowire recommend

          turbowire eval --task retrieval --json r.json && turbowire recommend --retrieval r.json
        """
        from rich import box
        from rich.console import Console
        from rich.table import Table

        from turbowire.quality.recommend import HEAD, build, source_labels, table_rows
        from turbowire.quality.recommend import markdown as to_markdown

        paths = dict(quality=quality, retrieval=retrieval, h200=h200, cpu=cpu,
                     recompute_quality=recompute_quality,
                     recompute_retrieval=recompute_retrieval)
        files = [(k, v) for k, vs in paths.items() for v in (vs if isinstance(vs, list) else [vs])]
        missing = [f"--{k.replace('_', '-')} {v}" for k, v in files if not v.exists()]
        if len(missing) == len(files):
            raise typer.BadParameter(
                "no result file found (" + ", ".join(missing) + "): run it from a turbowire "
                "checkout, or pass the files `turbowire eval --json` and the benches wrote")
        console = Console()
        for m in missing:
            console.print(f"[yellow]not found, its columns stay empty:[/] {m}")
        rows = build(quality, retrieval, h200, cpu, recompute_quality=recompute_quality,
                     recompute_retrieval=recompute_retrieval)
        table = Table(title="turbowire presets, as measured", title_justify="left",
                      box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False,
                      padding=(0, 1), collapse_padding=True)
        cells = table_rows(rows)
        for i, h in enumerate(HEAD):  # each column as wide as its widest cell: nothing cut
            table.add_column(h, justify="left" if i == 0 else "right", no_wrap=True,
                             min_width=max(len(c[i]) for c in cells))
        for c in cells:
            table.add_row(*c)
        console.print(table)
        for r in rows:
            console.print(f"[bold]{r.label}[/]: {r.verdict}")
        if markdown:
            markdown.parent.mkdir(parents=True, exist_ok=True)
            markdown.write_text(to_markdown(rows, source_labels(paths)))
            console.print(f"wrote {markdown}")
