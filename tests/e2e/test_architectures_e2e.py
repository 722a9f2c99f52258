"""Model coverage on real engines: tiny random models of other architectures than the default
Llama through a real P/D pair (vLLM CPU engines, real NIXL). With ``raw`` the decode engine's
greedy output equals the prefill engine answering alone; with ``tq4`` a completion is produced
from the loaded (compressed) KV. The prompts are longer than the 64-token window, so windows
slide:

* Gemma-2/3 interleave sliding-window and full layers. The connector supports vLLM's hybrid KV
  cache manager (``SupportsHMA``), so vLLM keeps it on: the sliding layers get a KV cache group
  of their own, whose table frees the blocks the window leaves. Every block moves for the full
  layers, only the blocks still in the window for the sliding ones. With the manager off
  (``--disable-hybrid-kv-cache-manager``) vLLM gives every layer full-attention blocks, and
  every block moves for every layer.
* The Mistral-style model slides on every layer (one group): vLLM frees the blocks the window
  leaves (its null block takes their place in both engines' tables), so only the blocks still
  in the window move, and the decode engine never writes its null block.

Refusals (MLA, Mamba/linear-attention state) are in tests/unit/connector/test_geometry_kinds.py
and below (a hybrid model at start)."""

from __future__ import annotations

import pytest
from conftest import BLOCK_SIZE, start_stack
from test_connector_e2e_raw import pd, prompt_ids, single, staging_bytes_for
from test_presets_e2e import HEAD_DIM, KV_HEADS

from turbowire.codec import Codec
from turbowire.models import TINY_WINDOW, ensure_tiny_model

pytestmark = pytest.mark.e2e

LAYERS = {"gemma3-w40": 6}  # layers of a tiny model (4 unless here), 2 KV heads x head_dim 64
WINDOW = {"gemma3-w40": 40}  # its sliding window (TINY_WINDOW unless here)
# inside the window; several windows and a partial block; longer than the engines' 1024-token
# step, so the prefill engine saves its last blocks after vLLM freed the first ones
PROMPTS = (40, 7 * BLOCK_SIZE + 5, 1100)
assert PROMPTS[0] < TINY_WINDOW < PROMPTS[1]
ARCHITECTURES = ("qwen3", "gemma2", "gemma3", "gemma3-w40", "mistral-swa")  # README's rows
SLIDING = {"gemma2": (0, 2), "gemma3": (0, 2), "gemma3-w40": (0, 1, 3, 4),
           "mistral-swa": (0, 1, 2, 3)}  # the tiny models' sliding layers
PRESETS = {"gemma3-w40": ("raw",)}  # presets run per architecture (raw and tq4 unless here)
NO_HMA = ("--disable-hybrid-kv-cache-manager",)


def moved_blocks(arch: str, n: int, hma: bool) -> list[range]:
    """Per layer, the blocks of an n-token prompt the decode engine loads: all of them, but for
    a sliding layer whose blocks vLLM frees (every layer slides, or the hybrid manager gives the
    sliding layers their own group): then those from the one holding token n - window + 1 on
    (``SlidingWindowManager.get_num_skipped_tokens``)."""
    every = range(-(-n // BLOCK_SIZE))
    frees = arch == "mistral-swa" or (hma and arch in SLIDING)
    skipped = max(0, n - WINDOW.get(arch, TINY_WINDOW) + 1) // BLOCK_SIZE
    return [range(skipped, every.stop) if frees and layer in SLIDING[arch] else every
            for layer in range(LAYERS.get(arch, 4))]


def wire_bytes(preset: str, n: int, blocks: list[range]) -> int:
    """One chunk per moved block and layer, at the preset's exact size."""
    codec = Codec(preset, HEAD_DIM, len(blocks))
    return sum(codec.encoded_nbytes(layer, min(BLOCK_SIZE, n - b * BLOCK_SIZE), KV_HEADS,
                                    b * BLOCK_SIZE)
               for layer, moved in enumerate(blocks) for b in moved)


@pytest.mark.parametrize("arch,preset,hma", [
    *[(arch, preset, True) for arch in ARCHITECTURES
      for preset in PRESETS.get(arch, ("raw", "tq4"))],
    ("gemma3", "raw", False),  # the hybrid manager off: one group, every block moves
])
def test_architecture_hands_the_prompt_over(arch, preset, hma, engine_slot, tmp_path_factory):
    model = ensure_tiny_model(arch)
    group, stack = start_stack(model, preset,
                               tmp_path_factory.mktemp(f"logs-{arch}-{preset}-{hma}"),
                               staging_bytes_for(preset, 40, LAYERS.get(arch, 4)),
                               extra_args=() if hma else NO_HMA)
    try:
        for i, n in enumerate(PROMPTS):
            prompt = prompt_ids(9100 + 10 * i + len(arch), n)
            out = pd(stack, prompt, max_tokens=8, request_id=f"{arch}-{preset}-{hma}-{n}")
            load = out["kv_transfer_params"]["turbowire_load"]
            assert load["failed"] is None, load
            blocks = moved_blocks(arch, n, hma)
            # a block loads while any layer's group holds it
            first = min(moved.start for moved in blocks)
            assert load["tokens"] == n - first * BLOCK_SIZE, load
            assert load["wire_bytes"] == wire_bytes(preset, n, blocks), load
            text = out["choices"][0]["text"]
            if preset == "raw":
                assert text == single(stack, prompt, max_tokens=8)
            else:
                assert text.strip(), "a completion must be produced"
    finally:
        group.stop()



def test_a_hybrid_model_is_refused_at_start_in_turbowires_words(engine_slot, tmp_path_factory):
    """Qwen3-Next-style (gated delta net beside attention): its state is not K/V attention.
    The engine stops at start with turbowire's reason, before vLLM's own grouping error
    ("Failed to promote local KV cache specs to one unified type")."""
    from turbowire.serving.launch import (
        EngineSpec,
        EngineStartError,
        ProcessGroup,
        free_port,
        start_engine,
        turbowire_kv_config,
    )

    group = ProcessGroup()
    try:
        with pytest.raises(EngineStartError, match="Qwen3NextForCausalLM is a hybrid model"):
            engine = group.add(start_engine(EngineSpec(
                "prefill", ensure_tiny_model("qwen3-next"), free_port(), cpu=0,
                kv_transfer_config=turbowire_kv_config(
                    "kv_producer", side_channel_port=free_port(), preset="tq4",
                    staging_bytes=staging_bytes_for("tq4", 40, 4)),
                kvcache_gib=1, block_size=BLOCK_SIZE, max_model_len=2048, max_num_seqs=8,
                max_num_batched_tokens=1024, served_model_name="tiny"),
                tmp_path_factory.mktemp("logs-qwen3-next")))
            engine.wait_healthy(900)
    finally:
        group.stop()
