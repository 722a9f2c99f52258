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

* The Phi-3-style model's heads are 96 wide, not a power of two: ``tq4``'s rotated streams pad
  each head to 128 (the reference codec codes it; the C codec takes 64, 128, 256).

* The hybrids (Qwen3-Next-style gated delta net, Granite-4-style Mamba-2) put their state
  layers in a group of their own (vLLM's ``MambaSpec``): the attention layers' blocks move
  coded, each state layer's state moves raw, one state chunk per layer, taken from the block
  holding the state at the prompt's end.

* The MLA model (DeepSeek-V2-style) caches one row per token and layer, a 512 latent and a
  64-wide RoPE part: each block moves as one latent chunk per layer, the latent coded with the
  preset's key stream, the RoPE part raw.

Refusals (other cache kinds; a hybrid with speculative decoding; MLA with draft KV or fp8) are
in tests/unit/connector/test_geometry_kinds.py and tests/unit/connector/test_mla_layers.py."""

from __future__ import annotations

import re

import httpx
import pytest
from conftest import BLOCK_SIZE, start_stack
from test_connector_e2e_raw import pd, prompt_ids, single, staging_bytes_for
from test_presets_e2e import HEAD_DIM, KV_HEADS

from turbowire.codec import Codec
from turbowire.codec.latent import latent_nbytes
from turbowire.codec.state import state_chunk_nbytes
from turbowire.models import TINY_WINDOW, ensure_tiny_model

pytestmark = pytest.mark.e2e

LAYERS = {"gemma3-w40": 6, "deepseek-v3": 3}  # layers of a tiny model (4 unless here)
WINDOW = {"gemma3-w40": 40}  # its sliding window (TINY_WINDOW unless here)
# inside the window; several windows and a partial block; longer than the engines' 1024-token
# step, so the prefill engine saves its last blocks after vLLM freed the first ones
PROMPTS = (40, 7 * BLOCK_SIZE + 5, 1100)
assert PROMPTS[0] < TINY_WINDOW < PROMPTS[1]
HYBRIDS = ("qwen3-next", "granite4")  # state layers beside attention: their own test (below)
# README's rows served on real engines
ARCHITECTURES = ("qwen3", "gemma2", "gemma3", "gemma3-w40", "mistral-swa", "phi3",
                 "qwen3-next", "granite4", "deepseek-v2", "deepseek-v3")
MLA = ("deepseek-v2", "deepseek-v3")  # MLA latents: their own test (below)
SLIDING = {"gemma2": (0, 2), "gemma3": (0, 2), "gemma3-w40": (0, 1, 3, 4),
           "mistral-swa": (0, 1, 2, 3)}  # the tiny models' sliding layers
PRESETS = {"gemma3-w40": ("raw",)}  # presets run per architecture (raw and tq4 unless here)
HEAD_DIMS = {"phi3": 96}  # a tiny model's head size (HEAD_DIM unless here)
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


def wire_bytes(arch: str, preset: str, n: int, blocks: list[range]) -> int:
    """One chunk per moved block and layer, at the preset's exact size."""
    codec = Codec(preset, HEAD_DIMS.get(arch, HEAD_DIM), len(blocks))
    return sum(codec.encoded_nbytes(layer, min(BLOCK_SIZE, n - b * BLOCK_SIZE), KV_HEADS,
                                    b * BLOCK_SIZE)
               for layer, moved in enumerate(blocks) for b in moved)


@pytest.mark.parametrize("arch,preset,hma", [
    *[(arch, preset, True) for arch in ARCHITECTURES if arch not in HYBRIDS + MLA
      for preset in PRESETS.get(arch, ("raw", "tq4"))],
    ("gemma3", "raw", False),  # the hybrid manager off: one group, every block moves
])
def test_architecture_hands_the_prompt_over(arch, preset, hma, engine_slot, tmp_path_factory):
    model = ensure_tiny_model(arch)
    group, stack = start_stack(model, preset,
                               tmp_path_factory.mktemp(f"logs-{arch}-{preset}-{hma}"),
                               staging_bytes_for(preset, 40, LAYERS.get(arch, 4),
                                                 HEAD_DIMS.get(arch, HEAD_DIM)),
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
            assert load["wire_bytes"] == wire_bytes(arch, preset, n, blocks), load
            text = out["choices"][0]["text"]
            if preset == "raw":
                assert text == single(stack, prompt, max_tokens=8)
            else:
                assert text.strip(), "a completion must be produced"
    finally:
        group.stop()


# Hybrids: state layers 0 and 2 (gated delta net / Mamba-2), full attention on 1 and 3. vLLM
# raises the attention block until one attention page (512 B a token) holds a layer's state:
# Qwen3-Next's conv [kernel 4 - 1, 2 x 2 x 64 keys + 4 x 64 values] bf16 and recurrent state
# [4 value heads, 64, 64] fp32; Granite 4's conv [3, 512 + 2 x 64] bf16 and SSM [8, 64, 64] fp32.
HYBRID_BLOCK = {"qwen3-next": 160, "granite4": 288}
HYBRID_STATE_BYTES = {"qwen3-next": 3 * (2 * 2 * 64 + 4 * 64) * 2 + 4 * 64 * 64 * 4,
                      "granite4": 3 * (512 + 2 * 64) * 2 + 8 * 64 * 64 * 4}
NO_PREFIX_CACHING = ("--no-enable-prefix-caching",)


@pytest.mark.parametrize("arch,preset,caching", [
    ("qwen3-next", "raw", True), ("qwen3-next", "tq4", True), ("qwen3-next", "raw", False),
    # vLLM CPU's Mamba-2 scan returns no per-chunk states, which its prefix caching (mamba
    # cache mode 'align') indexes on prompts past one chunk: Granite 4 runs with it off
    ("granite4", "raw", False), ("granite4", "tq4", False),
])
def test_a_hybrid_model_hands_over_kv_and_state(arch, preset, caching, engine_slot,
                                                tmp_path_factory):
    """Attention KV coded, each state layer's state raw, one state chunk per layer: the state
    after the first n - 1 prompt tokens (vLLM's rule for Mamba: the prefill engine stops one
    token short and the decode engine computes the last one from that state), taken from the
    state group's last block (prefix caching on: the block of the last token, vLLM's mamba
    cache mode 'align'; off: the request's one block, mode 'none').

    With ``raw`` the first token's distribution is the prefill engine's alone, to 0.03 nats
    over the top tokens both list. Not the greedy text: the decode engine steps the last
    prompt token from the state where the single engine scans the whole prompt in chunks, in
    bf16, and these random models' next-token distributions are nearly flat (top logprobs
    about -6.6), so near-ties may flip. Measured on Qwen3-Next: 5 of 5 top tokens shared,
    differences under 0.008; without the state (not loaded) 0 to 2 shared, 0.05 to 0.13 apart."""
    model = ensure_tiny_model(arch)
    group, stack = start_stack(model, preset,
                               tmp_path_factory.mktemp(f"logs-{arch}-{preset}-{caching}"),
                               64 << 20, extra_args=() if caching else NO_PREFIX_CACHING)
    codec = Codec(preset, HEAD_DIM, 2)
    block = HYBRID_BLOCK[arch]
    try:
        for i, n in enumerate(PROMPTS):
            prompt = prompt_ids(9300 + 10 * i + len(arch), n)
            out = pd(stack, prompt, max_tokens=1, request_id=f"{arch}-{preset}-{caching}-{n}",
                     logprobs=5)
            load = out["kv_transfer_params"]["turbowire_load"]
            assert load["failed"] is None, load
            loaded = n - 1
            assert load["tokens"] == loaded, load
            attention = sum(
                codec.encoded_nbytes(layer, min(block, loaded - start), KV_HEADS, start)
                for layer in range(2) for start in range(0, loaded, block))
            state = 2 * state_chunk_nbytes(HYBRID_STATE_BYTES[arch])
            assert load["wire_bytes"] == attention + state, load
            got = out["choices"][0]["logprobs"]["top_logprobs"][0]
            if preset == "raw":
                alone = stack.complete(stack.prefill.url, prompt, 1, logprobs=5)
                ref = alone["choices"][0]["logprobs"]["top_logprobs"][0]
                shared = set(ref) & set(got)
                assert len(shared) >= 3, (ref, got)
                assert max(abs(ref[t] - got[t]) for t in shared) < 0.03, (ref, got)
            else:
                assert got and all(v > -1e9 for v in got.values()), got  # finite, produced
    finally:
        group.stop()


def engine_block_size(url: str) -> int:
    """The block size an engine really runs, from its ``vllm:cache_config_info`` gauge: vLLM
    CPU's MLA backends choose their own (the reference backend 16, the AMX one the 32 asked)."""
    text = httpx.get(url + "/metrics", timeout=30).text
    found = re.search(r"^vllm:cache_config_info\{(.*)\}\s+\S+$", text, re.MULTILINE)
    assert found, "the engine exports no vllm:cache_config_info"
    # the exact label: hash_block_size, effective_attention_block_size and others end alike and
    # may differ from it (a search for 'block_size=' once read one of them on another CPU)
    labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', found.group(1)))
    assert labels.get("block_size", "").isdigit(), labels
    return int(labels["block_size"])


@pytest.mark.parametrize("arch,preset", [("deepseek-v2", "raw"), ("deepseek-v2", "tq4"),
                                         ("deepseek-v3", "raw")])
def test_an_mla_model_hands_over_its_latent_rows(arch, preset, engine_slot, tmp_path_factory):
    """MLA on every layer (vLLM CPU: chunked prefill and prefix caching off, its MLA backend's
    block size): every block of every layer moves as one latent chunk; with ``raw`` the greedy
    output is the prefill engine's alone. DeepSeek-V2-style (4 layers, dense MLPs) and
    V3-style (a query LoRA, other head widths, MoE)."""
    model = ensure_tiny_model(arch)
    layers = LAYERS.get(arch, 4)
    group, stack = start_stack(model, preset,
                               tmp_path_factory.mktemp(f"logs-{arch}-{preset}"), 64 << 20)
    try:
        block = engine_block_size(stack.decode.url)
        assert block == engine_block_size(stack.prefill.url)
        codec = Codec(preset, 128, layers)  # the 512 latent as 4 vectors of 128
        for i, n in enumerate(PROMPTS):
            prompt = prompt_ids(9500 + 10 * i + len(arch), n)
            out = pd(stack, prompt, max_tokens=8, request_id=f"{arch}-{preset}-{n}")
            load = out["kv_transfer_params"]["turbowire_load"]
            assert load["failed"] is None, load
            assert load["tokens"] == n, load
            assert load["wire_bytes"] == sum(
                latent_nbytes(codec, layer, min(block, n - start), 512, 64, start)
                for layer in range(layers) for start in range(0, n, block)), load
            text = out["choices"][0]["text"]
            if preset == "raw":
                assert text == single(stack, prompt, max_tokens=8)
            else:
                assert text.strip(), "a completion must be produced"
    finally:
        group.stop()
