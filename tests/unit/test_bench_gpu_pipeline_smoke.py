"""The two-process GPU pipeline bench (``python -m bench.gpu_pipeline``) in its CPU smoke mode:
a producer and a consumer process with real NIXL agents (DRAM, UCX), the connector worker's
save and load paths on the installed package's public names under Triton's interpreter, both
dense anchors; the table has its columns and fits 80 columns, the decoded layers equal the
reference codec's decode, the dense READ's bytes equal the source's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HEADER = ["path", "handoff ms", "wire MB", "wire GB/s", "dense-eq GB/s", "vs (a)", "exact"]


def test_bench_gpu_pipeline_smoke(tmp_path: Path) -> None:
    env = {**os.environ, "TW_BENCH_SMOKE": "1"}
    env.pop("OUT", None)
    env.pop("UCX_TLS", None)
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_pipeline", "--out", str(tmp_path),
                           "--case-timeout", "240"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    logs = "".join((tmp_path / n).read_text()[-3000:] for n in ("producer.log", "consumer.log")
                   if (tmp_path / n).exists())
    if proc.returncode != 0:
        pytest.fail(f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-3000:]}\n"
                    f"{logs}")
    md = (tmp_path / "results.md").read_text()
    table = [line for line in md.splitlines() if line.startswith("|")]
    assert [c.strip() for c in table[0].strip("|").split("|")] == HEADER
    assert max(len(line) for line in md.splitlines()) <= 80
    paths = {line.split("|")[1].strip(): line.split("|")[-2].strip() for line in table[2:5]}
    assert paths == {"tq4": "yes", "a:blocks": "yes", "b:contig": "-"}, paths
    report = json.loads((tmp_path / "results.json").read_text())
    (case,) = report["cases"]
    assert not case["error"]
    rows = {r["path"]: r for r in case["rows"]}
    tw = rows["tq4"]
    assert tw["check"]["ok"] and tw["check"]["layers"] == [0, 1]
    assert 0 < tw["wire_bytes"] < rows["a:blocks"]["wire_bytes"]  # compressed < dense blocks
    assert tw["handoff_ms"] > 0 and rows["a:blocks"]["handoff_ms"] > 0
    assert rows["a:blocks"]["descriptors"] == 2 * 2 * 3  # K and V of 2 layers x 3 blocks
    assert rows["a:blocks"]["vs_a"] == 1.0
    assert {t["descriptors"] for t in rows["b:contig"]["tried"]} == {1, 8, 64}
    assert case["producer"]["anchors"]["notifications"] >= 1  # NixlConnector's READ notifs
