"""Every benchmark's command line answers ``--help`` from the repository root, as bench/README.md
runs them (``python -m bench.<name>``): a benchmark that no longer imports (a renamed name, a
shadowed helper package: ``bench.metrics_run`` imported ``tests.support`` while a dependency
installs a top-level ``tests`` package) fails here, not on the day someone reruns it. GPU-only
benchmarks must parse their arguments before touching the device."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def bench_commands() -> list[str]:
    """``bench.<module>`` for every file of bench/ with a ``__main__`` block, and every bench
    package with a ``__main__.py``."""
    out = []
    for path in sorted((REPO / "bench").rglob("*.py")):
        rel = path.relative_to(REPO).with_suffix("")
        if path.name == "__main__.py":
            out.append(".".join(rel.parts[:-1]))
        elif path.name != "__init__.py" and 'if __name__ == "__main__":' in path.read_text():
            out.append(".".join(rel.parts))
    return out


def test_the_benchmarks_are_found():
    found = bench_commands()
    assert {"bench.gpu_path", "bench.metrics_run", "bench.kernels"} <= set(found), found


@pytest.mark.parametrize("module", bench_commands())
def test_every_benchmark_answers_help(module):
    env = {**os.environ, "TW_BENCH_SMOKE": "1"}  # no GPU here: the CPU modes' imports
    proc = subprocess.run([sys.executable, "-m", module, "--help"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "usage" in proc.stdout.lower(), proc.stdout[-2000:]
