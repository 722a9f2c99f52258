"""The benchmark model: a random-weight Llama with Llama-3-8B's KV geometry and few layers.

What crosses the wire in P/D serving is the KV cache, whose size per token is
``layers * 2 * kv_heads * head_dim * 2 bytes``. Llama-3-8B has 8 KV heads of head_dim 128 (128 KiB
per token over 32 layers); this model keeps exactly that per-layer geometry with 8 layers (32 KiB
per token, bf16) so KV blocks, codec chunks and NIXL descriptors look like the real model's, while
the small hidden size keeps CPU prefill affordable. Weights are random (seeded): the benchmark
measures transport, not text quality. The tokenizer is a BPE trained locally with ``tokenizers`` on
texts shipped with the OS and Python, so everything works offline.
"""

from __future__ import annotations

import json
import logging
import random
from dataclasses import asdict, dataclass
from pathlib import Path

from turbowire.models import cache_root

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BenchModelSpec:
    """Geometry of the benchmark model. KV geometry per layer matches Llama-3-8B."""

    num_layers: int = 8
    num_kv_heads: int = 8
    head_dim: int = 128
    num_attention_heads: int = 8
    hidden_size: int = 128
    intermediate_size: int = 256
    vocab_size: int = 4096
    max_position_embeddings: int = 16384
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim not in (64, 128, 256):
            raise ValueError(
                f"head_dim must be 64, 128 or 256 for vLLM's CPU attention, got {self.head_dim}")
        if self.num_layers < 1 or self.vocab_size < 256:
            raise ValueError("num_layers must be >= 1 and vocab_size >= 256")

    @property
    def kv_bytes_per_token(self) -> int:
        """Dense bf16 KV bytes per token over all layers (K and V)."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * 2

    @property
    def name(self) -> str:
        return (f"tw-bench-llama-{self.num_layers}l-{self.num_kv_heads}kv-{self.head_dim}d"
                f"-h{self.hidden_size}-v{self.vocab_size}-s{self.seed}")


def _training_texts() -> list[str]:
    """English text available offline: Python's pydoc topics and the OS license texts."""
    texts: list[str] = []
    try:
        from pydoc_data import topics

        texts.extend(str(v) for v in topics.topics.values())
    except ImportError:  # pragma: no cover - part of the standard library
        pass
    lic = Path("/usr/share/common-licenses")
    if lic.is_dir():
        for p in sorted(lic.iterdir()):
            if p.is_file():
                texts.append(p.read_text(errors="ignore"))
    if not texts:
        raise RuntimeError("no offline training text found for the benchmark tokenizer")
    return texts


def _train_tokenizer(vocab_size: int, out_dir: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_training_texts(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")
    fast.save_pretrained(out_dir)
    return len(fast)


def ensure_bench_model(spec: BenchModelSpec | None = None, cache_dir: Path | None = None) -> Path:
    """Return a folder with the benchmark model (safetensors + tokenizer), building it once."""
    spec = spec or BenchModelSpec()
    target = (cache_dir or cache_root() / "models") / spec.name
    if (target / "config.json").is_file() and any(target.glob("*.safetensors")):
        return target
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    logger.info("building benchmark model %s in %s (one time)", spec.name, target)
    tmp = target.with_name(target.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    vocab = _train_tokenizer(spec.vocab_size, tmp)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_kv_heads, head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings, rope_theta=500000.0,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, torch_dtype="bfloat16")
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(tmp)
    (tmp / "turbowire_bench_spec.json").write_text(json.dumps(asdict(spec), indent=1))
    if target.exists():  # a concurrent build won; keep it
        return target
    tmp.rename(target)
    return target


def vocab_size_of(model_dir: Path) -> int:
    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])


def make_prompt(num_tokens: int, vocab_size: int, seed: int) -> list[int]:
    """A prompt of exactly ``num_tokens`` token ids, unique per seed (no prefix-cache hits).

    Ids avoid the special tokens (0..2) so the engine counts exactly ``num_tokens``.
    """
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
    rng = random.Random(seed)
    return [rng.randrange(3, vocab_size) for _ in range(num_tokens)]
