"""``turbowire metrics``: a live summary of turbowire series from engine or proxy /metrics pages."""

from __future__ import annotations

import json
import time

import typer


def register(app: typer.Typer) -> None:
    @app.command("metrics")
    def metrics(
        url: list[str] = typer.Option(
            ...,
            "--url",
            "-u",
            help="A /metrics URL (engine or proxy); repeat for several. "
            "'/metrics' is appended when the URL has no path.",
        ),
        interval: float = typer.Option(
            2.0, "--interval", "-i", min=0.2, help="Seconds between refreshes."
        ),
        once: bool = typer.Option(False, "--once", help="Print one table and exit (for scripts)."),
        as_json: bool = typer.Option(False, "--json", help="With --once: print JSON rows instead."),
        timeout: float = typer.Option(5.0, help="HTTP timeout per scrape, seconds."),
    ) -> None:
        """Compression ratio, wire vs dense bytes, transfer latency, failures, staging, store
        and proxy TTFT split, read from live /metrics pages. Refreshes until Ctrl-C; rates and
        the interval compression ratio appear from the second refresh on.

        Examples:

          turbowire metrics --url http://127.0.0.1:8100 --url http://127.0.0.1:8200

          turbowire metrics -u http://127.0.0.1:8000/metrics --once --json
        """
        import httpx
        from rich.console import Console
        from rich.live import Live
        from rich.table import Table

        from turbowire.metrics_summary import MetricsFormatError, Snapshot, summarize

        urls = [
            u if httpx.URL(u).path not in ("", "/") else u.rstrip("/") + "/metrics" for u in url
        ]
        for u in urls:
            if httpx.URL(u).scheme not in ("http", "https"):
                raise typer.BadParameter(f"{u!r} is not an http(s) URL", param_hint="--url")
        console = Console()
        previous: dict[str, tuple[float, Snapshot]] = {}

        def scrape(
            client: httpx.Client,
        ) -> tuple[list[tuple[str, list[tuple[str, str]]]], list[str]]:
            results, errors = [], []
            for u in urls:
                try:
                    resp = client.get(u)
                    resp.raise_for_status()
                    snap = Snapshot.parse(resp.text)
                except (httpx.HTTPError, MetricsFormatError) as exc:
                    errors.append(f"{u}: {exc}")
                    results.append((u, [("error", str(exc)[:120])]))
                    continue
                now = time.monotonic()
                before = previous.get(u)
                rows = summarize(
                    snap, before[1] if before else None, now - before[0] if before else None
                )
                if not rows:
                    rows = [("turbowire series", "none on this page")]
                previous[u] = (now, snap)
                results.append((u, rows))
            return results, errors

        def table(results: list[tuple[str, list[tuple[str, str]]]]) -> Table:
            t = Table(title="turbowire metrics", show_lines=False)
            t.add_column("source", style="cyan", no_wrap=True)
            t.add_column("metric")
            t.add_column("value", justify="right")
            for src, rows in results:
                for i, (what, value) in enumerate(rows):
                    t.add_row(src if i == 0 else "", what, value)
                t.add_section()
            return t

        with httpx.Client(timeout=timeout) as client:
            if once:
                results, errors = scrape(client)
                if as_json:
                    typer.echo(json.dumps({src: dict(rows) for src, rows in results}, indent=2))
                else:
                    console.print(table(results))
                if errors:
                    raise typer.Exit(code=1)
                return
            try:
                with Live(table(scrape(client)[0]), console=console, auto_refresh=False) as live:
                    while True:
                        time.sleep(interval)
                        live.update(table(scrape(client)[0]), refresh=True)
            except KeyboardInterrupt:
                pass
