"""The GPU benchmarks' CPU smoke modes run in CI (``TW_BENCH_SMOKE=1``: Triton interpreter, tiny
shapes), so that a renamed kernel or plan API breaks a test here instead of the next GPU sitting.

Each bench runs as the GPU targets run it, ``python -m bench.X`` from the repository root, in a
subprocess of its own (the smoke switch is read at import); the three run side by side to keep
the module near two minutes on two cores. The numbers they print mean nothing on a CPU: the test
checks that each exits 0, that its correctness checks passed and that its table has its columns.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 900

KERNELS_COLUMNS = "| model | layout | preset | ratio | encode ms | enc GB/s eff |"
BLOCK_CHUNKS_COLUMNS = ("| preset | variant | one launch ms | 32 per-layer launches (graph) ms "
                        "| wire MB | bytes equal to the first variant | reference spot check |")


@pytest.fixture(scope="module")
def smoke_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[int, str, Path]]:
    """Start every smoke run at once; (exit status, output, --out folder) per bench."""
    out = tmp_path_factory.mktemp("bench_smoke")
    env = {**os.environ, "TW_BENCH_SMOKE": "1", "TRITON_INTERPRET": "1"}
    commands = {
        # one preset in the table; the smoke checks add k8v4 fp16 and tq4 fp8 caches
        "kernels": ["--out", str(out / "kernels"), "--presets", "raw", "--check-presets", "raw",
                    "--layouts", "LBNHC", "--skip-sweep", "--jobs", "1"],
        "block_chunks": ["--out", str(out / "block_chunks"), "--presets", "tq4",
                         "--configs", "sm=0"],
        "kernels_profile": ["raw"],
    }
    procs = {
        name: subprocess.Popen([sys.executable, "-m", f"bench.{name}", *args], cwd=REPO_ROOT,
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
        for name, args in commands.items()
    }
    runs = {}
    for name, proc in procs.items():
        try:
            output, _ = proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
        runs[name] = (proc.returncode, output, out / name)
    return runs


def _ok(runs: dict[str, tuple[int, str, Path]], name: str) -> tuple[str, Path]:
    code, output, folder = runs[name]
    assert code == 0, f"bench.{name} exited {code}:\n{output[-4000:]}"
    return output, folder


def test_kernels_smoke(smoke_runs: dict[str, tuple[int, str, Path]]) -> None:
    _, folder = _ok(smoke_runs, "kernels")
    report = json.loads((folder / "results.json").read_text())
    checks = report["checks"]
    assert len(checks) == 3 and all(c["ok"] for c in checks), checks
    assert {r["model"] for r in report["results"]} == {"Llama-3.1-8B", "SmolLM2-135M"}
    assert report["hd256"], "the head_dim 256 comparison ran"
    table = (folder / "results.md").read_text()
    assert "correctness: 3/3 configurations bit-exact" in table
    assert KERNELS_COLUMNS in table and "| Llama-3.1-8B | LBNHC | raw |" in table


def test_block_chunks_smoke(smoke_runs: dict[str, tuple[int, str, Path]]) -> None:
    _, folder = _ok(smoke_runs, "block_chunks")
    rows = json.loads((folder / "results.json").read_text())["rows"]
    assert [(r["preset"], r["variant"], r["reference_spot_check"]) for r in rows] == [
        ("tq4", "sm=0", True)]
    lines = (folder / "results.md").read_text().splitlines()
    assert BLOCK_CHUNKS_COLUMNS in lines and lines[-1].startswith("| tq4 | sm=0 |")


def test_kernels_profile_smoke(smoke_runs: dict[str, tuple[int, str, Path]]) -> None:
    output, _ = _ok(smoke_runs, "kernels_profile")
    assert "smoke: 1 presets encoded and decoded" in output
