"""Tables (rich and Markdown) and the KL-vs-bits plot of a quality evaluation."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from turbowire.quality.harness import MethodResult


def _ppl_delta(r: MethodResult, ref: MethodResult) -> float:
    return (r.ppl / ref.ppl - 1.0) * 100.0


def rows(results: Sequence[MethodResult]) -> list[tuple[int, list[str]]]:
    """(prompt length, formatted row) in result order; the reference first per length."""
    out: list[tuple[int, list[str]]] = []
    refs = {r.prompt_len: r for r in results if r.family == "reference"}
    for r in results:
        ref = refs[r.prompt_len]
        out.append((r.prompt_len, [
            r.name, r.family, f"{r.bits_per_element:.3f}", f"{r.ratio:.2f}x",
            f"{r.kl_mean:.4f} ± {r.kl_ci95:.4f}" if r.family != "reference" else "0",
            f"{r.top1_mean * 100:.1f}%", f"{r.ppl:.3f}", f"{_ppl_delta(r, ref):+.2f}%",
        ]))
    return out


HEADERS = ["method", "kind", "bits/elem", "ratio", "KL (95% CI)", "top-1", "PPL", "ΔPPL"]


def markdown(results: Sequence[MethodResult]) -> str:
    lines = []
    current = None
    for plen, row in rows(results):
        if plen != current:
            current = plen
            n = next(len(r.kl) for r in results if r.prompt_len == plen)
            lines += ["", f"**Prompt length {plen}** ({n} windows)", "",
                      "| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines).strip() + "\n"


def rich_tables(results: Sequence[MethodResult]) -> list:
    from rich.table import Table

    tables = []
    current = None
    table = None
    for plen, row in rows(results):
        if plen != current:
            current = plen
            table = Table(title=f"P/D handoff quality, prompt length {plen}", title_justify="left")
            for h in HEADERS:
                table.add_column(h, justify="left" if h in ("method", "kind") else "right")
            tables.append(table)
        assert table is not None
        style = (
            "bold green" if row[1] == "turbowire" else ("dim" if row[1] == "reference" else None)
        )
        table.add_row(*row, style=style)
    return tables


def plot(results: Sequence[MethodResult], path: Path) -> None:
    """KL vs bits/element, one marker per method and prompt length (log KL axis)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 6))
    colors = {"turbowire": "tab:green", "baseline": "tab:blue", "reproduction": "tab:red"}
    markers = {}
    for i, plen in enumerate(sorted({r.prompt_len for r in results})):
        markers[plen] = "o^sD"[i % 4]
    for r in results:
        if r.family == "reference" or r.kl_mean <= 0:
            continue
        ax.errorbar(r.bits_per_element, r.kl_mean, yerr=r.kl_ci95, fmt=markers[r.prompt_len],
                    color=colors.get(r.family, "gray"), alpha=0.8, capsize=2)
        if r.prompt_len == min(markers):
            ax.annotate(r.name.replace(" (repro)", ""), (r.bits_per_element, r.kl_mean),
                        fontsize=6, xytext=(3, 3), textcoords="offset points")
    ax.set_yscale("log")
    ax.set_xlabel("bits per KV element (all metadata counted)")
    ax.set_ylabel("mean KL(ref || test) over continuation tokens")
    ax.set_title("KV codec quality on SmolLM2-135M-Instruct (P/D handoff)")
    handles = [plt.Line2D([], [], color=c, marker="o", ls="", label=f) for f, c in colors.items()]
    handles += [plt.Line2D([], [], color="k", marker=m, ls="", label=f"P={p}")
                for p, m in markers.items()]
    ax.legend(handles=handles, fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
