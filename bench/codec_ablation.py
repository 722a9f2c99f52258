"""Why the codec looks the way it does: ablations on the real model, one run, side by side.

Each row changes one thing against its neighbours (same windows, same process):
- keys (values exact): plain rotated Lloyd-Max (TurboQuant+ with sign tables), + chunk mean,
  + sink row, both (turbowire), vLLM's unsigned Hadamard key, KIVI per-channel keys;
- values (keys exact): rotated Lloyd-Max vs per-vector uniform min/max at 4 and 3 bits, + sink;
- boundary layers: tq3 against tq3 with its first/last 2 layers at tq4;
- head_dim 256: one 256-point rotation vs two 128-point groups (synthetic, relative MSE).

    python -m bench.codec_ablation --windows 16 --prompt-len 512
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from turbowire.codec.presets import RAW, LayerPolicy, Preset
from turbowire.codec.streams import StreamSpec, lloyd_dequantize, lloyd_quantize
from turbowire.quality.harness import EvalConfig, ModelUnderTest, evaluate
from turbowire.quality.methods import (
    CodecMethod,
    SimulatedMethod,
    uniform_per_channel,
    uniform_per_vector,
    vllm_lloyd_key,
)


def k_spec(bits: int, center: bool, sink: int) -> StreamSpec:
    return StreamSpec("lloyd", bits=bits, center=center, sink_tokens=sink)


def exact(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    return x, x.numel() * 2


def methods(mut: ModelUnderTest) -> list:
    d, n = mut.head_dim, mut.num_layers

    def preset(
        name: str, k: StreamSpec, v: StreamSpec, boundary: LayerPolicy | None = None
    ) -> CodecMethod:
        p = Preset(name, 2, name, LayerPolicy(k, v), boundary, 2 if boundary else 0)
        return CodecMethod(p, d, n)

    out = [
        preset("K: LM4 (rotation+signs)", k_spec(4, False, 0), RAW),
        preset("K: LM4 + chunk mean", k_spec(4, True, 0), RAW),
        preset("K: LM4 + sink", k_spec(4, False, 1), RAW),
        preset("K: LM4 + mean + sink (turbowire)", k_spec(4, True, 1), RAW),
        preset("K: LM3 + mean + sink (turbowire)", k_spec(3, True, 1), RAW),
        SimulatedMethod("K: vLLM 4-bit (no signs) (repro)", "reproduction",
                        lambda k: vllm_lloyd_key(k, 4), exact, n),
        SimulatedMethod("K: vLLM 3-bit (no signs) (repro)", "reproduction",
                        lambda k: vllm_lloyd_key(k, 3), exact, n),
        SimulatedMethod("K: KIVI-4 per-channel G32", "baseline",
                        lambda k: uniform_per_channel(k, 4, 32), exact, n),
        preset("V: LM4", RAW, StreamSpec("lloyd", bits=4)),
        SimulatedMethod("V: uniform-4 per vector", "baseline", exact,
                        lambda v: uniform_per_vector(v, 4), n),
        preset("V: LM3", RAW, StreamSpec("lloyd", bits=3)),
        SimulatedMethod("V: uniform-3 per vector", "baseline", exact,
                        lambda v: uniform_per_vector(v, 3), n),
        preset("V: LM3 + sink (turbowire)", RAW, StreamSpec("lloyd", bits=3, sink_tokens=1)),
        preset("V: LM3 + mean + sink", RAW,
               StreamSpec("lloyd", bits=3, center=True, sink_tokens=1)),
        preset("tq3", k_spec(3, True, 1), StreamSpec("lloyd", bits=3, sink_tokens=1)),
        preset("tq3 + first/last 2 layers tq4", k_spec(3, True, 1),
               StreamSpec("lloyd", bits=3, sink_tokens=1),
               LayerPolicy(k_spec(4, True, 1), StreamSpec("lloyd", bits=4, sink_tokens=1))),
    ]
    for m in out:
        if isinstance(m, CodecMethod):
            m.family = (
                "turbowire" if "turbowire" in m.name or m.name.startswith("tq3") else "ablation"
            )
    return out


def head_dim_256_table(samples: int = 20000) -> list[tuple[str, int, float, float]]:
    """Relative MSE of one 256-point rotation vs two 128-point groups (each with its own scale)."""
    torch.manual_seed(0)

    def q(x: torch.Tensor, bits: int) -> torch.Tensor:
        groups = [(bits, x.shape[-1])]
        codes, s = lloyd_quantize(x, groups)
        return lloyd_dequantize(codes, s, groups)

    cases = {"gaussian": torch.randn(samples, 256)}
    x = torch.randn(samples, 256)
    x[:, [3, 77, 130, 200]] *= 20
    cases["4 outlier channels x20"] = x
    x = torch.randn(samples, 256)
    x[:, :128] *= 4
    cases["halves at 4x scale"] = x
    rows = []
    for name, x in cases.items():
        for bits in (4, 3):
            one = float(((q(x, bits) - x) ** 2).sum() / (x**2).sum())
            two = q(x.reshape(samples, 2, 128), bits).reshape(samples, 256)
            rows.append((name, bits, one, float(((two - x) ** 2).sum() / (x**2).sum())))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    from rich.console import Console
    from rich.table import Table

    console = Console()
    t = Table(title="head_dim 256: one rotation vs two 128-groups (relative MSE)")
    for c in ["data", "bits", "one 256 (+16/256 b/e)", "two 128 (+32/256 b/e)"]:
        t.add_column(c)
    for name, bits, one, two in head_dim_256_table():
        t.add_row(name, str(bits), f"{one:.5f}", f"{two:.5f}")
    console.print(t)

    mut = ModelUnderTest()
    start = time.time()
    results = evaluate(methods(mut),
                       EvalConfig(prompt_lengths=(args.prompt_len,), windows=args.windows,
                                  threads=args.threads), mut,
                       progress=lambda s, a, b: print(
                           f"{s} window {a}/{b} {time.time() - start:.0f}s", file=sys.stderr))
    t = Table(title=f"ablations, P={args.prompt_len}, {args.windows} windows")
    for c in ["method", "bits/elem", "KL (95% CI)", "top-1"]:
        t.add_column(c)
    for r in results:
        t.add_row(r.name, f"{r.bits_per_element:.3f}", f"{r.kl_mean:.5f} ± {r.kl_ci95:.5f}",
                  f"{r.top1_mean * 100:.1f}%")
    console.print(t)


if __name__ == "__main__":
    main()
