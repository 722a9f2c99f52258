"""A case's rows from the two processes' marks, and the Markdown tables (<= 80 columns).

handoff: the producer's "last layer computed" (t0) -> the consumer's "last layer decoded" (t1),
both read with ``perf_counter_ns`` after a CUDA synchronisation, one clock for the host's
processes. READ: the load's own report for the connector's path (posted -> last READ seen
landed), posted -> DONE for the anchors. wire GB/s: wire bytes / READ time; dense-eq GB/s: the
request's dense KV bytes / handoff; vs (a): anchor (a)'s handoff / this path's (above 1: faster
than NixlConnector's way). Medians over the measured rounds (warm-up rounds dropped).
"""

from __future__ import annotations

import statistics
from typing import Any

TABLE = ["path", "handoff ms", "wire MB", "wire GB/s", "dense-eq GB/s", "vs (a)", "exact"]
PARTS = ["path", "fwd ms", "tail ms", "msg us", "READ ms", "decode ms", "polls"]


def med(values: list[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def preset_row(name: str, model: str, tokens: int, dense: int, warmup: int,
               p: dict[str, Any], c: dict[str, Any]) -> dict[str, Any]:
    """The connector's path of one preset."""
    rounds = c["rounds"][warmup:]
    handoff = med([(r["t1"] - r["t0"]) / 1e6 for r in rounds])
    read = med([r["transfer_s"] * 1e3 for r in rounds])
    wire = rounds[-1]["wire_bytes"]
    return {"model": model, "tokens": tokens, "path": name, "kind": "turbowire",
            "handoff_ms": handoff,
            "handoff_ms_min_max": [min((r["t1"] - r["t0"]) / 1e6 for r in rounds),
                                   max((r["t1"] - r["t0"]) / 1e6 for r in rounds)],
            "wire_bytes": wire, "dense_bytes": dense, "read_ms": read,
            "wire_gbs": wire / read / 1e6, "dense_eq_gbs": dense / handoff / 1e6,
            "forward_ms": med(p["forward_ms"][warmup:]),
            "save_tail_ms": med([(r["t_pub"] - r["t0"]) / 1e6 for r in rounds]),
            "msg_us": med([(r["t_recv"] - r["t_pub"]) / 1e3 for r in rounds]),
            "post_to_done_ms": med([(r["t1"] - r["t_recv"]) / 1e6 for r in rounds]),
            "decode_ms": med([r["decode_s"] * 1e3 for r in rounds]),
            "polls": med([r["polls"] for r in rounds]),
            "exact": bool(c["check"].get("ok")), "check": c["check"]}


def read_row(name: str, model: str, tokens: int, dense: int, wire: int, warmup: int,
             rounds: list[dict[str, Any]], exact: bool | None) -> dict[str, Any]:
    """A dense anchor's READ."""
    rounds = rounds[warmup:]
    handoff = med([(r["t1"] - r["t0"]) / 1e6 for r in rounds])
    read = med([(r["done"] - r["posted"]) / 1e6 for r in rounds])
    return {"model": model, "tokens": tokens, "path": name, "kind": "anchor",
            "handoff_ms": handoff,
            "handoff_ms_min_max": [min((r["t1"] - r["t0"]) / 1e6 for r in rounds),
                                   max((r["t1"] - r["t0"]) / 1e6 for r in rounds)],
            "wire_bytes": wire, "dense_bytes": dense, "read_ms": read,
            "wire_gbs": wire / read / 1e6, "dense_eq_gbs": dense / handoff / 1e6,
            "msg_us": med([(r["t_recv"] - r["t0"]) / 1e3 for r in rounds]),
            "descs_after_merge": rounds[-1].get("descs_after_merge"), "exact": exact}


def case_rows(case: dict[str, Any], producer: dict[str, Any], consumer: dict[str, Any]
              ) -> list[dict[str, Any]]:
    """Every path both processes finished (all of them, unless the case was cut short);
    ``vs_a`` set where anchor (a) ran."""
    model, tokens, warmup = case["model_id"], case["tokens"], case["warmup"]
    dense, moved = case["dense_bytes"], case["block_bytes"]  # moved: whole blocks, dense
    done = [n for n in consumer.get("presets", {}) if n in producer.get("presets", {})]
    rows = [preset_row(name, model, tokens, dense, warmup, producer["presets"][name],
                       consumer["presets"][name]) for name in done]
    anchors = consumer.get("anchors") or {}
    if "a" in anchors:
        row = read_row("a:blocks", model, tokens, dense, moved, warmup, anchors["a"]["rounds"],
                       anchors["a"]["check"]["ok"])
        row["descriptors"] = anchors["descriptors_a"]
        rows.append(row)
    if anchors.get("b"):
        tried = [read_row(f"b:contig/{k}", model, tokens, dense, moved, warmup, v["rounds"],
                          None) | {"descriptors": int(k)} for k, v in anchors["b"].items()]
        best = min(tried, key=lambda r: r["handoff_ms"])
        rows.append(best | {"path": "b:contig", "tried": tried})
    a = next((r for r in rows if r["path"] == "a:blocks"), None)
    for r in rows:
        r["vs_a"] = a["handoff_ms"] / r["handoff_ms"] if a else None
    return rows


def fit(value: float | None, width: int, decimals: int) -> str:
    """``value`` in at most ``width`` characters (fewer decimals first)."""
    if value is None or value != value:
        return "-"
    for d in range(decimals, -1, -1):
        text = f"{value:.{d}f}"
        if len(text) <= width:
            return text
    return f"{value:.0e}"


def markdown_table(header: list[str], lines: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(cells) + " |" for cells in lines]
    return "\n".join(out)


def main_table(rows: list[dict[str, Any]]) -> str:
    """One case's paths (one geometry and length: the heading names them)."""
    lines = []
    for r in rows:
        exact = "-" if r["exact"] is None else ("yes" if r["exact"] else "NO")
        lines.append([r["path"], fit(r["handoff_ms"], 8, 2),
                      fit(r["wire_bytes"] / 1e6, 7, 1), fit(r["wire_gbs"], 6, 1),
                      fit(r["dense_eq_gbs"], 6, 1),
                      fit(r["vs_a"], 6, 2) + ("x" if r["vs_a"] else ""), exact])
    return markdown_table(TABLE, lines)


def parts_table(rows: list[dict[str, Any]]) -> str:
    """Where the connector's handoff goes: forward (start -> t0, saves included), the encode
    tail (t0 -> published), the pipe message, the load's READ and decode, polls per load."""
    lines = []
    for r in rows:
        if r["kind"] != "turbowire":
            continue
        lines.append([r["path"], fit(r["forward_ms"], 8, 1),
                      fit(r["save_tail_ms"], 7, 2), fit(r["msg_us"], 6, 0),
                      fit(r["read_ms"], 7, 2), fit(r["decode_ms"], 7, 2),
                      fit(r["polls"], 6, 0)])
    return markdown_table(PARTS, lines)
