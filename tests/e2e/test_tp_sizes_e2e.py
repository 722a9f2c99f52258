"""Prefill and decode engines of different TP sizes (vLLM CPU, real NIXL): the tiny Llama's 2
KV heads split 1 per rank at TP 2, so

* P TP=1 -> D TP=2: each decode rank reads the prefill rank's 2-head chunks and keeps its head;
* P TP=2 -> D TP=1: the decode rank reads both prefill ranks' 1-head chunks, each at its head;
* P TP=1 told ``decode_tp_size: 2`` -> D TP=2: the prefill rank stages each chunk as two 1-head
  chunks and each decode rank reads only its own (half the bytes of the above).

and the tiny DeepSeek-V2-style MLA model, whose latent rows every rank holds whole: at P TP=1 ->
D TP=2 each decode rank reads the whole latent chunks from the one prefill rank. With a tiny
EAGLE drafter on both engines (``llama+eagle``), the drafter's attention layer, whose heads vLLM
shards as the target's, is cut and read like the target's layers and the decode engine drafts.

The engines run in the test's session (``turbowire.serving.launch``): the TP 2 engine's ranks
busy-wait on both cores while a request waits for its KV, which starved an engine started in a
session of its own for 30 s to minutes; the default timeouts hold here.

Each load reports every token and exactly the bytes of the chunks its ranks read. With ``raw``
the loaded KV is the prefill engine's bit for bit, but the two engines compute at different TP
sizes, so their logits differ by float rounding (``NOISE``, measured per model): the decode
engine's first-token distribution must match the prefill engine answering alone within that
noise (a head written at the wrong place moves it far more), and the greedy token must agree
wherever the alone engine's top two are further apart than the noise. With ``tq4`` a
completion is produced from the loaded (coded) KV."""

from __future__ import annotations

import json
import math

import pytest
from conftest import BLOCK_SIZE, start_stack
from test_architectures_e2e import engine_block_size
from test_connector_e2e_raw import pd, prompt_ids, staging_bytes_for
from test_presets_e2e import HEAD_DIM, KV_HEADS, LAYERS

from turbowire.codec import Codec
from turbowire.codec.latent import latent_nbytes
from turbowire.models import ensure_tiny_eagle, ensure_tiny_model

pytestmark = pytest.mark.e2e

PROMPTS = (29, 7 * BLOCK_SIZE + 5, 1100)
TOP = 20  # logprobs compared per position
# a first-token logprob's TP-rounding spread bound, per model (measured on 2026-12-05: the
# Llama <= 0.0078 between a load at D TP 2 and the TP 1 engine alone; the sharper MLA model, whose
# logits move in bf16 steps of 1/32, <= 0.123 between TP 1 and TP 2 engines answering alone,
# without any transfer, and <= 0.092 between a load at D TP 2 and the TP 1 engine alone)
NOISE = {"llama": 0.05, "llama+eagle": 0.05, "deepseek-v2": 0.25}


def wire_bytes(arch: str, preset: str, n: int, prefill_tp: int, decode_tp: int,
               block: int, cut: bool) -> int:
    """The bytes every decode rank reads, one chunk per layer and block of the ranks it reads:
    the Llama's chunks hold a prefill rank's heads (a decode rank's, ``cut``), read by as many
    ranks as the wider side has; an MLA latent chunk is the same on every rank, read whole by
    each decode rank."""
    tokens = [(start, min(block, n - start)) for start in range(0, n, block)]
    if arch == "deepseek-v2":  # 4 layers, the 512 latent as 4 vectors of 128, a 64 RoPE part
        codec = Codec(preset, 128, 4)
        return decode_tp * sum(latent_nbytes(codec, layer, t, 512, 64, start)
                               for layer in range(4) for start, t in tokens)
    layers = LAYERS + (arch == "llama+eagle")  # the EAGLE drafter's one attention layer
    codec = Codec(preset, HEAD_DIM, layers)
    heads = KV_HEADS // (decode_tp if cut else prefill_tp)
    return max(prefill_tp, decode_tp) * sum(codec.encoded_nbytes(layer, t, heads, start)
                                            for layer in range(layers) for start, t in tokens)


def first_token_logprobs(out: dict) -> dict[str, float]:
    return out["choices"][0]["logprobs"]["top_logprobs"][0]


# the Llama: raw both ways (the distribution check), with the prefill engine's chunks whole and
# cut per decode rank's heads, and a coded preset through the cut (tests/unit covers the presets
# bit for bit); the MLA model where decode ranks outnumber prefill ranks
@pytest.mark.parametrize("arch,prefill_tp,decode_tp,preset,cut", [
    ("llama", 1, 2, "raw", False), ("llama", 1, 2, "raw", True), ("llama", 2, 1, "raw", False),
    ("llama", 1, 2, "tq4", True), ("deepseek-v2", 1, 2, "raw", False),
    ("llama+eagle", 1, 2, "raw", True)])
def test_engines_of_other_tp_sizes_hand_the_prompt_over(arch, prefill_tp, decode_tp, preset,
                                                        cut, tiny_model, engine_slot,
                                                        tmp_path_factory):
    layers = LAYERS + (arch == "llama+eagle")  # the EAGLE drafter's one attention layer
    model, staging = ((tiny_model, staging_bytes_for(preset, 48, layers))
                      if arch.startswith("llama") else (ensure_tiny_model(arch), 64 << 20))
    args: tuple[str, ...] = ()
    if arch == "llama+eagle":  # both engines draft (the prefill engine stages the draft KV)
        args = ("--speculative-config", json.dumps(
            {"method": "eagle", "model": str(ensure_tiny_eagle(tiny_model)),
             "num_speculative_tokens": 3}))
    logs = tmp_path_factory.mktemp(f"logs-{arch}-tp{prefill_tp}{decode_tp}-{preset}")
    group, stack = start_stack(model, preset, logs, staging, tp=(prefill_tp, decode_tp),
                               extra={"decode_tp_size": decode_tp} if cut else None,
                               extra_args=args)
    try:
        block = engine_block_size(stack.decode.url)  # MLA backends choose their own
        assert block == engine_block_size(stack.prefill.url)
        for i, n in enumerate(PROMPTS):
            prompt = prompt_ids(7700 + 10 * i + prefill_tp, n)
            out = pd(stack, prompt, max_tokens=8, logprobs=TOP,
                     request_id=f"{arch}-tp{prefill_tp}{decode_tp}-{preset}-{cut}-{n}")
            load = out["kv_transfer_params"]["turbowire_load"]
            assert load["failed"] is None, load
            assert load["tokens"] == n, load
            # vLLM CPU keeps the block size asked for attention layers; its MLA backends pick
            # their own (16, or the 32 asked with AMX)
            sizes = {BLOCK_SIZE} if arch.startswith("llama") else {block, 16, 32}
            assert load["wire_bytes"] in {wire_bytes(arch, preset, n, prefill_tp, decode_tp, b,
                                                     cut) for b in sizes}, load
            assert out["choices"][0]["text"].strip(), "a completion must be produced"
            if arch == "llama+eagle":
                assert load["spec_drafted_tokens"] > 0, load
            if preset != "raw":
                continue
            alone = stack.complete(stack.prefill.url, prompt, max_tokens=1, logprobs=TOP)
            ref, got = first_token_logprobs(alone), first_token_logprobs(out)
            shared = set(ref) & set(got)
            assert len(shared) >= TOP // 2, (ref, got)
            worst = max(abs(ref[t] - got[t]) for t in shared)
            assert worst <= NOISE[arch], f"first-token logprobs {worst:.4f} apart: {ref} vs {got}"
            best = sorted(ref.values(), reverse=True)
            if best[0] - best[1] > 2 * NOISE[arch]:  # rounding cannot flip this greedy token
                top = max(ref, key=ref.get)
                assert out["choices"][0]["logprobs"]["tokens"][0] == top
            assert all(math.isfinite(v) for v in got.values())
    finally:
        group.stop()
