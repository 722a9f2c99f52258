"""Import ``turbowire.codec`` / ``turbowire.kernels`` from the repository without installing it.

The GPU machine gets a bare copy of the working tree (no ``pip install -e .``), so the GPU
benchmarks load the two folders as the ``turbowire`` subpackages they are when installed.
Where turbowire is installed, the installed package is used as is.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def bootstrap_turbowire() -> None:
    """Make ``turbowire.codec`` and ``turbowire.kernels`` importable (idempotent)."""
    try:
        import turbowire.codec  # noqa: F401
        import turbowire.kernels  # noqa: F401

        return
    except ImportError:
        pass
    pkg = types.ModuleType("turbowire")
    pkg.__path__ = [str(REPO / "turbowire")]  # type: ignore[attr-defined]
    sys.modules["turbowire"] = pkg
    for name in ("codec", "kernels"):
        spec = importlib.util.spec_from_file_location(
            f"turbowire.{name}", REPO / name / "__init__.py",
            submodule_search_locations=[str(REPO / name)],
        )
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        setattr(pkg, name, mod)
        spec.loader.exec_module(mod)
