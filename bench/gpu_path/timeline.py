"""Where a held load's landed -> finished goes, from the connector's own probe marks
(``turbowire.connector.probe``: ``loader.advance``, ``loader.take_landed``, ``loader.post_reads``,
``loader.decode``, ``coder.prepare_load``, ``coder.capture``, ``coder.launch``, ...), no
profiler, nothing of the product wrapped. Per mark: calls per load, the first call's start after
the landing and the inclusive time summed over the load's calls; medians over the loads. A mark
costs ~0.3-0.5 us with a recorder installed, so these loads run a little slower than plain ones.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from typing import Any

from bench.gpu_path.load import LoadRig, load_once


def summarise(per_load: list[list[tuple[str, int, int]]]) -> dict[str, dict[str, float]]:
    """Per mark name over the loads' spans ``(name, start_ns, end_ns)`` (ns from the landing;
    spans before it, the posting's, are negative): median calls, first start and summed time
    (ms); marks absent from a load count as 0 calls there."""
    names = sorted({name for spans in per_load for name, _, _ in spans})
    out: dict[str, dict[str, float]] = {}
    for name in names:
        calls, first, total = [], [], []
        for spans in per_load:
            mine = [(a, b) for n, a, b in spans if n == name]
            calls.append(len(mine))
            if mine:
                first.append(min(a for a, _ in mine) / 1e6)
                total.append(sum(b - a for a, b in mine) / 1e6)
        out[name] = {"calls": statistics.median(calls),
                     "first_ms": statistics.median(first) if first else 0.0,
                     "total_ms": statistics.median(total) if total else 0.0}
    return out


def table(summary: dict[str, dict[str, float]]) -> str:
    """The timeline as rows in the order of each mark's first call (<= 80 columns)."""
    lines = [f"{'mark':<24} {'calls':>6} {'first at ms':>12} {'sum ms':>10}"]
    for name, s in sorted(summary.items(), key=lambda kv: kv[1]["first_ms"]):
        lines.append(f"{name:<24} {s['calls']:>6g} {s['first_ms']:>12.3f} {s['total_ms']:>10.3f}")
    return "\n".join(lines)


def run_timeline(rig: LoadRig, tag: str, log: Callable[[str], None],
                 loads: int = 12) -> dict[str, Any]:
    """``loads`` held loads with the probe recording; their timeline and landed -> finished."""
    per_load: list[list[tuple[str, int, int]]] = []
    landed = []
    rig.poison()
    for i in range(loads):
        marks: list[tuple[str, int, int]] = []
        landed.append(load_once(rig, f"tl{i}", True, marks=marks)["landed"])
        per_load.append(marks)
    summary = summarise(per_load)
    out = {"loads": loads, "landed_ms": statistics.median(landed), "marks": summary,
           "decode_equal": rig.equal_reference()}
    log(f"  load timeline {tag} (landed -> finished {out['landed_ms']:.3f} ms):\n"
        + table(summary))
    log(f"  load timeline {tag}: {json.dumps(out)}")
    return out
