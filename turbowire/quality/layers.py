"""Per-layer sensitivity (``eval --task layers``): KL when only layer i's prompt KV goes through a
preset, every other layer exact, measured as the quality task measures (corpus windows, KL of the
continuation's next-token distributions against the exact run's, averaged over tokens and windows).

From the sweep, the boundary-layer policy in the codec's terms (``Preset.boundary`` applies to
the first and last ``Preset.boundary_layers`` layers): ``b`` grows while the next pair of boundary
layers (layer b and layer L-1-b) carries at least twice its even share of the summed single-layer KL
(2 x 2/L). Layers at least twice as sensitive as the average layer that such a boundary does not
cover are listed apart: a first/last-b policy cannot reach them.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch

from turbowire.quality.harness import KV, ModelUnderTest, kv_cache, prefill_kv
from turbowire.quality.methods import KVMethod

#: a boundary pair is worth a higher-precision policy when it carries this many times its even share
HOT_FACTOR = 2.0


@dataclass
class LayersConfig:
    prompt_len: int = 1024
    windows: int = 4
    continuation: int = 32
    threads: int = 2
    layers: Sequence[int] | None = None  # None: every layer

    def __post_init__(self) -> None:
        if self.windows < 1:
            raise ValueError("windows must be >= 1")
        if self.continuation < 1:
            raise ValueError("continuation must be >= 1 token")
        if self.prompt_len < 16:
            raise ValueError("the prompt length must be >= 16 tokens")


@dataclass
class LayerSweep:
    model: str
    num_layers: int
    config: LayersConfig
    layers: list[int]
    #: preset -> layer -> KL per window (only that layer compressed)
    kl: dict[str, dict[int, list[float]]] = field(default_factory=dict)
    #: preset -> KL per window with every layer compressed
    all_layers: dict[str, list[float]] = field(default_factory=dict)

    def mean(self, preset: str, layer: int) -> float:
        values = self.kl[preset][layer]
        return sum(values) / len(values)

    def all_mean(self, preset: str) -> float:
        values = self.all_layers[preset]
        return sum(values) / len(values)

    def to_json(self) -> dict:
        return {"model": self.model, "num_layers": self.num_layers, "config": asdict(self.config),
                "layers": self.layers, "kl": self.kl, "all_layers": self.all_layers}

    @classmethod
    def from_json(cls, data: dict) -> "LayerSweep":
        """The sweep :meth:`to_json` wrote (JSON turns the layer keys into strings)."""
        return cls(
            model=data["model"], num_layers=int(data["num_layers"]),
            config=LayersConfig(**data["config"]), layers=[int(i) for i in data["layers"]],
            kl={p: {int(i): list(v) for i, v in per.items()} for p, per in data["kl"].items()},
            all_layers={p: list(v) for p, v in data["all_layers"].items()},
        )


@torch.inference_mode()
def evaluate_layers(
    methods: Sequence[KVMethod],
    config: LayersConfig,
    mut: ModelUnderTest | None = None,
    progress: Callable[[str, int, int], None] | None = None,
) -> LayerSweep:
    torch.set_num_threads(config.threads)
    mut = mut or ModelUnderTest()
    layer_ids = list(config.layers) if config.layers is not None else list(range(mut.num_layers))
    if any(not 0 <= i < mut.num_layers for i in layer_ids):
        raise ValueError(f"layers must be within 0..{mut.num_layers - 1}")
    sweep = LayerSweep(mut.name, mut.num_layers, config, layer_ids)
    for m in methods:
        sweep.kl[m.name] = {i: [] for i in layer_ids}
        sweep.all_layers[m.name] = []
    total = config.windows * len(methods) * (len(layer_ids) + 1)
    done = 0
    plen = config.prompt_len
    for w, window in enumerate(mut.windows(plen, config.continuation, config.windows)):
        prompt, cont = window[:plen], window[plen:][None]
        exact = prefill_kv(mut, prompt)

        def logprobs(kv: KV) -> torch.Tensor:
            logits = mut.model(cont, past_key_values=kv_cache(kv)).logits[0]
            return torch.log_softmax(logits.to(torch.float32), dim=-1)

        def kl(ref: torch.Tensor, test: torch.Tensor) -> float:
            return float((ref.exp() * (ref - test)).sum(-1).mean())

        ref = logprobs(exact)
        for method in methods:
            recon = [method.apply(i, k, v)[:2] for i, (k, v) in enumerate(exact)]
            for i in layer_ids:
                if progress:
                    progress(f"window {w + 1}/{config.windows} {method.name} layer {i}", done,
                             total)
                kv = list(exact)
                kv[i] = recon[i]
                sweep.kl[method.name][i].append(kl(ref, logprobs(kv)))
                done += 1
            sweep.all_layers[method.name].append(kl(ref, logprobs(recon)))
            done += 1
    if progress:
        progress("done", done, total)
    return sweep


# ---- the policy -------------------------------------------------------------------------------
@dataclass
class BoundaryAdvice:
    preset: str
    boundary_layers: int  # suggested Preset.boundary_layers
    pair_shares: list[float]  # share of summed KL of pair b (layer b and layer L-1-b), b = 0..
    boundary_share: float  # share of summed KL in the suggested boundary layers
    top: list[tuple[int, float]]  # the most sensitive layers and their shares
    outside: list[int]  # hot layers (>= HOT_FACTOR x even share) the boundary does not cover
    additivity: float  # summed single-layer KL / KL with every layer compressed


def advise(sweep: LayerSweep, preset: str) -> BoundaryAdvice:
    n = sweep.num_layers
    kl = {i: max(sweep.mean(preset, i), 0.0) for i in sweep.layers}
    total = sum(kl.values()) or math.nan
    share = {i: kl[i] / total for i in kl}
    pairs = []
    for b in range(n // 2):
        members = {b, n - 1 - b}
        if not members <= set(kl):
            break
        pairs.append(sum(share[i] for i in members))
    b = 0
    while b < len(pairs) and b < n // 4 and pairs[b] >= HOT_FACTOR * 2 / n:
        b += 1
    covered = set(range(b)) | set(range(n - b, n))
    top = sorted(share.items(), key=lambda kv: -kv[1])[:5]
    outside = sorted(i for i, s in share.items() if s >= HOT_FACTOR / n and i not in covered)
    whole = sweep.all_mean(preset)
    return BoundaryAdvice(
        preset=preset, boundary_layers=b, pair_shares=pairs,
        boundary_share=sum(share[i] for i in covered if i in share), top=top, outside=outside,
        additivity=sum(kl.values()) / whole if whole > 0 else math.nan,
    )


def policy_lines(sweep: LayerSweep) -> list[str]:
    """The derived boundary-layer policy, one line per preset and a conclusion."""
    n = sweep.num_layers
    lines = []
    advice = [advise(sweep, p) for p in sweep.kl]
    for a in advice:
        top = ", ".join(f"{i} ({s * 100:.0f}%)" for i, s in a.top)
        pairs = " ".join(f"{s * 100:.0f}%" for s in a.pair_shares[:3])
        text = (f"{a.preset}: most sensitive layers {top}; pairs (0,{n - 1}) (1,{n - 2}) "
                f"(2,{n - 3}) carry {pairs} of the summed KL (even share {200 / n:.1f}%); "
                f"suggested boundary_layers={a.boundary_layers}")
        if a.boundary_layers:
            text += f" (covering {a.boundary_share * 100:.0f}% of the summed KL)"
        if a.outside:
            text += f"; hot layers a boundary cannot cover: {', '.join(map(str, a.outside))}"
        text += f"; summed single-layer KL = {a.additivity:.2f}x the all-layers KL"
        lines.append(text)
    if advice:
        b = max(a.boundary_layers for a in advice)
        votes = Counter(i for a in advice for i in a.outside)
        common = sorted((i for i, c in votes.items() if 2 * c >= len(advice)),
                        key=lambda i: (-votes[i], i))
        if b == 0:
            lines.append(
                "policy: no boundary pair carries twice its even share for any preset: keep "
                "Preset.boundary=None (every layer at the body policy)")
        else:
            first = ", ".join(map(str, range(b)))
            last = ", ".join(map(str, range(n - b, n)))
            lines.append(
                f"policy: Preset.boundary_layers={b} (layers {first} and {last}) with a "
                "higher-precision Preset.boundary (e.g. the next preset up) where the bytes allow; "
                f"it costs 2x{b}/{n} of the layers at the boundary's bits")
        if common:
            listed = ", ".join(f"{i} ({votes[i]}/{len(advice)})" for i in common)
            lines.append(
                f"sensitive for at least half the presets and outside any boundary: layers "
                f"{listed}; only a per-layer policy (not first/last boundary_layers) would "
                "reach them")
    return lines


# ---- report -----------------------------------------------------------------------------------
#: presets per console table (80 columns)
TABLE_PRESETS = 7


def table_rows(sweep: LayerSweep, presets: Sequence[str] | None = None
               ) -> tuple[list[str], list[list[str]]]:
    """Rows of KL x 1e3 per layer and preset; layers of the suggested boundary marked ``*``."""
    presets = list(presets or sweep.kl)
    b = max((advise(sweep, p).boundary_layers for p in sweep.kl), default=0)
    n = sweep.num_layers
    headers = ["layer"] + presets
    rows = []
    for i in sweep.layers:
        mark = "*" if i < b or i >= n - b else ""
        rows.append([f"{i}{mark}"] + [f"{sweep.mean(p, i) * 1e3:.3f}" for p in presets])
    rows.append(["sum"] + [f"{sum(sweep.mean(p, i) for i in sweep.layers) * 1e3:.3f}"
                           for p in presets])
    rows.append(["all"] + [f"{sweep.all_mean(p) * 1e3:.3f}" for p in presets])
    return headers, rows


def title(sweep: LayerSweep) -> str:
    c = sweep.config
    return (f"KL x 1e3 with only one layer compressed (P={c.prompt_len}, {c.windows} windows, "
            f"{c.continuation} tokens); sum: of the rows; all: every layer compressed")


def rich_tables(sweep: LayerSweep) -> list:
    """The table in 80 columns: at most ``TABLE_PRESETS`` presets per table."""
    from rich.table import Table

    names = list(sweep.kl)
    tables = []
    for start in range(0, len(names), TABLE_PRESETS):
        headers, rows = table_rows(sweep, names[start : start + TABLE_PRESETS])
        table = Table(title=title(sweep) if start == 0 else None, title_justify="left")
        for h in headers:
            table.add_column(h, justify="left" if h == "layer" else "right")
        for row in rows:
            table.add_row(*row, style="bold" if row[0] in ("sum", "all") else None)
        tables.append(table)
    return tables


def markdown(sweep: LayerSweep, command: str | None = None) -> str:
    headers, rows = table_rows(sweep)
    lines = [f"`{command}`", ""] if command else []
    lines += [f"**{title(sweep)}**", "", "| " + " | ".join(headers) + " |",
              "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    lines += ["", "Derived policy (`*`: the suggested boundary layers):", ""]
    lines += [f"- {line}" for line in policy_lines(sweep)]
    return "\n".join(lines) + "\n"


def plot(sweep: LayerSweep, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 5.5))
    for p in sweep.kl:
        ys = [max(sweep.mean(p, i), 1e-9) for i in sweep.layers]
        ax.plot(sweep.layers, ys, marker="o", ms=3, label=p)
    b = max((advise(sweep, p).boundary_layers for p in sweep.kl), default=0)
    n = sweep.num_layers
    if b:
        ax.axvspan(-0.5, b - 0.5, color="gray", alpha=0.15, label=f"boundary_layers={b}")
        ax.axvspan(n - b - 0.5, n - 0.5, color="gray", alpha=0.15)
    ax.set_yscale("log")
    ax.set_xlabel("layer compressed (all others exact)")
    ax.set_ylabel("mean KL(exact || test) over continuation tokens")
    c = sweep.config
    ax.set_title(f"Per-layer sensitivity, {sweep.model} (P={c.prompt_len}, {c.windows} windows)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
