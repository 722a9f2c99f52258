"""The quality targets of the codec issue, checked against one run's results.

Each target compares turbowire presets with a baseline measured in the same run, per prompt length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from turbowire.quality.harness import MethodResult


@dataclass
class TargetCheck:
    prompt_len: int
    description: str
    best: str | None
    detail: str
    met: bool


def _find(results: Sequence[MethodResult], plen: int, name: str) -> MethodResult | None:
    return next((r for r in results if r.prompt_len == plen and r.name == name), None)


def check_targets(results: Sequence[MethodResult]) -> list[TargetCheck]:
    checks: list[TargetCheck] = []
    for plen in sorted({r.prompt_len for r in results}):
        ours = [r for r in results if r.prompt_len == plen and r.family == "turbowire"]
        vllm4 = _find(results, plen, "vLLM turboquant_4bit_nc (repro)")
        vllm3 = _find(results, plen, "vLLM turboquant_3bit_nc (repro)")
        kivi4 = _find(results, plen, "KIVI-4")
        specs = []
        if vllm4:
            specs.append((4.4, 0.6 * vllm4.kl_mean,
                          f"<= 4.4 b/e: KL <= 0.6x vLLM 4bit_nc ({vllm4.kl_mean:.4f})"))
        if kivi4:
            specs.append((5.0, kivi4.kl_mean, f"<= 5.0 b/e: KL <= KIVI-4 ({kivi4.kl_mean:.4f})"))
        if vllm3:
            specs.append((3.4, 0.6 * vllm3.kl_mean,
                          f"<= 3.4 b/e: KL <= 0.6x vLLM 3bit_nc ({vllm3.kl_mean:.4f})"))
        for max_bpe, max_kl, text in specs:
            fits = [r for r in ours if r.bits_per_element <= max_bpe]
            best = min(fits, key=lambda r: r.kl_mean) if fits else None
            met = best is not None and best.kl_mean <= max_kl
            detail = (f"{best.name}: {best.bits_per_element:.3f} b/e, KL {best.kl_mean:.4f} "
                      f"± {best.kl_ci95:.4f}" if best else "no preset that small")
            checks.append(TargetCheck(plen, text, best.name if best else None, detail, met))
        fits = [r for r in ours if r.ratio >= 4.5]
        best = max(fits, key=lambda r: r.top1_mean) if fits else None
        met = best is not None and best.top1_mean >= 0.95
        detail = (f"{best.name}: {best.ratio:.2f}x, top-1 {best.top1_mean * 100:.1f}%" if best
                  else "no preset at >= 4.5x")
        checks.append(TargetCheck(plen, ">= 4.5x ratio with top-1 >= 95%",
                                  best.name if best else None, detail, met))
    return checks
