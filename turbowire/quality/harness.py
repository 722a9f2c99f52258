"""Run KV methods on prompt windows of the bundled corpus and measure the damage.

For each window of P prompt tokens followed by C continuation tokens: the model computes the
prompt's KV cache (fp32 compute, K/V rounded to bf16 as a vLLM cache holds them); each method
replaces every layer's KV with its reconstruction; the continuation is run against it and its
logits compared with the exact run's: KL(ref || test) averaged over continuation tokens, top-1
agreement, and perplexity of the true continuation.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from turbowire.quality.corpus import load_corpus
from turbowire.quality.methods import KVMethod, RecomputedTailMethod

logger = logging.getLogger(__name__)


@dataclass
class MethodResult:
    name: str
    family: str
    prompt_len: int
    kl: list[float] = field(default_factory=list)
    top1: list[float] = field(default_factory=list)
    nll: list[float] = field(default_factory=list)
    wire_bytes: int = 0
    dense_elements: int = 0

    @property
    def bits_per_element(self) -> float:
        return self.wire_bytes * 8 / max(self.dense_elements, 1)

    @property
    def ratio(self) -> float:
        return 16.0 / self.bits_per_element

    @property
    def kl_mean(self) -> float:
        return sum(self.kl) / len(self.kl)

    @property
    def kl_ci95(self) -> float:
        n = len(self.kl)
        if n < 2:
            return float("nan")
        m = self.kl_mean
        var = sum((x - m) ** 2 for x in self.kl) / (n - 1)
        return 1.96 * math.sqrt(var / n)

    @property
    def top1_mean(self) -> float:
        return sum(self.top1) / len(self.top1)

    @property
    def ppl(self) -> float:
        return math.exp(sum(self.nll) / len(self.nll))


@dataclass
class EvalConfig:
    prompt_lengths: Sequence[int] = (512, 2048)
    windows: int = 16
    continuation: int = 32
    threads: int = 2

    def __post_init__(self) -> None:
        if self.windows < 2:
            raise ValueError("windows must be >= 2 to quote a confidence interval")
        if self.continuation < 1:
            raise ValueError("continuation must be >= 1 token")
        if any(p < 16 for p in self.prompt_lengths):
            raise ValueError("prompt lengths must be >= 16 tokens")


class ModelUnderTest:
    """The real model (SmolLM2-135M-Instruct by default) with its tokenizer, in fp32 on CPU."""

    def __init__(self, path: str | None = None) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from turbowire.models import ensure_smollm2

        model_path = path or str(ensure_smollm2())
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        cfg = self.model.config
        self.num_layers = int(cfg.num_hidden_layers)
        self.num_kv_heads = int(getattr(cfg, "num_key_value_heads", cfg.num_attention_heads))
        self.head_dim = int(
            getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        )
        self.max_positions = int(getattr(cfg, "max_position_embeddings", 0) or 0)
        self.name = model_path.rstrip("/").split("/")[-1]

    def windows(self, prompt_len: int, continuation: int, count: int) -> list[torch.Tensor]:
        """``count`` token windows of prompt_len + continuation, spread evenly over the corpus."""
        ids = self.tokenizer(load_corpus(), return_tensors="pt").input_ids[0]
        span = prompt_len + continuation
        if len(ids) < span * count:
            raise ValueError(f"corpus has {len(ids)} tokens, {count} windows of {span} need more")
        stride = (len(ids) - span) // max(count - 1, 1)
        return [ids[i * stride : i * stride + span] for i in range(count)]


KV = list[tuple[torch.Tensor, torch.Tensor]]


def prefill_kv(mut: ModelUnderTest, ids: torch.Tensor) -> KV:
    """The exact prompt KV of ``ids`` (1-D): fp32 compute, per layer (K, V) as [T, H, D] rounded
    to bf16 as a vLLM cache holds them (K after RoPE)."""
    out = mut.model(ids[None], use_cache=True, logits_to_keep=1)
    return [
        (
            layer.keys[0].transpose(0, 1).to(torch.bfloat16),
            layer.values[0].transpose(0, 1).to(torch.bfloat16),
        )
        for layer in out.past_key_values.layers
    ]


def kv_cache(kv: KV):
    """A fresh transformers cache holding ``kv`` (fp32, as the model computes)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    for li, (k, v) in enumerate(kv):
        cache.update(
            k.to(torch.float32).transpose(0, 1)[None],
            v.to(torch.float32).transpose(0, 1)[None],
            li,
        )
    return cache


def apply_method(method: KVMethod, kv: KV) -> tuple[KV, int]:
    """Every layer's KV through ``method``: the reconstruction and the wire bytes."""
    recon, nbytes = [], 0
    for li, (k, v) in enumerate(kv):
        kq, vq, nb = method.apply(li, k, v)
        recon.append((kq, vq))
        nbytes += nb
    return recon, nbytes


def extend_kv(mut: ModelUnderTest, kv: KV, ids: torch.Tensor) -> KV:
    """``kv`` followed by the KV of ``ids`` (1-D) computed over it, rounded to bf16 as a vLLM
    cache holds it: what a decode engine holds after recomputing those tokens itself."""
    cache = kv_cache(kv)
    if ids.numel():
        mut.model(ids[None], past_key_values=cache, logits_to_keep=1)
    return [
        (layer.keys[0].transpose(0, 1).to(torch.bfloat16),
         layer.values[0].transpose(0, 1).to(torch.bfloat16))
        for layer in cache.layers
    ]


def recomputed_tail(mut: ModelUnderTest, method: RecomputedTailMethod, layers: KV,
                    ids: torch.Tensor, later: int = 0) -> tuple[KV, int]:
    """The decode engine's KV of the prompt ``ids`` (1-D, ``layers`` its exact KV) when it
    recomputes the prompt's last ``method.recent`` tokens, ``later`` of which come after
    ``ids`` (the caller runs them): the prefix through the method, the tail run over it.
    Returns it and the prefix's wire bytes. As the connector does, a prompt no longer than
    ``method.recent`` is loaded whole (nothing recomputed)."""
    total = ids.numel() + later
    cut = total - method.recent if total > method.recent else total
    recon, nbytes = apply_method(method, [(k[:cut], v[:cut]) for k, v in layers])
    return extend_kv(mut, recon, ids[cut:]), nbytes


@torch.inference_mode()
def evaluate(
    methods: Sequence[KVMethod],
    config: EvalConfig,
    mut: ModelUnderTest | None = None,
    progress: Callable[[str, int, int], None] | None = None,
) -> list[MethodResult]:
    """Evaluate every method at every prompt length; returns one result per (method, length)."""
    torch.set_num_threads(config.threads)
    mut = mut or ModelUnderTest()
    results: list[MethodResult] = []
    total = len(config.prompt_lengths) * config.windows
    step = 0
    for plen in config.prompt_lengths:
        per_method = {m.name: MethodResult(m.name, m.family, plen) for m in methods}
        ref_result = MethodResult("bf16 (reference)", "reference", plen)
        for window in mut.windows(plen, config.continuation, config.windows):
            prompt, cont = window[:plen][None], window[plen:][None]
            layers = prefill_kv(mut, prompt[0])
            dense = sum(k.numel() + v.numel() for k, v in layers)

            def continuation_logprobs(kv: KV) -> torch.Tensor:
                logits = mut.model(cont, past_key_values=kv_cache(kv)).logits[0]
                return torch.log_softmax(logits.to(torch.float32), dim=-1)

            ref = continuation_logprobs(layers)
            targets = cont[0, 1:]
            ref_result.nll.append(float(-ref[:-1].gather(1, targets[:, None]).mean()))
            ref_result.kl.append(0.0)
            ref_result.top1.append(1.0)
            ref_result.wire_bytes += dense * 2
            ref_result.dense_elements += dense
            for method in methods:
                if isinstance(method, RecomputedTailMethod):
                    recon, nbytes = recomputed_tail(mut, method, layers, prompt[0])
                else:
                    recon, nbytes = apply_method(method, layers)
                test = continuation_logprobs(recon)
                r = per_method[method.name]
                r.kl.append(float((ref.exp() * (ref - test)).sum(-1).mean()))
                r.top1.append(float((ref.argmax(-1) == test.argmax(-1)).float().mean()))
                r.nll.append(float(-test[:-1].gather(1, targets[:, None]).mean()))
                r.wire_bytes += nbytes
                r.dense_elements += dense
            step += 1
            if progress:
                progress(f"P={plen}", step, total)
        results.append(ref_result)
        results.extend(per_method.values())
    return results
