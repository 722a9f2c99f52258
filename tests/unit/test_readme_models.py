"""README's supported-models table names every tiny architecture the tests build, and the
architectures it calls served on real engines are the ones the e2e module runs."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from turbowire.models import TINY_ARCHITECTURES

ROOT = Path(__file__).resolve().parents[2]


def _table_rows() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Supported models", 1)[1].split("\n## ", 1)[0]
    return [line for line in section.splitlines() if line.startswith("| ")][1:]


def _e2e_architectures() -> set[str]:
    tree = ast.parse((ROOT / "tests/e2e/test_architectures_e2e.py").read_text())
    for node in tree.body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and getattr(node.targets[0], "id", "") == "ARCHITECTURES"):
            return set(ast.literal_eval(node.value))
    raise AssertionError("tests/e2e/test_architectures_e2e.py has no ARCHITECTURES")


def test_every_tiny_architecture_has_a_row():
    named = {tag for row in _table_rows() for tag in re.findall(r"`([a-z0-9][a-z0-9-]*)`", row)}
    assert set(TINY_ARCHITECTURES) <= named


def test_rows_served_on_real_engines_are_the_ones_the_e2e_runs():
    served = {tag for row in _table_rows() if row.rstrip().endswith("| real engines |")
              for tag in re.findall(r"`([a-z0-9][a-z0-9-]*)`", row)}
    # llama is the default e2e model: every other e2e module runs it
    assert served - {"llama"} == _e2e_architectures()
