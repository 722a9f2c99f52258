"""Tables (rich, 80 columns; Markdown), target checks and the plot of a retrieval run."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from turbowire.quality.retrieval import REFERENCE, RetrievalRun, Summary

#: the lossy presets issue 35's answer-NLL target is checked for (those at <= 4.4 bits/element;
#: which presets are recommended is `turbowire recommend`'s verdict, not this list)
NLL_TARGET_PRESETS = ("tq4", "k4v3", "k5v4", "k8v4")
NLL_TARGET_RATIO = 1.05
NLL_TARGET_BITS = 4.4


def short_name(name: str) -> str:
    """Method names that fit a narrow column (the vLLM rows stay marked as reproductions by
    the table's caption)."""
    if name == REFERENCE:
        return "exact (bf16)"
    name = name.replace("fp8 e4m3 (per-vector scale)", "fp8 e4m3")
    name = name.replace("turboquant_", "").replace(" (repro)", "")
    return re.sub(r" \+bf16 boundary (\d)\+\d", r"+b\1", name)


def _pct(x: float) -> str:
    return "-" if math.isnan(x) else f"{x * 100:.0f}%"


def _ci(s: Summary) -> str:
    lo, hi = s.ci
    return f"{lo * 100:.0f}-{hi * 100:.0f}"


def _ratio(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.3f}"


def _kl(s: Summary) -> str:
    return "0" if s.family == "reference" else f"{s.kl:.4f}"


@dataclass
class Table:
    title: str
    headers: list[str]
    rows: list[tuple[str, list[str]]]  # (family, cells)


def length_tables(run: RetrievalRun, wide: bool = False) -> list[Table]:
    """Per requested length: accuracy (Wilson 95% CI), per task, answer NLL ratio and KL
    (``wide``: with the NLL ratio's bootstrap interval, for Markdown)."""
    tasks = list(run.config.tasks)
    tables = []
    for length in run.config.lengths:
        headers = ["method", "b/e", "acc", "95% CI"]
        if len(tasks) > 1:
            headers += [{"passkey": "passkey", "multikey": "multi"}.get(t, t) for t in tasks]
        headers += ["NLL×"] + (["NLL× 95% CI"] if wide else []) + ["KL"]
        rows = []
        for method, family in run.methods():
            s = run.summarize(method, length=length)
            cells = [short_name(method), f"{s.bits_per_element:.2f}", _pct(s.accuracy), _ci(s)]
            if len(tasks) > 1:
                for task in tasks:
                    t = run.summarize(method, length=length, task=task)
                    cells.append(f"{t.correct}/{t.n}")
            cells.append(_ratio(s.nll_ratio))
            if wide:
                lo, hi = s.nll_ratio_ci
                cells.append("-" if math.isnan(lo) else f"{lo:.3f}-{hi:.3f}")
            cells.append(_kl(s))
            rows.append((family, cells))
        ref = run.summarize(REFERENCE, length=length)
        counts = ", ".join(f"{run.summarize(REFERENCE, length=length, task=t).n} {t}"
                           for t in tasks)
        tables.append(Table(
            f"Retrieval at {length} tokens (prompts of {ref.prompt_tokens:.0f} on average; "
            f"{ref.n} cases: {counts}); exact answer NLL {ref.nll:.3f}", headers, rows))
    return tables


def depth_table(run: RetrievalRun) -> Table:
    """Per needle depth, over every length and task: accuracy and answer NLL ratio."""
    headers = ["method"] + [f"{d}%" for d in run.config.depths]
    rows = []
    for method, family in run.methods():
        cells = [short_name(method)]
        for depth in run.config.depths:
            s = run.summarize(method, depth=depth)
            cells.append(f"{_pct(s.accuracy)} {s.nll_ratio:.2f}")
        rows.append((family, cells))
    n = run.summarize(REFERENCE, depth=run.config.depths[0]).n
    return Table(f"By needle depth (all lengths and tasks, {n} cases per cell): accuracy and "
                 "answer NLL ratio vs exact", headers, rows)


def tables(run: RetrievalRun, wide: bool = False) -> list[Table]:
    return [*length_tables(run, wide), depth_table(run)]


CAPTION = ("acc: exact retrieval of the number, greedy; 95% CI: Wilson interval (percent); "
           "NLL×: mean answer-token NLL over the exact KV's on the same cases (Markdown: with "
           "its paired bootstrap 95% interval); KL: "
           "KL(exact || method) on the answer tokens. vLLM rows: reproductions of its formats.")


def rich_tables(run: RetrievalRun) -> list:
    from rich.table import Table as RichTable

    out = []
    for t in tables(run):
        table = RichTable(title=t.title, title_justify="left")
        for h in t.headers:
            table.add_column(h, justify="left" if h == "method" else "right")
        for family, cells in t.rows:
            style = ("bold green" if family == "turbowire"
                     else ("dim" if family == "reference" else None))
            table.add_row(*cells, style=style)
        out.append(table)
    return out


def markdown(run: RetrievalRun, command: str | None = None) -> str:
    lines = []
    if command:
        lines += [f"`{command}`", ""]
    lines += [CAPTION, ""]
    for t in tables(run, wide=True):
        lines += [f"**{t.title}**", "", "| " + " | ".join(t.headers) + " |",
                  "|" + "---|" * len(t.headers)]
        lines += ["| " + " | ".join(cells) + " |" for _, cells in t.rows]
        lines.append("")
    checks = check_targets(run)
    if checks:
        lines += ["**Targets**", "", "| length | preset | b/e | answer NLL ratio | target |",
                  "|---|---|---|---|---|"]
        lines += [f"| {c.length} | {c.method} | {c.bits:.2f} | {c.ratio:.3f} | "
                  f"{'met' if c.met else '**not met**'} |" for c in checks]
        lines.append("")
    return "\n".join(lines)


@dataclass
class RetrievalTarget:
    length: int
    method: str
    bits: float
    ratio: float
    met: bool


def check_targets(run: RetrievalRun) -> list[RetrievalTarget]:
    """Answer-token NLL within 1.05x of the exact KV's for the target's presets at <= 4.4
    bits/element, per length."""
    out = []
    for length in run.config.lengths:
        for method, family in run.methods():
            if family != "turbowire" or method not in NLL_TARGET_PRESETS:
                continue
            s = run.summarize(method, length=length)
            if s.bits_per_element <= NLL_TARGET_BITS:
                out.append(RetrievalTarget(length, method, s.bits_per_element, s.nll_ratio,
                                           s.nll_ratio <= NLL_TARGET_RATIO))
    return out


def plot(run: RetrievalRun, path: Path) -> None:
    """Accuracy vs length, accuracy vs depth (Wilson 95% error bars) and answer NLL ratio vs
    length, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = run.methods()
    fig, axes = plt.subplots(1, 3, figsize=(16, 5.5))
    cmap = plt.get_cmap("tab10")
    styles = {"reference": "-", "turbowire": "-", "baseline": "--", "reproduction": ":"}
    lengths = list(run.config.lengths)
    depths = list(run.config.depths)
    spread = 0.25 / max(len(methods), 1)
    for i, (method, family) in enumerate(methods):
        color = "black" if family == "reference" else cmap((i - 1) % 10)
        kw = dict(color=color, ls=styles.get(family, "-"), marker="o", ms=4, capsize=2,
                  label=short_name(method), lw=2.2 if family == "reference" else 1.2)
        offset = (i - len(methods) / 2) * spread
        for ax, key, xs in ((axes[0], "length", lengths), (axes[1], "depth", depths)):
            sums = [run.summarize(method, **{key: x}) for x in xs]
            acc = [s.accuracy * 100 for s in sums]
            lo = [a - s.ci[0] * 100 for a, s in zip(acc, sums)]
            hi = [s.ci[1] * 100 - a for a, s in zip(acc, sums)]
            pos = [j + offset for j in range(len(xs))]
            ax.errorbar(pos, acc, yerr=[lo, hi], **kw)
        ratios = [run.summarize(method, length=x).nll_ratio for x in lengths]
        axes[2].plot(range(len(lengths)), ratios, color=color, ls=kw["ls"], marker="o", ms=4,
                     lw=kw["lw"])
    for ax, xs, label in ((axes[0], lengths, "prompt length (tokens)"),
                          (axes[1], [f"{d}%" for d in depths], "needle depth"),
                          (axes[2], lengths, "prompt length (tokens)")):
        ax.set_xticks(range(len(xs)), [str(x) for x in xs])
        ax.set_xlabel(label)
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("retrieval accuracy (%), Wilson 95% CI")
    axes[0].set_title("accuracy vs length (all depths, tasks)")
    axes[1].set_title("accuracy vs depth (all lengths, tasks)")
    axes[1].set_ylabel("retrieval accuracy (%)")
    axes[2].axhline(NLL_TARGET_RATIO, color="gray", lw=0.8, ls="--")
    axes[2].set_ylabel("answer NLL / exact KV's")
    axes[2].set_title("answer-token NLL ratio vs length")
    axes[0].legend(fontsize=7, ncol=2)
    tasks = "+".join(run.config.tasks)
    fig.suptitle(f"Long-context retrieval ({tasks}) through the KV codec, {run.model}, "
                 "P/D handoff (prompt KV compressed)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
