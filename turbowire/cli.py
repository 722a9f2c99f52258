"""The ``turbowire`` command line: one typer app, one module per subcommand group.

Subcommand modules live in ``turbowire/commands/`` and expose ``register(app)``; they import their
heavy dependencies (torch, vLLM, grpc) inside the command functions so ``turbowire --help`` is fast.
"""

from __future__ import annotations

import importlib
import inspect
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


def reflow(doc: str) -> str:
    """A command's docstring as help text: each prose paragraph on one line, the terminal wraps it
    (rich help keeps single newlines, so lines broken at the source's width wrap twice at 80
    columns); a paragraph with an indented line (examples) stays as written."""
    out = []
    for para in inspect.cleandoc(doc).split("\n\n"):
        lines = para.split("\n")
        if any(line[:1].isspace() for line in lines):
            out.append("\n".join(_comment_above(line) for line in lines))
        else:
            out.append(" ".join(line.strip() for line in lines))
    return "\n\n".join(out)


def _comment_above(line: str, width: int = 76) -> str:
    """An example line too wide for 80 columns with a trailing ``# comment``: the comment on a
    line of its own above the command."""
    command, sep, comment = line.partition("  # ")
    if len(line) <= width or not sep:
        return line
    indent = line[: len(line) - len(line.lstrip())]
    return f"{indent}# {comment.strip()}\n{command.rstrip()}"


def _reflow_commands(typer_app: typer.Typer) -> None:
    for info in typer_app.registered_commands:
        if info.help is None and info.callback is not None and info.callback.__doc__:
            info.help = reflow(info.callback.__doc__)
    for group in typer_app.registered_groups:
        if group.typer_instance is not None:
            _reflow_commands(group.typer_instance)


_reflow_commands(app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
