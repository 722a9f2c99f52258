"""``turbowire demo``: prefill + decode engines and the proxy on localhost, a few prompts, a
table.

The rendering (tables, the text of each act) is pure functions of the measurements, so it is
tested at 80 columns without engines (tests/unit/serving/test_demo_format.py): bytes in binary
units (``fmt_bytes``, shared with ``turbowire metrics``), times in ms or s, ratios as ``3.77x``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from turbowire.serving.demo import DemoResult, DemoRun, StoreAct
    from turbowire.serving.launch import EngineStartError

DEMO_MODEL = "SmolLM2-135M-Instruct"

#: Longest prompt echoed whole; a longer one shows its first sentences and how many words follow
#: (the long-document prompts are thousands of characters of the same paragraph).
PROMPT_ECHO_CHARS = 160


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


def fmt_ms(ms: float | None) -> str:
    """A duration read at a glance (at most 7 columns): ms below a second, s above."""
    if ms is None:
        return "-"
    if ms < 9.95:
        return f"{ms:.1f} ms"
    if ms < 999.5:
        return f"{ms:.0f} ms"
    s = ms / 1e3
    if s < 9.995:
        return f"{s:.2f} s"
    if s < 99.95:
        return f"{s:.1f} s"
    return f"{s:.0f} s"


def prompt_summary(prompt: str, limit: int = PROMPT_ECHO_CHARS) -> str:
    """The prompt whole when short; else its first paragraph's whole sentences that fit and the
    count of words left out, so the echo never ends mid-sentence without saying so."""
    words = prompt.split()
    flat = " ".join(words)
    if len(flat) <= limit:
        return flat
    first = " ".join(prompt.strip().split("\n\n", 1)[0].split())
    shown = ""
    for sentence in re.split(r"(?<=[.!?])\s+", first):
        candidate = f"{shown} {sentence}".strip()
        if len(candidate) > limit:
            break
        shown = candidate
    if not shown:  # the first sentence alone is too long: whole words that fit
        for word in words:
            if len(shown) + len(word) + 1 > limit:
                break
            shown = f"{shown} {word}".strip()
    rest = len(words) - len(shown.split())
    return f"{shown} (+{rest:,} more words)"


def transfers_table(results: Sequence[DemoResult]) -> Table:
    """Act 1's table, one row a request; sized for 80 columns even at extremes (1000 requests,
    a million tokens, GiB of KV): values carry their units, headers stay one word."""
    from rich import box
    from rich.table import Table

    from turbowire.metrics_summary import fmt_bytes, fmt_ratio

    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 0, 0, 1),
                  header_style="bold")
    for col in ("#", "tokens", "dense", "wire", "ratio", "transfer", "prefill", "TTFT"):
        table.add_column(col, justify="right", no_wrap=True)
    for i, res in enumerate(results, 1):
        table.add_row(
            str(i),
            f"{res.prompt_tokens:,}",
            fmt_bytes(res.dense_bytes),
            fmt_bytes(res.wire_bytes),
            fmt_ratio(res.ratio),
            fmt_ms(res.transfer_ms),
            fmt_ms(res.prefill_ms),
            fmt_ms(res.ttft_ms),
        )
    return table


TRANSFERS_LEGEND = (
    "tokens: the prompt tokens the prefill engine computed. dense: the KV cache they fill on "
    "the decode engine, uncompressed. wire: the encoded bytes that crossed NIXL, chunk headers "
    "included. ratio: dense / wire. transfer: from the decode engine's NIXL reads posted to the "
    "KV decoded into its cache. prefill: the prefill request, as the proxy timed it. TTFT: time "
    "to first token through the proxy, as a client sees it. KiB, MiB, GiB: 1024-based."
)


def _speedup(act: StoreAct) -> str:
    """Time saved by loading instead of computing, with the factor; says so when it was none."""
    from turbowire.metrics_summary import fmt_ratio

    if act.cold_ttft_ms <= 0 or act.hit_ttft_ms <= 0:
        return "-"
    if act.saved_ms < 0:
        return f"none ({fmt_ms(-act.saved_ms)} slower)"
    return f"{fmt_ms(act.saved_ms)} ({fmt_ratio(act.cold_ttft_ms / act.hit_ttft_ms)} faster)"


def store_table(act: StoreAct) -> Table:
    """The second act's table: cold TTFT on A vs store hit on B, what moved, what Redis holds."""
    from rich import box
    from rich.table import Table

    from turbowire.metrics_summary import fmt_bytes, fmt_ratio

    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 0, 0, 1),
                  header_style="bold")
    table.add_column("step", no_wrap=True)
    table.add_column("value", justify="right", no_wrap=True)
    read = fmt_bytes(act.loaded_store_bytes)
    if act.loaded_store_bytes:
        read += f" ({fmt_ratio(act.loaded_dense_bytes / act.loaded_store_bytes)} smaller)"
    rows = (
        ("prompt tokens", f"{act.prompt_tokens:,}"),
        ("engine A computes it: TTFT", fmt_ms(act.cold_ttft_ms)),
        ("engine B loads it from the store: TTFT", fmt_ms(act.hit_ttft_ms)),
        ("time saved on B", _speedup(act)),
        ("tokens B loaded (full chunks)", f"{act.loaded_tokens:,}"),
        ("dense KV of them", fmt_bytes(act.loaded_dense_bytes)),
        ("bytes B read from the store", read),
        ("chunks / bytes held in Redis", f"{act.redis_chunks:,} / {fmt_bytes(act.redis_bytes)}"),
        ("same request via the proxy: route", act.proxy_route),
        ("same request via the proxy: TTFT", fmt_ms(act.proxy_ttft_ms)),
    )
    for name, value in rows:
        table.add_row(name, value)
    return table


STORE_INTRO = (
    "Engine A computes one long document and stores its compressed chunks in Redis. Engine B, "
    "another process, gets the same request and loads those chunks instead of computing them. "
    "Then the proxy, asking the Redis directory, sends the request straight to the decode "
    "engine, past prefill."
)


def _labelled(label: str, text: str) -> Text:
    """``label`` in bold, then ``text`` verbatim (a Text, so brackets in a prompt or a
    completion are not read as rich markup)."""
    from rich.text import Text

    line = Text(f"{label} ", style="bold")
    line.append(text)
    return line


def print_store_act(console: Console, act: StoreAct, preset: str) -> None:
    """The second act: what it does, both engines' completions in full, its table."""
    from rich.text import Text

    console.print()
    console.rule(f"[bold]Act 2: the store path, preset {preset}[/bold]")
    console.print(Text(STORE_INTRO))
    console.print()
    a = act.completion_a.strip()
    b = act.completion_b.strip()
    console.print(_labelled("engine A (computed):", a))
    console.print(_labelled("engine B (from the store):",
                            "the same text as engine A" if b == a else b))
    console.print()
    console.print(store_table(act))


def print_demo(console: Console, run: DemoRun, log_dir: Path) -> None:
    """Everything the demo shows once it ran: act 1 (prompts, completions, table), act 2, a
    footer; all fits 80 columns."""
    from rich.text import Text

    console.print()
    console.rule(f"[bold]Act 1: prefill and decode over NIXL, preset {run.preset}[/bold]")
    console.print(Text(
        f"A prefill engine and a decode engine ({DEMO_MODEL}, one core each) behind the proxy: "
        f"each prompt is computed on the prefill engine, its KV compressed ({run.preset}) and "
        "read over NIXL by the decode engine, which writes the completion."
    ))
    for i, res in enumerate(run.results, 1):
        console.print()
        console.print(_labelled(f"#{i} prompt:", prompt_summary(res.prompt)))
        console.print(_labelled(f"#{i} completion:", res.completion.strip()))
    console.print()
    console.print(transfers_table(run.results))
    console.print(Text(TRANSFERS_LEGEND, style="dim"))
    if run.store is not None:
        print_store_act(console, run.store, run.preset)
    console.print()
    console.print(Text(
        f"startup {fmt_ms(run.startup_seconds * 1e3)}, warm-up request {fmt_ms(run.warmup_ms)}; "
        f"logs in {log_dir}", style="dim"
    ))


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
        (prompt tokens, dense bytes, wire bytes, ratio, transfer, prefill and TTFT times). Second
        act (the store path, with a local redis-server): one long document computed on engine A is
        loaded from the store by engine B and routed past prefill by the proxy; a table shows both
        TTFTs, the tokens loaded and the bytes Redis holds. Then it stops everything. The output
        fits 80 columns.

        Examples:

          turbowire demo

          turbowire demo --preset raw --prompt "What is the capital of France?"

          turbowire demo --no-store
        """
        from rich.console import Console

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
        print_demo(console, run, log_dir)
