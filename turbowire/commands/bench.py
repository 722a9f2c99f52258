"""``turbowire bench``: benchmarks (sub-app; ``bench e2e`` is the end-to-end P/D benchmark)."""

from __future__ import annotations

from pathlib import Path

import typer

bench = typer.Typer(help="Benchmarks: end-to-end P/D over a shaped link (more may join).",
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
        help="Comma list: 'nixl' and 'tw:<preset>' (default: nixl, tw:raw, tw:<recommended>)."),
    presets: str = typer.Option(
        "tq4", "--presets", help="Recommended turbowire presets when --configs is not given."),
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
