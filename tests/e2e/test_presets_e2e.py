"""Every preset through real engines and the real NIXL path, a few tokens each: the decode
engine loads the prompt's KV (no recompute), a completion is produced, and the bytes that
crossed the wire are exactly the codec's chunk sizes for that preset (so its bits per element
are the ones the preset table quotes). ``raw`` and ``tq4`` have modules of their own
(test_connector_e2e_raw.py, test_connector_e2e_compressed.py) that assert this and more."""

from __future__ import annotations

import pytest
from conftest import BLOCK_SIZE, start_stack
from test_connector_e2e_raw import pd, prompt_ids, staging_bytes_for

from turbowire.codec import Codec, list_presets

pytestmark = pytest.mark.e2e

LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 64  # the tiny e2e model
ELEMENTS_PER_TOKEN = LAYERS * 2 * KV_HEADS * HEAD_DIM
COVERED_ELSEWHERE = {"raw", "tq4"}
PROMPT_TOKENS = 2 * BLOCK_SIZE + 9  # two full blocks and a partial one


def wire_bytes(preset: str, n: int, layers: int = LAYERS, blocks: range | None = None) -> int:
    """What the P2P path moves for an n-token prompt: one chunk per block (every block, or
    ``blocks``), per layer, of a tiny model with ``layers`` layers."""
    codec = Codec(preset, HEAD_DIM, layers)
    blocks = range(-(-n // BLOCK_SIZE)) if blocks is None else blocks
    return sum(codec.encoded_nbytes(layer, min(BLOCK_SIZE, n - b * BLOCK_SIZE), KV_HEADS,
                                    b * BLOCK_SIZE)
               for b in blocks for layer in range(layers))


@pytest.mark.parametrize("preset", [p for p in list_presets() if p not in COVERED_ELSEWHERE])
def test_a_preset_hands_the_prompt_over_at_its_own_size(preset, tiny_model, engine_slot,
                                                          tmp_path_factory):
    group, stack = start_stack(tiny_model, preset, tmp_path_factory.mktemp(f"logs-{preset}"),
                               staging_bytes_for(preset, 16))
    try:
        n = PROMPT_TOKENS
        out = pd(stack, prompt_ids(8100 + list_presets().index(preset), n), max_tokens=3)
        assert out["choices"][0]["text"].strip(), "a completion must be produced"
        load = out["kv_transfer_params"]["turbowire_load"]
        assert load["failed"] is None and load["tokens"] == n
        assert load["dense_bytes"] == n * ELEMENTS_PER_TOKEN * 2
        assert load["wire_bytes"] == wire_bytes(preset, n)
        if preset != "raw":  # every compressing preset moves fewer bytes than bf16
            assert load["wire_bytes"] < load["dense_bytes"]
    finally:
        group.stop()
