"""``turbowire soak``: many random requests (some aborted) through the proxy to a P/D engine pair,
then leak checks (staging bytes, KV usage, fds, threads, RSS); exit code 1 when a bound is
violated."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from rich.console import Console

    from turbowire.serving.soak import SoakReport


def _ms(value: float | None) -> str:
    return f"{value * 1e3:.0f}" if value is not None else "-"


def _mib(value: float) -> str:
    return f"{value / (1 << 20):,.1f}"


def _signed(value: float, fmt: str = "{:+,.0f}") -> str:
    return fmt.format(value)


def _diffs(found: list) -> str:
    return f"{len(found)} ({sum(1 for d in found if d.tie_flip)})"


def print_report(console: Console, report: SoakReport) -> None:
    """The summary, per-engine and per-process-tree tables and the checks."""
    from rich.table import Table

    cfg = report.config
    lat, ttft = report.latency("latency_s"), report.latency("ttft_s")
    summary = Table(title=f"turbowire soak: {cfg['requests']} requests, concurrency "
                          f"{cfg['concurrency']}, preset {cfg['preset']}, seed {cfg['seed']}")
    summary.add_column("")
    summary.add_column("value", justify="right")
    rows = [
        ("requests", f"{len(report.outcomes)}"),
        ("completed ok", f"{report.count('ok')}"),
        ("aborted (client closed)", f"{report.aborted}"),
        ("  before the first token", f"{report.count('aborted_before_first_token')}"),
        ("  mid-stream", f"{report.count('aborted_mid_stream')}"),
        ("  planned, finished first", f"{report.abort_missed}"),
        ("failed (non-aborted)", f"{len(report.failed)}"),
        ("latency p50 / p99 ms (end-to-end)", f"{_ms(lat['p50'])} / {_ms(lat['p99'])}"),
        (f"TTFT p50 / p99 ms ({ttft['n']} streamed)", f"{_ms(ttft['p50'])} / {_ms(ttft['p99'])}"),
        ("greedy sample checked", f"{report.greedy_checked}"),
        ("  differs from prefill engine alone (near-tie flips)",
         _diffs(report.greedy_single_mismatches)),
        ("  differs from replay alone (near-tie flips)", _diffs(report.greedy_replay_mismatches)),
        ("proxy in-flight gauge at end", f"{report.proxy_in_flight_end:g}"
         if report.proxy_in_flight_end is not None else "-"),
        ("startup / run / settle s", f"{report.startup_s:.0f} / {report.run_s:.0f} / "
                                     f"{report.settle_s:.1f}"),
    ]
    for name, value in rows:
        summary.add_row(name, value)
    console.print(summary)

    engines = Table(title="engine gauges: baseline -> end (end before the probe step)")
    for col in ("engine", "staging bytes", "leases", "KV usage", "transfer failures",
                "fallbacks"):
        engines.add_column(col, justify="right" if col != "engine" else "left")
    for eng in ("prefill", "decode"):
        base, end = report.baseline.get(eng), report.end.get(eng)
        raw = report.end_unprobed.get(eng)
        if base is None or end is None:
            continue
        stale = f" ({raw.staging_bytes:,.0f})" if raw and raw.staging_bytes != end.staging_bytes \
            else ""
        kv_stale = f" ({raw.kv_usage:.4f})" if raw and raw.kv_usage != end.kv_usage else ""
        fails = report.failures_by_reason.get(eng) or {}
        falls = report.fallbacks_by_reason.get(eng) or {}
        engines.add_row(
            eng,
            f"{base.staging_bytes:,.0f} -> {end.staging_bytes:,.0f}{stale}",
            f"{base.leases:g} -> {end.leases:g}",
            f"{base.kv_usage:.4f} -> {end.kv_usage:.4f}{kv_stale}",
            ", ".join(f"{k} {v:g}" for k, v in sorted(fails.items()) if v) or "0",
            ", ".join(f"{k} {v:g}" for k, v in sorted(falls.items()) if v) or "0",
        )
    console.print(engines)

    trees = Table(title="process trees (process + children): after warm-up -> end")
    for col in ("tree", "processes", "RSS MiB", "RSS delta MiB", "fds", "threads"):
        trees.add_column(col, justify="right" if col != "tree" else "left")
    for name in ("prefill", "decode", "proxy"):
        b, a = report.trees_before.get(name), report.trees_after.get(name)
        if b is None or a is None:
            continue
        trees.add_row(
            name, f"{b.processes} -> {a.processes}",
            f"{_mib(b.rss_bytes)} -> {_mib(a.rss_bytes)}",
            _signed((a.rss_bytes - b.rss_bytes) / (1 << 20), "{:+,.1f}"),
            f"{b.fds} -> {a.fds} ({_signed(a.fds - b.fds)})",
            f"{b.threads} -> {a.threads} ({_signed(a.threads - b.threads)})",
        )
    console.print(trees)

    checks = Table(title="bounds")
    for col in ("check", "value", "bound", ""):
        checks.add_column(col, justify="left" if col == "check" else "right")
    for c in report.checks:
        value = _mib(c.value) + " MiB" if "RSS" in c.name else f"{c.value:g}"
        bound = _mib(c.bound) + " MiB" if "RSS" in c.name else f"<= {c.bound:g}"
        mark = "[green]ok[/green]" if c.ok else "[bold red]VIOLATED[/bold red]"
        checks.add_row(c.name + (f" [dim]({c.note})[/dim]" if c.note else ""), value, bound, mark)
    console.print(checks)
    for o in report.failed[:10]:
        console.print(f"[red]request {o.index} failed[/red] ({o.prompt_tokens} prompt tokens, "
                      f"max_tokens {o.max_tokens}, stream {o.stream}): {o.error}")


def register(app: typer.Typer) -> None:
    @app.command("soak")
    def soak(
        requests: int = typer.Option(1000, "--requests", min=1, help="Requests to send."),
        concurrency: int = typer.Option(8, "--concurrency", min=1, help="Requests in flight."),
        abort_fraction: float = typer.Option(
            0.05, "--abort-fraction", min=0.0, max=0.99,
            help="Fraction of requests the client closes (streamed; half after a random delay "
                 "from sending, half after a random number of tokens)."),
        seed: int = typer.Option(0, "--seed", help="Seed of prompts, lengths, max_tokens, aborts."),
        preset: str = typer.Option("tq4", "--preset", help="Codec preset of both engines."),
        model: str = typer.Option(
            "smollm2", "--model",
            help="'smollm2' (SmolLM2-135M-Instruct, prepared by `turbowire models prepare`) or "
                 "the folder of a Hugging Face model, e.g. the tiny e2e model that "
                 "`python -m turbowire.models` builds and prints."),
        warmup: int = typer.Option(
            50, "--warmup", min=0,
            help="Requests before the first resource sample (at most half the run)."),
        lease_seconds: float = typer.Option(
            5.0, "--lease-seconds", min=1.0,
            help="The engines' lease_seconds: how long an unread (aborted) lease holds staging."),
        engine_env: list[str] = typer.Option(
            [], "--engine-env", metavar="KEY=VALUE",
            help="Extra environment of both engines (repeatable); KEY= drops a default. "
                 "Default: ONEDNN_PRIMITIVE_CACHE_CAPACITY=64, which bounds oneDNN's per-shape "
                 "GEMM cache so the RSS bound measures the serving path, not that cache."),
        out: Path | None = typer.Option(None, "--out", help="Write the report as JSON here."),
        log_dir: Path = typer.Option(
            Path("/tmp/turbowire-soak"), "--log-dir", help="Engine and proxy logs."),
    ) -> None:
        """Soak a prefill + decode engine pair through the proxy and check nothing leaked.

        Starts both vLLM CPU engines (prefill on core 0, decode on core 1, under the machine-wide
        engine lock) with TurboWireConnector and a short lease, and the P/D proxy; sends
        --requests seeded random requests (prompt lengths from a few tokens to nearly
        max_model_len, random max_tokens with ignore_eos, streamed or not, greedy or sampled) at
        --concurrency, of which --abort-fraction are closed by the client before the first token
        or mid-stream. Then it checks: every non-aborted request returned 200 with max_tokens
        tokens; the prefill engine's staging bytes are back to 0 and both engines' KV usage to
        its baseline; open fds, threads and RSS of both engines' process trees grew no more than
        the bounds between the warm-up and the end; a sample of greedy outputs matches the same
        request replayed alone (and, with preset raw, the prefill engine alone). Exit code 1 when
        a bound is violated.

        Examples:

          turbowire soak                                   # 1000 requests, SmolLM2, tq4

          turbowire soak --requests 200 --concurrency 4 --abort-fraction 0.1 --seed 7

          turbowire soak --model ~/.cache/turbowire/models/tw-e2e-tiny-llama-v1 --preset raw

          turbowire soak --out /tmp/soak.json --log-dir /tmp/soak-logs

          turbowire soak --engine-env ONEDNN_PRIMITIVE_CACHE_CAPACITY=   # oneDNN's default cache
        """
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

        from turbowire.commands.demo import print_start_error
        from turbowire.connector.codecs import known_presets
        from turbowire.serving.launch import EngineStartError
        from turbowire.serving.soak import DEFAULT_ENGINE_ENV, SoakConfig, run_soak

        console = Console()
        presets = known_presets()
        if preset not in presets:
            raise typer.BadParameter(f"unknown preset {preset!r}; choose one of {presets}")
        if model.lower() == "smollm2":
            from turbowire.models import ensure_smollm2

            model_path = ensure_smollm2()
        else:
            model_path = Path(model).expanduser()
            if not (model_path / "config.json").is_file():
                raise typer.BadParameter(f"--model {model!r}: no config.json in that folder")
        env = dict(DEFAULT_ENGINE_ENV)
        for item in engine_env:
            key, sep, value = item.partition("=")
            if not sep or not key:
                raise typer.BadParameter(f"--engine-env {item!r}: expected KEY=VALUE")
            if value:
                env[key] = value
            else:
                env.pop(key, None)
        cfg = SoakConfig(requests=requests, concurrency=concurrency,
                         abort_fraction=abort_fraction, seed=seed, preset=preset,
                         warmup_requests=warmup, lease_seconds=lease_seconds, engine_env=env)
        import signal

        def _terminate(signum: int, _frame: object) -> None:
            raise SystemExit(128 + signum)  # unwind: engines and proxy are stopped

        signal.signal(signal.SIGTERM, _terminate)
        progress = Progress("{task.description}", BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), console=console)
        task = progress.add_task("requests", total=requests, visible=False)

        def on_progress(phase: str, done: int, total: int) -> None:
            progress.update(task, completed=done, total=total, visible=True)

        try:
            with progress:
                report = run_soak(
                    cfg, model=model_path, log_dir=log_dir, on_progress=on_progress,
                    on_message=lambda msg: progress.console.print(f"[dim]{msg}[/dim]"),
                )
        except EngineStartError as exc:
            print_start_error(Console(stderr=True), exc)
            raise typer.Exit(code=1) from None
        console.print()
        print_report(console, report)
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(report.to_dict(), indent=2) + "\n")
            console.print(f"[dim]report written to {out}[/dim]")
        console.print(f"[dim]logs in {log_dir}[/dim]")
        if not report.ok:
            console.print("[bold red]soak: bounds violated[/bold red]")
            raise typer.Exit(code=1)
        console.print("[bold green]soak: all bounds held[/bold green]")
