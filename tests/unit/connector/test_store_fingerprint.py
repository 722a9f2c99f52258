"""The weights fingerprint in the store scope (issue 33, M3): other weights under the same served
name are other keys, the same weights anywhere are the same keys."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from turbowire.store.fingerprint import vllm_config_fingerprint, weights_fingerprint
from turbowire.store.keys import StoreKeyError, StoreScope


def write_model(path: Path, seed: int, *, indent: int | None = None) -> Path:
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    g = torch.Generator().manual_seed(seed)
    tensors = {f"layers.{i}.weight": torch.randn(256, 256, generator=g).to(torch.bfloat16)
               for i in range(4)}
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({"hidden_size": 256, "num_layers": 4,
                                                  "rope_theta": 10000.0}, indent=indent))
    (path / "tokenizer.json").write_text("{}")
    return path


def test_same_weights_anywhere_same_fingerprint(tmp_path):
    a = write_model(tmp_path / "a", seed=1)
    b = tmp_path / "mounted" / "elsewhere"
    shutil.copytree(a, b)
    (b / "config.json").write_text(json.dumps(json.loads((a / "config.json").read_text()),
                                              indent=4))  # formatting only
    fp = weights_fingerprint(str(a))
    assert fp == weights_fingerprint(str(b)) and len(fp) == 16 and int(fp, 16) >= 0


def test_other_weights_or_settings_other_fingerprint(tmp_path):
    a = write_model(tmp_path / "a", seed=1)
    tuned = write_model(tmp_path / "tuned", seed=2)  # same names, shapes, sizes: a fine-tune
    assert (a / "model.safetensors").stat().st_size == (tuned / "model.safetensors").stat().st_size
    assert weights_fingerprint(str(a)) != weights_fingerprint(str(tuned))
    rope = tmp_path / "rope"
    shutil.copytree(a, rope)
    (rope / "config.json").write_text(json.dumps({"hidden_size": 256, "num_layers": 4,
                                                  "rope_theta": 500000.0}))
    assert weights_fingerprint(str(a)) != weights_fingerprint(str(rope))
    assert weights_fingerprint(str(a)) != weights_fingerprint(str(a),
                                                              settings={"quantization": "fp8"})


def test_vllm_config_fingerprint_reads_model_and_load_settings(tmp_path, caplog):
    a = write_model(tmp_path / "a", seed=3)

    def config(**model):
        base = dict(model=str(a), revision=None, quantization=None, hf_overrides={})
        return SimpleNamespace(model_config=SimpleNamespace(**{**base, **model}),
                               load_config=SimpleNamespace(load_format="auto"))

    fp = vllm_config_fingerprint(config())
    assert fp == vllm_config_fingerprint(config())
    assert fp != vllm_config_fingerprint(config(quantization="fp8"))
    assert fp != vllm_config_fingerprint(config(hf_overrides={"rope_theta": 1.0}))
    with caplog.at_level("WARNING"):
        hub = vllm_config_fingerprint(config(model="no-such-org/no-such-model-xyz"))
    assert hub != fp and "name and revision only" in caplog.text


def test_scope_carries_the_fingerprint():
    plain = StoreScope("ns", "tiny.bfloat16", "raw", 1, 256, 1)
    fp = StoreScope("ns", "tiny.bfloat16", "raw", 1, 256, 1, weights="0123456789abcdef")
    other = StoreScope("ns", "tiny.bfloat16", "raw", 1, 256, 1, weights="fedcba9876543210")
    assert len({plain.prefix, fp.prefix, other.prefix}) == 3
    assert fp.prefix == "ns/tiny.bfloat16.w0123456789abcdef/raw/v1/c256/tp1"
    assert StoreScope.from_dict(fp.to_dict()) == fp
    assert StoreScope.from_dict(plain.to_dict()) == plain and "weights" not in plain.to_dict()
    key = fp.chunk_key(b"\x01" * 16)
    assert len(key.split("/")) == 8  # the directory's and tiers' key shapes are unchanged
    for bad in ("XYZ", "0" * 33, 5):
        with pytest.raises(StoreKeyError):
            StoreScope("ns", "m", "raw", 1, 256, 1, weights=bad)  # type: ignore[arg-type]
        with pytest.raises(StoreKeyError):
            StoreScope.from_dict({**plain.to_dict(), "weights": bad})
