"""The recommended-configuration table: every preset's measured quality and speed in one place.

Nothing here measures: it reads what ``turbowire eval`` (quality and retrieval tasks),
``python -m bench.kernels_vs`` (H200) and ``python -m bench.cpu_codec --json`` wrote, so the
table (and README's preset guidance, generated from it) can only say what was measured. The
rule that decides a recommendation: a preset is recommended only where the retrieval run has
it, its accuracy over all the run's cases is at least the same run's exact KV's minus
``RETRIEVAL_SLACK_POINTS``, and at no prompt length does it lose cases the exact KV retrieves
significantly more often than it wins others (paired, one-sided sign test at ``LOSS_P``): a
preset that loses retrieval the exact KV has is never recommended.

A configuration row "<preset>+r<N>" is the preset with ``recompute_recent_tokens: N`` (the decode
engine computes the prompt's last N tokens instead of loading them), judged by the same rule on
the runs made with ``turbowire eval --recompute N`` (each against its own run's exact KV).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from turbowire.codec import Codec, list_presets

RETRIEVAL_SLACK_POINTS = 1.0  # issue 35's bar: exact KV's accuracy minus 1 point
LOSS_P = 0.05  # a length's paired losses are significant below this one-sided p-value
REFERENCE_FAMILY = "reference"
BITS_HEAD_DIM, BITS_HEADS, BITS_LAYERS = 128, 8, 32  # the geometry bits/element is quoted at
RECOMPUTE_METHOD = re.compile(r"^(?P<preset>\S+) \+recompute (?P<tokens>\d+)$")  # eval's names


@dataclass
class PresetRow:
    """What was measured about one preset (None: not measured)."""

    preset: str
    bits: float
    kl: dict[int, float] = field(default_factory=dict)  # prompt length -> mean KL
    top1: dict[int, float] = field(default_factory=dict)
    accuracy: dict[int, float] = field(default_factory=dict)  # prompt length -> retrieval %
    exact_accuracy: dict[int, float] = field(default_factory=dict)
    nll_ratio: dict[int, float] = field(default_factory=dict)
    # prompt length -> (cases the exact KV retrieved and the preset did not, the reverse)
    discordant: dict[int, tuple[int, int]] = field(default_factory=dict)
    pooled: tuple[float, float] | None = None  # accuracy over every case: preset, exact KV
    longest: int = 0  # the longest prompt the retrieval runs measured (with any method)
    h200_gbs: tuple[float, float] | None = None  # dense GB/s, encode and decode
    cpu_gbs: tuple[float, float] | None = None
    verdict: str = ""
    recommended: bool = False
    recompute: int = 0  # recompute_recent_tokens of this configuration (0: the preset alone)

    @property
    def ratio(self) -> float:
        return 16.0 / self.bits

    @property
    def label(self) -> str:
        """The table's short name: ``tq4``, or ``tq4+r64`` with a recomputed window."""
        return f"{self.preset}+r{self.recompute}" if self.recompute else self.preset

    @property
    def config(self) -> str:
        """What a user sets, as the verdicts name it."""
        if not self.recompute:
            return f"`{self.preset}`"
        return f"`{self.preset}` + `recompute_recent_tokens: {self.recompute}`"


def preset_bits(name: str) -> float:
    """Bits per element of a body layer's full 256-token chunk, every wire byte counted."""
    codec = Codec(name, BITS_HEAD_DIM, BITS_LAYERS, 256)
    layer = codec.preset.boundary_layers if codec.preset.boundary else 0
    return codec.bits_per_element(min(layer, BITS_LAYERS - 1), BITS_HEADS)


def _read(path: Path | None) -> Any:
    if path is None or not path.exists():
        return None
    return json.loads(path.read_text())


def _read_runs(paths: Path | Sequence[Path] | None) -> Any:
    """One retrieval run from several (``turbowire eval --task retrieval --json`` outputs):
    their cases pooled, a case (method, length, task, seed) measured by several taken from the
    last file that has it (a later run with more cases repeats the earlier one's seeds)."""
    if paths is None or isinstance(paths, Path):
        return _read(paths)
    cases: dict[tuple[Any, ...], dict] = {}
    found = False
    for data in map(_read, paths):
        if data is None:
            continue
        found = True
        for c in data.get("results", []):
            cases[(c.get("method"), c.get("length"), c.get("task"), c.get("seed"))] = c
    return {"results": list(cases.values())} if found else None


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


def _quality(rows: dict[str, PresetRow], data: Any) -> None:
    for r in (data or {}).get("results", []):
        row = rows.get(r.get("name"))
        if row is not None and r.get("kl"):
            row.kl[int(r["prompt_len"])] = _mean(r["kl"])
            row.top1[int(r["prompt_len"])] = _mean(r["top1"])


def _retrieval(rows: dict[str, PresetRow], data: Any) -> None:
    cases = (data or {}).get("results", [])
    exact: dict[int, list[bool]] = {}
    exact_nll: dict[tuple[int, str], float] = {}
    exact_ok: dict[tuple[int, str], bool] = {}
    for c in cases:
        if c.get("family") == REFERENCE_FAMILY:
            exact.setdefault(int(c["length"]), []).append(bool(c["correct"]))
            exact_nll[(int(c["length"]), c["seed"])] = float(c["nll"])
            exact_ok[(int(c["length"]), c["seed"])] = bool(c["correct"])
    per: dict[tuple[str, int], list[dict]] = {}
    for c in cases:
        if c.get("method") in rows:
            per.setdefault((c["method"], int(c["length"])), []).append(c)
    for (name, length), cs in per.items():
        row = rows[name]
        row.accuracy[length] = 100.0 * _mean([float(c["correct"]) for c in cs])
        row.exact_accuracy[length] = 100.0 * _mean([float(x) for x in exact.get(length, [])])
        pairs = [(float(c["nll"]), exact_nll[(length, c["seed"])]) for c in cs
                 if (length, c["seed"]) in exact_nll]
        if pairs:
            row.nll_ratio[length] = (sum(a for a, _ in pairs)
                                     / max(sum(b for _, b in pairs), 1e-12))
        paired = [(exact_ok[(length, c["seed"])], bool(c["correct"])) for c in cs
                  if (length, c["seed"]) in exact_ok]
        row.discordant[length] = (sum(e and not m for e, m in paired),
                                  sum(m and not e for e, m in paired))
    for name, row in rows.items():
        row.longest = max(exact, default=0)
        mine = [c for c in cases if c.get("method") == name]
        if mine:
            both = [(exact_ok[k], bool(c["correct"])) for c in mine
                    if (k := (int(c["length"]), c["seed"])) in exact_ok]
            row.pooled = (100.0 * _mean([float(m) for _, m in both]),
                          100.0 * _mean([float(e) for e, _ in both]))


def sign_test_p(losses: int, wins: int) -> float:
    """One-sided exact sign test: P(at least ``losses`` of the discordant pairs go against the
    preset) if each went either way with probability 1/2."""
    n = losses + wins
    return sum(math.comb(n, k) for k in range(losses, n + 1)) / 2 ** n if n else 1.0


def _h200(rows: dict[str, PresetRow], data: Any) -> None:
    for r in data or []:
        row = rows.get(r.get("preset"))
        if row is not None and r.get("chunk") == 256 and r.get("dense_bytes"):
            gb = r["dense_bytes"] / 1e9
            row.h200_gbs = (gb / (r["encode_ms"] / 1e3), gb / (r["decode_ms"] / 1e3))


def _cpu(rows: dict[str, PresetRow], data: Any) -> None:
    for r in (data or {}).get("per_layer", []):
        row = rows.get(r.get("preset"))
        if row is not None and r.get("head_dim") == BITS_HEAD_DIM and r.get("layout") == "packed":
            row.cpu_gbs = (r["c_encode_elements_per_s"] * 2 / 1e9,
                           r["c_decode_elements_per_s"] * 2 / 1e9)


def _judge(row: PresetRow) -> None:
    if row.preset == "raw":
        row.verdict = "lossless (bf16 in the container): the reference, no compression"
        return
    if not row.accuracy:
        row.verdict = "retrieval not measured: not recommended"
        return
    assert row.pooled is not None
    if max(row.accuracy) < row.longest:
        row.verdict = (f"retrieval measured only up to {max(row.accuracy)} tokens, not "
                       f"{row.longest}: not recommended")
        return
    acc, exact = row.pooled
    if acc < exact - RETRIEVAL_SLACK_POINTS:
        row.verdict = (f"loses retrieval the exact KV has ({acc:.1f}% vs {exact:.1f}% over "
                       "every case): not recommended")
        return
    for n, (lost, won) in sorted(row.discordant.items()):
        if sign_test_p(lost, won) < LOSS_P:
            row.verdict = (f"loses retrieval the exact KV has at {n} tokens ({lost} cases lost, "
                           f"{won} won): not recommended")
            return
    row.recommended = True
    row.verdict = (f"retrieval {acc:.1f}% vs the exact KV's {exact:.1f}% over every case up to "
                   f"{max(row.accuracy)} tokens, no length with significant losses")


def _recompute_rows(base: dict[str, PresetRow], *runs: Any) -> dict[str, PresetRow]:
    """A row per "<preset> +recompute N" method the recompute runs measured, keyed by that name;
    the codec's speed is the preset's (the window changes what is sent, not how)."""
    rows: dict[str, PresetRow] = {}
    for data in runs:
        for r in (data or {}).get("results", []):
            name = r.get("name") or r.get("method") or ""
            m = RECOMPUTE_METHOD.match(name)
            if m and m["preset"] in base and name not in rows:
                b = base[m["preset"]]
                rows[name] = PresetRow(b.preset, b.bits, h200_gbs=b.h200_gbs, cpu_gbs=b.cpu_gbs,
                                       recompute=int(m["tokens"]))
    return rows


def build(quality: Path | None, retrieval: Path | Sequence[Path] | None, h200: Path | None,
          cpu: Path | None, presets: list[str] | None = None,
          recompute_quality: Path | None = None,
          recompute_retrieval: Path | Sequence[Path] | None = None) -> list[PresetRow]:
    """One row per preset from whichever result files exist (missing ones leave gaps), then one
    per preset + recomputed window that the recompute runs measured. Several retrieval files
    are pooled (``_read_runs``)."""
    rows = {p: PresetRow(p, preset_bits(p)) for p in (presets or list_presets())}
    _quality(rows, _read(quality))
    _retrieval(rows, _read_runs(retrieval))
    _h200(rows, _read(h200))
    _cpu(rows, _read(cpu))
    rq, rr = _read(recompute_quality), _read_runs(recompute_retrieval)
    windowed = _recompute_rows(rows, rq, rr)
    _quality(windowed, rq)
    _retrieval(windowed, rr)
    every = [*rows.values(), *windowed.values()]
    for row in every:
        _judge(row)
    return sorted(every, key=lambda r: (-r.bits, r.recompute))


def use_when(row: PresetRow) -> str:
    """Which deployments the preset fits, from its bits and verdict."""
    if not row.recommended:
        return "-"
    if row.recompute:
        return "next-token fidelity first at the preset's ratio; D computes the window"
    if row.bits >= 6:
        return "accuracy first; links fast enough for ~2.5x"
    if row.bits >= 4:
        return "the default: ~4x less to move, quality of the exact KV"
    return "slow links; check your model with turbowire eval"


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def table_rows(rows: list[PresetRow]) -> list[list[str]]:
    """Cells of the summary table (fits 80 columns as a rich table)."""
    out = []
    for r in rows:
        kl_len = max(r.kl) if r.kl else None
        acc_len = max(r.accuracy) if r.accuracy else None
        out.append([
            r.label, f"{r.bits:.2f}", f"{r.ratio:.2f}x",
            _fmt(r.kl.get(kl_len) if kl_len else None, ".4f"),
            _fmt(r.top1.get(kl_len) * 100 if kl_len else None, ".1f"),
            f"{r.pooled[0]:.0f}/{r.pooled[1]:.0f}" if r.pooled else "-",
            _fmt(r.nll_ratio.get(acc_len) if acc_len else None, ".2f"),
            "/".join(f"{x / 1e3:.2f}" for x in r.h200_gbs) if r.h200_gbs else "-",
            "/".join(f"{x:.2f}" for x in r.cpu_gbs) if r.cpu_gbs else "-",
            "yes" if r.recommended else "no",
        ])
    return out


HEAD = ["preset", "b/e", "ratio", "KL", "top1", "acc/ex", "NLL×", "H200 TB/s", "CPU GB/s",
        "rec"]


def source_labels(paths: dict[str, Any], root: Path = Path()) -> dict[str, str]:
    """Markdown's "Sources" of each input: its files (a path or a list of paths, relative to
    ``root``) that exist, in backquotes, pooled runs joined by " + "."""
    out = {}
    for key, value in paths.items():
        found = [f"`{p}`" for p in (value if isinstance(value, list) else [value])
                 if (root / p).exists()]
        if found:
            out[key] = " + ".join(found)
    return out


def markdown(rows: list[PresetRow], sources: dict[str, str]) -> str:
    """The table and each preset's verdict, as README's preset guidance shows them."""
    lines = ["| " + " | ".join(HEAD + ["use when"]) + " |",
             "|" + "---|" * (len(HEAD) + 1)]
    for r, cells in zip(rows, table_rows(rows)):
        lines.append("| " + " | ".join(cells + [use_when(r)]) + " |")
    lines += ["", "Why each verdict:", ""]
    lines += [f"- {r.config}: {r.verdict}." for r in rows]
    lines += ["", "Columns: b/e = bits per element at hd128, 8 KV heads, 256-token chunks, every "
              "wire byte counted; KL and top-1 at the longest prompt of the quality run; acc/exact "
              "= retrieval accuracy (%) of the preset / of the exact KV over every case of the "
              "retrieval run; NLL× = answer-token NLL over the exact KV's at its longest "
              "prompt; dense bf16 bytes "
              "per second, encode/decode (H200 in TB/s: Llama-3.1-8B 4k slice; CPU in GB/s: one "
              "core, hd128). `+rN`: the preset with `recompute_recent_tokens: N`, measured by the "
              "runs with a recomputed window (KL and top-1 at their longest prompt, retrieval "
              "against their own exact KV); its b/e and speed are the preset's, per token sent "
              "(the window's N tokens are not sent). Sources: "
              + "; ".join(f"{k} {v if v.startswith('`') else f'`{v}`'}"
                          for k, v in sources.items()) + "."]
    return "\n".join(lines) + "\n"
