"""Every Python package folder of the source tree is installed by a non-editable install.

pyproject.toml lists its packages explicitly (the package-dir remap needs it). A folder missing
from that list works in the editable install the tests use and is silently absent from a wheel or
the Docker image (``turbowire.commands`` was: the CLI lost every subcommand there)."""

from __future__ import annotations

import fnmatch
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def source_packages() -> set[str]:
    """Dotted names of the folders with an ``__init__.py`` under each mapped package folder,
    except folders shipped whole as package data (``"turbowire" = ["data/*"]``)."""
    found: set[str] = set()
    for name, folder in SETUPTOOLS["package-dir"].items():
        base = ROOT / folder
        data_globs = SETUPTOOLS.get("package-data", {}).get(name, [])
        for init in base.rglob("__init__.py"):
            rel = init.parent.relative_to(base)
            if "__pycache__" in rel.parts:
                continue
            if any(fnmatch.fnmatch(f"{rel.as_posix()}/__init__.py", g) for g in data_globs):
                continue
            found.add(".".join([name, *rel.parts]) if rel.parts else name)
    return found


def test_every_source_package_is_installed() -> None:
    listed = set(SETUPTOOLS["packages"])
    missing = sorted(source_packages() - listed)
    assert not missing, f"pyproject.toml [tool.setuptools] packages lacks {missing}"


def test_the_walk_sees_the_nested_packages() -> None:
    found = source_packages()
    assert {"turbowire.connector.coder", "turbowire.commands", "turbowire.codec"} <= found
    assert "turbowire.data" not in found  # shipped as package data
