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


if __name__ == "__main__":
    print(ensure_tiny_llama())
