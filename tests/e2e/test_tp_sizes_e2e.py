"""Prefill and decode engines of different TP sizes (vLLM CPU, real NIXL): the tiny Llama's 2
KV heads split 1 per rank at TP 2, so

* P TP=1 -> D TP=2: each decode rank reads the prefill rank's 2-head chunks and keeps its head;
* P TP=2 -> D TP=1: the decode rank reads both prefill ranks' 1-head chunks, each at its head.

The engines run in the test's session (``turbowire.serving.launch``): the TP 2 engine's ranks
busy-wait on both cores while a request waits for its KV, which starved an engine started in a
session of its own for 30 s to minutes; the default timeouts hold here.

Each load reports every token and exactly the bytes of the chunks its ranks read. With ``raw``
the loaded KV is the prefill engine's bit for bit, but the two engines compute at different TP
sizes, so their logits differ by float rounding (up to ~0.01 in a logprob here): the decode
engine's first-token distribution must match the prefill engine answering alone within that
noise (a head written at the wrong place moves it far more), and the greedy token must agree
wherever the alone engine's top two are further apart than the noise. With ``tq4`` a
completion is produced from the loaded (coded) KV."""

from __future__ import annotations

import math

import pytest
from conftest import BLOCK_SIZE, start_stack
from test_connector_e2e_raw import pd, prompt_ids, staging_bytes_for
from test_presets_e2e import HEAD_DIM, KV_HEADS, LAYERS

from turbowire.codec import Codec

pytestmark = pytest.mark.e2e

PROMPTS = (29, 7 * BLOCK_SIZE + 5, 1100)
TOP = 20  # logprobs compared per position
NOISE = 0.05  # a logprob's TP-rounding spread bound (measured: <= 0.0078 between TP 1 and 2)


def wire_bytes(preset: str, n: int, heads: int, reads: int) -> int:
    """``reads`` reads of every chunk holding ``heads`` heads (one per layer and block)."""
    codec = Codec(preset, HEAD_DIM, LAYERS)
    return reads * sum(codec.encoded_nbytes(layer, min(BLOCK_SIZE, n - start), heads, start)
                       for layer in range(LAYERS) for start in range(0, n, BLOCK_SIZE))


def first_token_logprobs(out: dict) -> dict[str, float]:
    return out["choices"][0]["logprobs"]["top_logprobs"][0]


# raw both ways (the distribution check); a coded preset where decode ranks keep windows of
# chunks (P 2 -> D 1 places whole chunks, as an equal-TP load does; tests/unit covers presets)
@pytest.mark.parametrize("prefill_tp,decode_tp,preset", [(1, 2, "raw"), (2, 1, "raw"),
                                                         (1, 2, "tq4")])
def test_engines_of_other_tp_sizes_hand_the_prompt_over(prefill_tp, decode_tp, preset,
                                                        tiny_model, engine_slot,
                                                        tmp_path_factory):
    group, stack = start_stack(tiny_model, preset,
                               tmp_path_factory.mktemp(f"logs-tp{prefill_tp}{decode_tp}-{preset}"),
                               staging_bytes_for(preset, 48), tp=(prefill_tp, decode_tp))
    # chunks hold the prefill rank's heads; every decode rank reads the chunks of its heads
    heads = KV_HEADS // prefill_tp
    reads = decode_tp if prefill_tp < decode_tp else prefill_tp
    try:
        for i, n in enumerate(PROMPTS):
            prompt = prompt_ids(7700 + 10 * i + prefill_tp, n)
            out = pd(stack, prompt, max_tokens=8, logprobs=TOP,
                     request_id=f"tp{prefill_tp}{decode_tp}-{preset}-{n}")
            load = out["kv_transfer_params"]["turbowire_load"]
            assert load["failed"] is None, load
            assert load["tokens"] == n, load
            assert load["wire_bytes"] == wire_bytes(preset, n, heads, reads), load
            assert out["choices"][0]["text"].strip(), "a completion must be produced"
            if preset != "raw":
                continue
            alone = stack.complete(stack.prefill.url, prompt, max_tokens=1, logprobs=TOP)
            ref, got = first_token_logprobs(alone), first_token_logprobs(out)
            shared = set(ref) & set(got)
            assert len(shared) >= TOP // 2, (ref, got)
            worst = max(abs(ref[t] - got[t]) for t in shared)
            assert worst <= NOISE, f"first-token logprobs {worst:.4f} apart: {ref} vs {got}"
            best = sorted(ref.values(), reverse=True)
            if best[0] - best[1] > 2 * NOISE:  # rounding cannot flip this greedy token
                top = max(ref, key=ref.get)
                assert out["choices"][0]["logprobs"]["tokens"][0] == top
            assert all(math.isfinite(v) for v in got.values())
    finally:
        group.stop()
