"""A tiny random Llama and a tokenizer trained locally: seconds to build, seconds to serve.

KV geometry: 2 layers x 2 KV heads x head_dim 64 (bf16), vocab from a WordLevel tokenizer trained
on texts shipped with Python, so e2e tests run offline and fast. Weights are random (seeded):
the tests compare disaggregated outputs with a single engine's, not text quality.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from turbowire.models import cache_root

NAME = "tw-e2e-tiny-llama-v1"


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
    target = (root or cache_root() / "models") / NAME
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


EAGLE_NAME = "tw-e2e-tiny-eagle-v1"


def ensure_tiny_eagle(target: Path, root: Path | None = None) -> Path:
    """Build (once) a random one-layer EAGLE-1 draft for ``target`` and return its folder.

    vLLM loads it as ``EagleLlamaForCausalLM``: an ``fc`` over [embedding, target hidden state]
    and one decoder layer whose attention KV is an ordinary entry of the engine's ``kv_caches``
    (named after the target's layers), which is what the connector must move with the rest.
    """
    out = (root or cache_root() / "models") / EAGLE_NAME
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


if __name__ == "__main__":
    print(ensure_tiny_llama())
