"""The GPU connector path bench (``python -m bench.gpu_path``) in its CPU smoke mode: the code
paths run on the installed package's public names (a renamed or removed one fails here, not at
the next GPU sitting), the table has its columns, the bit-exactness checks ran and passed; and
the checks' comparison does fail on one corrupted byte."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


FIRST_MISMATCH = """
import torch
from bench.gpu_path.check import first_mismatch

a = torch.arange(64, dtype=torch.uint8)
b = a.clone()
assert first_mismatch(a, b) is None
b[37] ^= 0x40
assert first_mismatch(a, b) == 37, first_mismatch(a, b)
x = torch.linspace(-2, 2, 32).to(torch.bfloat16)
y = x.clone()
y.view(torch.uint8)[2 * 9 + 1] ^= 0x01  # one byte of element 9
assert first_mismatch(x, y) == 9, first_mismatch(x, y)
assert first_mismatch(x, y[:16]) == 0  # another shape is a mismatch
print("first_mismatch ok")
"""


def bench_python(args: list[str], cwd: Path = REPO, timeout: float = 600):
    """The bench runs as ``python -m`` from the repo root (it is not importable from here, and
    its stand-ins for vLLM/NIXL must not enter this process)."""
    env = {**os.environ, "TW_BENCH_SMOKE": "1"}
    env.pop("OUT", None)
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_first_mismatch_finds_one_flipped_byte() -> None:
    proc = bench_python(["-c", FIRST_MISMATCH])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "first_mismatch ok" in proc.stdout


#: ``python -m bench.gpu_path`` as on the GPU machine, where vLLM cannot be carried: every
#: ``vllm`` import fails, so the bench runs on stubs.py's stand-ins (a vLLM name the connector
#: starts to use and the stand-ins lack fails here, not at the next GPU sitting).
WITHOUT_VLLM = """
import importlib.abc, runpy, sys

class HideVllm(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "vllm" or name.startswith("vllm."):
            raise ModuleNotFoundError(f"No module named {name!r} (hidden, as on the GPU machine)")
        return None

sys.meta_path.insert(0, HideVllm())
sys.argv = ["bench.gpu_path", *sys.argv[1:]]
runpy.run_module("bench.gpu_path", run_name="__main__", alter_sys=True)
"""


def test_bench_gpu_path_smoke(tmp_path: Path) -> None:
    proc = bench_python(["-c", WITHOUT_VLLM, "--out", str(tmp_path),
                         "--skip-kernel-check", "--load-timeline", "--tp"])
    if proc.returncode != 0:
        pytest.fail(f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    md = (tmp_path / "results.md").read_text()
    table = md.split("```")[1].strip().splitlines()
    assert table[0].split() == ["tokens", "preset", "fwd_ms", "save_%", "batch_%", "aa_%",
                                "load_ms", "dec_ms", "load/dec", "exact"]
    assert len(table) == 2 and table[1].split()[-1] == "yes"
    assert max(len(line) for line in table) <= 80
    report = json.loads((tmp_path / "results.json").read_text())
    assert report["bit_exact"] is True
    connector = [c for c in report["checks"] if "corruption_refused" in c]
    assert connector and all(c["encode_bitexact"] and c["decode_bitexact"]
                             and c["corruption_refused"] and c["ok"] for c in connector)
    groups = [c for c in report["checks"] if c.get("check") == "groups_check"]
    assert groups and all(c["ok"] and c["chunks_skipped"] > 0 for c in groups), groups
    state = [c for c in report["checks"] if c.get("check") == "state_check"]
    assert state and all(c["ok"] and c["state_moved"] and c["coder"] == "HostCoder"
                         for c in state), state
    latent = [c for c in report["checks"] if c.get("check") == "latent_check"]
    assert latent and all(c["ok"] and c["rope_exact"] and c["coder"] == "HostCoder"
                          for c in latent), latent
    cut = [c for c in report["checks"] if c.get("check") == "tp_check"]
    assert cut and all(c["ok"] and c["runs_bitexact"] and c["windows_bitexact"]
                       and c["coder"] == "CudaCoder" and c["runs_per_chunk"] == 2
                       for c in cut), cut
    tp_table = md.split("```")[3].strip().splitlines()
    assert tp_table[0].split()[:4] == ["tokens", "preset", "fwd_ms", "whole_%"]
    assert len(tp_table) == 2 and max(len(line) for line in tp_table) <= 80
    case = report["results"][0]
    assert all(case["staging_equal"].values())
    assert case["decode_equal_held_loads"]
    assert case["reference_spot_check"]["decode_equal_reference"]
    marks = case["timeline"]["marks"]  # the connector's probe marks reached the bench
    assert {"loader.decode", "coder.launch"} <= set(marks)
