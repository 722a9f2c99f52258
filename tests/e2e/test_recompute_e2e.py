"""``recompute_recent_tokens`` on real engines: the prefill engine leaves the prompt's last N
tokens out, the decode engine loads the rest and recomputes them itself. With ``raw`` the
greedy output still equals the prefill engine answering alone (the recomputed tail is the
model's own KV over the exact prefix), and exactly the prefix's chunks crossed the wire. A
prompt no longer than N is loaded whole."""

from __future__ import annotations

import pytest
from conftest import BLOCK_SIZE, start_stack
from test_connector_e2e_raw import pd, prompt_ids, single, staging_bytes_for
from test_presets_e2e import wire_bytes

pytestmark = pytest.mark.e2e

RECENT = 40  # not a multiple of the block size: the loaded prefix ends inside a block


def test_the_decode_engine_recomputes_the_recent_window(tiny_model, engine_slot,
                                                        tmp_path_factory):
    group, stack = start_stack(tiny_model, "raw", tmp_path_factory.mktemp("logs-recompute"),
                               staging_bytes_for("raw", 40),
                               extra={"recompute_recent_tokens": RECENT})
    try:
        for n in (7 * BLOCK_SIZE + 5, 300, RECENT):
            prompt = prompt_ids(7000 + n, n)
            out = pd(stack, prompt, request_id=f"recompute-{n}")
            load = out["kv_transfer_params"]["turbowire_load"]
            moved = n - RECENT if n > RECENT else n
            assert load["failed"] is None and load["tokens"] == moved, load
            assert load["wire_bytes"] == wire_bytes("raw", moved), load
            assert out["choices"][0]["text"] == single(stack, prompt)
    finally:
        group.stop()
