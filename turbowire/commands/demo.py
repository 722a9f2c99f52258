"""``turbowire demo``: prefill + decode engines and the proxy on localhost, a few prompts, a
table."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from rich.console import Console

    from turbowire.serving.demo import StoreAct
    from turbowire.serving.launch import EngineStartError


def print_start_error(console: Console, exc: EngineStartError) -> None:
    """A red panel with the root cause and the log path (no Python traceback: it is ours, not
    the engine's); the log's tail only when no cause was found."""
    from rich.panel import Panel
    from rich.text import Text

    body = Text()
    if exc.root_cause:
        body.append(exc.root_cause, style="bold")
    else:
        body.append(f"{exc.what}; no error line found in its log", style="bold")
    body.append(f"\n\nfull log: {exc.log_path}" if exc.log_path else "")
    if exc.root_cause:
        body.append(f"\n({exc.what})", style="dim")
    console.print(Panel(body, title=f"{exc.label} failed to start", title_align="left",
                        border_style="red", expand=False))
    if not exc.root_cause and exc.tail:
        console.print(Text(exc.tail, style="dim"))


def print_store_act(console: Console, act: StoreAct, preset: str) -> None:
    """The second act's table: cold TTFT on A vs store hit on B, what moved, what Redis holds."""
    from rich.table import Table

    table = Table(title=f"store path: one long document on two engines (preset {preset})")
    table.add_column("")
    table.add_column("value", justify="right")
    rows = (
        ("prompt tokens", f"{act.prompt_tokens}"),
        ("engine A computes it: TTFT", f"{act.cold_ttft_ms:.0f} ms"),
        ("engine B loads it from the store: TTFT", f"{act.hit_ttft_ms:.0f} ms"),
        ("time saved on B", f"{act.saved_ms:.0f} ms ({act.hit_ttft_ms / act.cold_ttft_ms:.2f}x)"
         if act.cold_ttft_ms else "-"),
        ("tokens B loaded (full chunks)", f"{act.loaded_tokens}"),
        ("dense KV of them", f"{act.loaded_dense_bytes:,.0f} B"),
        ("bytes B read from the store", f"{act.loaded_store_bytes:,.0f} B"),
        ("chunks / bytes held in Redis", f"{act.redis_chunks} / {act.redis_bytes:,} B"),
        ("same request via the proxy: route", act.proxy_route),
        ("same request via the proxy: TTFT", f"{act.proxy_ttft_ms:.0f} ms"),
    )
    for name, value in rows:
        table.add_row(name, value)
    console.print()
    short = act.completion_b.strip().replace("\n", " ")
    console.print(f"[bold]store act, engine B:[/bold] {short[:200]}")
    console.print(table)


def register(app: typer.Typer) -> None:
    @app.command("demo")
    def demo(
        preset: str = typer.Option("tq4", help="Codec preset the engines use on the wire."),
        max_tokens: int = typer.Option(48, help="Tokens to generate per prompt."),
        prompt: list[str] = typer.Option(
            None, "--prompt", help="Prompt to send (repeatable); default: four built-in prompts."
        ),
        log_dir: Path = typer.Option(
            Path("/tmp/turbowire-demo"), help="Where the engine and proxy logs go."
        ),
        store: bool = typer.Option(
            True, "--store/--no-store",
            help="Run the engines with transport 'both' and a local redis-server, and play the "
            "second act (a long document computed on one engine, loaded from the store on the "
            "other).",
        ),
    ) -> None:
        """Run SmolLM2-135M-Instruct disaggregated on this machine and show what moved.

        Starts a prefill and a decode vLLM CPU engine (one core each) with TurboWireConnector and
        the P/D proxy, sends the prompts through the proxy, prints each completion and a table
        (prompt tokens, dense bytes, wire bytes, ratio, transfer ms, TTFT). Second act (the store
        path, with a local redis-server): one long document computed on engine A is loaded from
        the store by engine B and routed past prefill by the proxy; a table shows both TTFTs, the
        tokens loaded and the bytes Redis holds. Then it stops everything.

        Examples:

          turbowire demo

          turbowire demo --preset raw --prompt "What is the capital of France?"

          turbowire demo --no-store
        """
        from rich.console import Console
        from rich.table import Table

        from turbowire.connector.codecs import known_presets
        from turbowire.models import ensure_smollm2
        from turbowire.serving.demo import DEFAULT_PROMPTS, run_demo
        from turbowire.serving.launch import EngineStartError

        console = Console()
        presets = known_presets()
        if preset not in presets:
            raise typer.BadParameter(f"unknown preset {preset!r}; choose one of {presets}")
        model = ensure_smollm2()
        try:
            run = run_demo(
                model=model,
                preset=preset,
                prompts=prompt or DEFAULT_PROMPTS,
                max_tokens=max_tokens,
                log_dir=log_dir,
                on_progress=lambda msg: console.print(f"[dim]{msg}[/dim]"),
                store=store,
            )
        except EngineStartError as exc:  # the cause is in the engine's log, not in our stack
            print_start_error(Console(stderr=True), exc)
            raise typer.Exit(code=1) from None
        for i, res in enumerate(run.results, 1):
            short = res.prompt if len(res.prompt) < 90 else res.prompt[:87] + "..."
            console.print(f"\n[bold]#{i} prompt:[/bold] {short}")
            console.print(f"[bold]#{i} completion:[/bold] {res.completion.strip()}")
        table = Table(title=f"turbowire P/D transfers (preset {run.preset}, SmolLM2-135M-Instruct)")
        for col in ("#", "prompt tokens", "dense bytes", "wire bytes", "ratio", "transfer ms",
                    "prefill ms", "TTFT ms"):
            table.add_column(col, justify="right")
        for i, res in enumerate(run.results, 1):
            table.add_row(
                str(i),
                str(res.prompt_tokens),
                f"{res.dense_bytes:,.0f}",
                f"{res.wire_bytes:,.0f}",
                f"{res.ratio:.2f}x" if res.ratio else "-",
                f"{res.transfer_ms:.1f}" if res.transfer_ms is not None else "-",
                f"{res.prefill_ms:.0f}" if res.prefill_ms else "-",
                f"{res.ttft_ms:.0f}",
            )
        console.print()
        console.print(table)
        if run.store is not None:
            print_store_act(console, run.store, run.preset)
        console.print(
            f"[dim]startup {run.startup_seconds:.0f} s, warm-up request {run.warmup_ms:.0f} ms; "
            f"logs in {log_dir}[/dim]"
        )
