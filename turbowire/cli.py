"""The ``turbowire`` command line: one typer app, one module per subcommand group.

Subcommand modules live in ``turbowire/commands/`` and expose ``register(app)``; they import their
heavy dependencies (torch, vLLM, grpc) inside the command functions so ``turbowire --help`` is fast.
"""

from __future__ import annotations

import importlib
import logging

import typer

from turbowire import __version__

app = typer.Typer(
    name="turbowire",
    help=(
        "Compressed KV-cache transfer for disaggregated vLLM serving.\n\n"
        "Examples:\n\n"
        "  turbowire presets                 # codec presets with bits/element and ratio\n\n"
        "  turbowire eval --lengths 512      # quality table on the real model\n\n"
        "  turbowire proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200\n\n"
        "  turbowire metrics --url http://127.0.0.1:8200/metrics"
    ),
    no_args_is_help=True,
    rich_markup_mode="rich",
    pretty_exceptions_show_locals=False,
)

# Order is the order shown in --help. A module that is not there yet is skipped.
COMMAND_MODULES = ["presets", "eval", "recommend", "models", "proxy", "demo", "metrics", "bench",
                   "soak"]


def _version_callback(value: bool) -> None:
    if value:
        typer.echo(f"turbowire {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version_callback, is_eager=True, help="Print the version."
    ),
    log_level: str = typer.Option("WARNING", "--log-level", help="Python logging level."),
) -> None:
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")


for _name in COMMAND_MODULES:
    try:
        _module = importlib.import_module(f"turbowire.commands.{_name}")
    except ModuleNotFoundError as exc:
        if exc.name != f"turbowire.commands.{_name}":
            raise
        continue
    _module.register(app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
