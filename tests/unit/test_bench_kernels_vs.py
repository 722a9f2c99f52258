"""bench/kernels_vs.py: the baseline tree it extracts and the table it prints (the GPU timing
itself runs on the H200; its CPU smoke mode is the same code as bench.kernels')."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run(args: list[str], cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


def test_baseline_is_an_importable_package_tree_of_that_commit(tmp_path: Path) -> None:
    dest = tmp_path / "base"
    proc = run(["-m", "bench.kernels_vs", "baseline", "HEAD", str(dest)])
    assert proc.returncode == 0, proc.stderr[-2000:]
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, check=True,
                          capture_output=True, text=True).stdout.strip()
    assert (dest / "REF").read_text().strip() == head
    for rel in ("turbowire/__init__.py", "turbowire/errors.py", "turbowire/codec/__init__.py",
                "turbowire/kernels/__init__.py", "turbowire/kernels/triton_codec.py"):
        assert (dest / rel).is_file(), rel
    assert not list(dest.rglob("*.so"))  # the C build of this machine does not travel
    # the extracted tree is what `python -m bench.kernels_vs time` imports on the baseline side
    probe = run(["-c", "import turbowire.codec, turbowire.kernels.triton_codec as t; "
                       "print(t.__file__)"], cwd=dest)
    assert probe.returncode == 0, probe.stderr[-2000:]
    assert probe.stdout.strip().startswith(str(dest))


def test_table_ratios_and_agreement() -> None:
    code = """
from bench.kernels_vs import table
row = dict(preset="tq4", chunk=256, encode_ms=0.5, decode_ms=0.4, wire_digest="a",
           cache_digest="b")
base = [dict(row, encode_ms=1.0, decode_ms=0.4)]
md = table(base, [row], "abc1234").splitlines()
assert md[0].startswith("ms; then = abc1234"), md[0]
assert md[4] == "| tq4 | 256 | 1.000 | 0.500 | 0.50 | 0.400 | 0.400 | 1.00 | yes |", md[4]
assert max(map(len, md)) <= 80
drift = table(base, [dict(row, cache_digest="c")], "abc1234").splitlines()
assert drift[4].endswith("| NO |"), drift[4]
print("ok")
"""
    proc = run(["-c", code])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().endswith("ok")


def test_time_refuses_an_unknown_preset(tmp_path: Path) -> None:
    proc = run(["-m", "bench.kernels_vs", "time", str(tmp_path / "t.json"), "--presets",
                "tq4,tq9"])
    assert proc.returncode == 2
    assert "unknown presets ['tq9']" in proc.stderr
    assert not (tmp_path / "t.json").exists()
