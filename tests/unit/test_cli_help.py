"""Every command's --help reads well at 80 columns: prose paragraphs flow (rich help keeps single
newlines, so docstring lines broken at the source's width would wrap twice), examples keep their
lines, and an example's trailing comment moves above it when the line is too wide."""

from __future__ import annotations

import typer
from typer.testing import CliRunner

from turbowire.cli import app, reflow


def _commands(typer_app: typer.Typer, prefix: tuple[str, ...] = ()):
    for info in typer_app.registered_commands:
        yield (*prefix, info.name or info.callback.__name__), info
    for group in typer_app.registered_groups:
        yield from _commands(group.typer_instance, (*prefix, group.name))


def test_reflow_joins_prose_and_keeps_examples() -> None:
    doc = """Summary line.

    A paragraph broken at the
    source's width.

    Examples:

      turbowire eval --lengths 512
      turbowire eval --task retrieval --markdown r.md --plot r.png --json r.json   # long comment
    """
    paras = reflow(doc).split("\n\n")
    assert paras[0] == "Summary line."
    assert paras[1] == "A paragraph broken at the source's width."
    assert paras[3].split("\n") == [
        "  turbowire eval --lengths 512",
        "  # long comment",
        "  turbowire eval --task retrieval --markdown r.md --plot r.png --json r.json",
    ]


def test_short_example_keeps_its_comment() -> None:
    doc = "S.\n\nProse.\n\n  turbowire demo   # the demo"
    assert reflow(doc) == doc


def test_every_command_help_flows() -> None:
    seen = 0
    for name, info in _commands(app):
        assert info.help, f"{' '.join(name)} has no help"
        for para in info.help.split("\n\n"):
            lines = para.split("\n")
            if not any(line[:1].isspace() for line in lines):
                assert len(lines) == 1, f"{' '.join(name)}: prose broken mid-paragraph: {para!r}"
        seen += 1
    assert seen >= 10


def test_help_renders_within_80_columns() -> None:
    runner = CliRunner()
    for name, _ in _commands(app):
        result = runner.invoke(app, [*name, "--help"], terminal_width=80,
                               env={"COLUMNS": "80", "TERM": "dumb"})
        assert result.exit_code == 0, result.output
        assert "Usage" in result.output
        assert max(len(line) for line in result.output.splitlines()) <= 80
