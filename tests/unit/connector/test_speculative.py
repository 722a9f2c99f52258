"""Speculative decoding on the decode side: the verified watermark, the draft ledger, prefill
backoff and the speculative compatibility factors, against vLLM's own Request and config objects.

The central property (``test_saved_chunks_hold_only_verified_tokens``): a simulated decode engine
writes every scheduled position into its cache (drafts included, rejected ones too), rolls back
rejections the way vLLM's scheduler does, and "encodes" what the store planner plans after each
step. Every saved chunk must equal the request's final accepted tokens at those positions, for
random acceptance patterns, draft lengths and drafter lookaheads.
"""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import pytest

from turbowire.connector.config import TurboWireConfig
from turbowire.connector.speculative import (
    TRUNCATED_PARAM,
    DraftLedger,
    SpeculativeSetup,
    remote_prefill_tokens,
    truncate_for_prefill,
    verified_tokens,
)
from turbowire.connector.stats import TurboWireConnectorStats, iter_counters
from turbowire.connector.store_scheduler import StorePlanner
from turbowire.store.keys import StoreScope, chunk_hashes

BLOCK = 4
CHUNK = 8


def make_request(req_id: str, prompt: list[int], max_tokens: int = 64, params=None):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    request = Request(req_id, list(prompt), SamplingParams(max_tokens=max_tokens,
                                                           temperature=0), None)
    request.kv_transfer_params = params
    return request


class Engine:
    """vLLM's scheduler loop for one request, reduced to what the connector sees.

    ``truth`` is the text the target model would produce; a draft is accepted while it matches
    it. The cache holds, per position, the token whose KV was last written there.
    """

    def __init__(self, request, truth: list[int], k: int, rng: random.Random, chunk: int = 0):
        self.request, self.truth, self.k, self.rng = request, truth, k, rng
        self.cache: dict[int, int] = {}
        self.prefill_chunk = chunk or 1 << 30

    def schedule(self) -> tuple[int, list[int]]:
        r = self.request
        if r.num_computed_tokens < r.num_prompt_tokens:  # (chunked) prefill
            n = min(self.prefill_chunk, r.num_prompt_tokens - r.num_computed_tokens)
            return n, []
        drafts = []
        for i in range(self.k):  # a draft is right with some probability, else a wrong token
            pos = r.num_tokens + i
            right = pos < len(self.truth) and self.rng.random() < 0.6
            drafts.append(self.truth[pos] if right else 10_000 + self.rng.randrange(100))
        r.spec_token_ids = drafts
        return 1 + len(drafts), drafts

    def run(self, num_scheduled: int, drafts: list[int]) -> None:
        """The forward pass writes every scheduled position; then sampling and rollback."""
        r = self.request
        start = r.num_computed_tokens
        seq = list(r.all_token_ids) + drafts
        for pos in range(start, start + num_scheduled):
            self.cache[pos] = seq[pos]
        r.num_computed_tokens += num_scheduled
        if r.num_computed_tokens - len(drafts) < r.num_prompt_tokens:
            return  # a partial prefill samples nothing
        accepted = 0
        for i, d in enumerate(drafts):
            if d != self.truth[r.num_tokens + i]:
                break
            accepted += 1
        r.num_computed_tokens -= len(drafts) - accepted
        new = drafts[:accepted] + [self.truth[r.num_tokens + accepted]]
        r.append_output_token_ids(new)
        r.spec_token_ids = []


def scheduler_output(req_id: str, num_scheduled: int, drafts: list[int]):
    return SimpleNamespace(num_scheduled_tokens={req_id: num_scheduled},
                           scheduled_spec_decode_tokens={req_id: drafts} if drafts else {})


def make_planner(stats=None) -> StorePlanner:
    config = TurboWireConfig(transport="store", store_local_cpu_bytes=1 << 20,
                             store_chunk_tokens=CHUNK)
    scope = StoreScope("t", "m", "raw", 1, CHUNK, 1)
    blocks = list(range(1000))
    return StorePlanner(config, scope, BLOCK, "e", stats or TurboWireConnectorStats(),
                        lambda req_id: blocks)


# ------------------------------------------------------------------ the watermark
def test_verified_tokens_is_vllms_cache_cap():
    r = make_request("r", list(range(10)))
    assert verified_tokens(r, 10) == 10  # prefill: the whole prompt
    r.num_computed_tokens = 10
    r.append_output_token_ids([7])  # sampled, not computed yet
    r.spec_token_ids = [1, 2, 3]
    # the step computes position 10 (the sampled token) and 3 drafts: only 11 tokens are final
    assert verified_tokens(r, 4) == 11
    assert verified_tokens(r, 4, draft_lookahead=1) == 10  # EAGLE: hold the last position
    assert verified_tokens(r, 0) == 10


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("lookahead", [0, 1])
@pytest.mark.parametrize("seed", range(6))
def test_saved_chunks_hold_only_verified_tokens(k, lookahead, seed):
    rng = random.Random(seed * 31 + k)
    prompt = [rng.randrange(500) for _ in range(rng.randrange(5, 30))]
    truth = prompt + [rng.randrange(500) for _ in range(80)]
    request = make_request("r", prompt, max_tokens=60)
    engine = Engine(request, truth, k, rng, chunk=rng.choice([0, 5, 8]))
    planner = make_planner()
    planner.lookup(request, 0)
    saved: dict[int, list[int]] = {}
    verified = 0
    while request.num_output_tokens < 60:
        num_scheduled, drafts = engine.schedule()
        verified = max(verified, verified_tokens(request, num_scheduled, lookahead))
        saves = planner.plan_saves({"r": num_scheduled}, lookahead)
        engine.run(num_scheduled, drafts)
        for save in saves:  # the worker encodes after the forward pass of the same step
            for chunk in save.chunks:
                start = chunk.token_start
                saved[start] = [engine.cache[p] for p in range(start, start + CHUNK)]
                final = truth[: start + CHUNK]
                assert chunk.chunk_hash == chunk_hashes(final, CHUNK)[-1]
    final = list(request.all_token_ids)
    assert saved, "nothing was saved"
    for start, tokens in saved.items():
        assert tokens == final[start:start + CHUNK], f"chunk at {start} holds a rejected draft"
    # and every chunk is saved in the step that verifies it (nothing is left behind)
    assert sorted(saved) == list(range(0, (verified // CHUNK) * CHUNK, CHUNK))
    assert verified <= request.num_computed_tokens


def test_saves_never_planned_past_the_blocks_vllm_holds():
    blocks: list[int] = [0, 1]
    config = TurboWireConfig(transport="store", store_local_cpu_bytes=1 << 20,
                             store_chunk_tokens=CHUNK)
    planner = StorePlanner(config, StoreScope("t", "m", "raw", 1, CHUNK, 1), BLOCK, "e",
                           TurboWireConnectorStats(), lambda req_id: list(blocks))
    request = make_request("r", list(range(16)))
    planner.lookup(request, 0)
    assert planner.plan_saves({"r": 16}) == []  # the list shrank (a rewind): deferred, no hang
    blocks.extend([2, 3])
    request.num_computed_tokens = 16
    request.append_output_token_ids([5])
    saves = planner.plan_saves({"r": 1})
    assert [c.token_start for s in saves for c in s.chunks] == [0, 8]


def test_decode_engine_saves_from_the_first_chunk_it_computes():
    planner = make_planner()
    request = make_request("r", list(range(20)), params={"do_remote_prefill": True})
    planner.track_decode(request, loaded_tokens=19)
    request.num_computed_tokens = 19
    assert planner.plan_saves({"r": 1}) == []  # chunk 2 (16..23) not complete
    request.append_output_token_ids(list(range(100, 104)))
    request.num_computed_tokens = 20
    saves = planner.plan_saves({"r": 4})
    assert [c.token_start for s in saves for c in s.chunks] == [16]  # chunks 0, 1 are the peer's


def test_opted_out_request_saves_nothing():
    planner = make_planner()
    request = make_request("r", list(range(16)), params={"turbowire_store": False})
    planner.lookup(request, 0)
    assert planner.plan_saves({"r": 16}) == []


# ------------------------------------------------------------------ the ledger
def _spec(stats: TurboWireConnectorStats) -> dict[str, float]:
    return {lbl["outcome"]: v for n, lbl, v in iter_counters(stats.data) if n == "spec_positions"}


@pytest.mark.parametrize("seed", range(5))
def test_ledger_counts_match_the_engine(seed):
    rng = random.Random(seed)
    prompt = [rng.randrange(500) for _ in range(12)]
    truth = prompt + [rng.randrange(500) for _ in range(60)]
    request = make_request("r", prompt, max_tokens=40)
    engine = Engine(request, truth, 3, rng, chunk=5)
    stats = TurboWireConnectorStats()
    ledger = DraftLedger(stats)
    ledger.track(request)
    drafted = accepted = 0
    while request.num_output_tokens < 40:
        num_scheduled, drafts = engine.schedule()
        ledger.observe(scheduler_output("r", num_scheduled, drafts))
        before = request.num_output_tokens
        engine.run(num_scheduled, drafts)
        drafted += len(drafts)
        if drafts:
            accepted += request.num_output_tokens - before - 1
    counts = ledger.finished(request)
    assert counts is not None
    assert (counts.drafted, counts.accepted) == (drafted, accepted)
    spec = _spec(stats)
    assert spec.get("drafted", 0) == drafted
    assert spec.get("accepted", 0) == accepted
    assert spec.get("discarded", 0) == drafted - accepted
    assert ledger.finished(request) is None  # forgotten


def test_ledger_ignores_placeholder_drafts_and_untracked_requests():
    stats = TurboWireConnectorStats()
    ledger = DraftLedger(stats)
    request = make_request("r", [1, 2, 3])
    ledger.track(request)
    request.num_computed_tokens = 3
    request.append_output_token_ids([4])
    ledger.observe(SimpleNamespace(num_scheduled_tokens={"r": 3, "other": 2},
                                   scheduled_spec_decode_tokens={"r": [-1, 5], "other": [1]}))
    assert _spec(stats) == {"drafted": 1}


# ------------------------------------------------------------------ prefill backoff
def test_prefill_truncation_leaves_the_backoff_to_the_decoder():
    params = {"do_remote_decode": True}
    request = make_request("r", list(range(10)), max_tokens=20, params=params)
    assert truncate_for_prefill(request, 2)
    assert request.num_prompt_tokens == 8 and list(request.all_token_ids) == list(range(8))
    assert request.max_tokens == 1 and params[TRUNCATED_PARAM] is True
    assert not truncate_for_prefill(request, 2)  # once (a preempted request is not cut again)
    assert request.num_prompt_tokens == 8
    short = make_request("s", [1, 2], params={"do_remote_decode": True})
    assert not truncate_for_prefill(short, 2) and short.num_prompt_tokens == 2
    assert not truncate_for_prefill(make_request("z", list(range(10)), params={}), 0)


def test_decode_side_loads_short_of_the_backoff():
    assert remote_prefill_tokens(100, 0) == 100
    assert remote_prefill_tokens(100, 3) == 97
    assert remote_prefill_tokens(2, 3) == 2


def _config(lookahead: int, spec=None, hybrid: bool = False):
    return SimpleNamespace(
        speculative_config=spec, num_prefill_lookahead_tokens=lookahead,
        model_config=SimpleNamespace(is_hybrid=hybrid),
    )


def test_backoff_follows_vllms_rule():
    mtp = SimpleNamespace(method="mtp", num_speculative_tokens=3)
    assert SpeculativeSetup.from_vllm_config(_config(3, mtp)).prefill_backoff == 2
    eagle = SimpleNamespace(method="eagle", num_speculative_tokens=3)
    setup = SpeculativeSetup.from_vllm_config(_config(1, eagle))
    assert (setup.prefill_backoff, setup.draft_lookahead, setup.enabled) == (0, 1, True)
    assert SpeculativeSetup.from_vllm_config(_config(0, hybrid=True)).prefill_backoff == 1
    assert not SpeculativeSetup.from_vllm_config(_config(0)).enabled


# ------------------------------------------------------------------ vLLM's real configs
@pytest.fixture(scope="module")
def tiny_models() -> tuple[Path, Path]:
    from turbowire.models import ensure_tiny_eagle, ensure_tiny_llama

    target = ensure_tiny_llama()
    return target, ensure_tiny_eagle(target)


def _vllm_config(model: Path, speculative: dict | None):
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=str(model), speculative_config=speculative, max_model_len=512,
                      enforce_eager=True, block_size=32)
    return args.create_engine_config()


def test_real_configs_eagle_and_ngram(tiny_models):
    from turbowire.connector.compat import speculative_factors
    from turbowire.connector.spec import draft_layer_predicate

    target, draft = tiny_models
    eagle = _vllm_config(target, {"method": "eagle", "model": str(draft),
                                  "num_speculative_tokens": 3})
    factors = speculative_factors(eagle)
    assert factors is not None and factors["method"] == "eagle"
    assert factors["model"] == str(draft) and factors["kv_cache_dtype"] == "auto"
    setup = SpeculativeSetup.from_vllm_config(eagle)
    assert (setup.method, setup.num_speculative_tokens) == ("eagle", 3)
    assert (setup.draft_lookahead, setup.prefill_backoff) == (1, 0)
    is_draft = draft_layer_predicate(eagle)
    assert is_draft("model.layers.2.self_attn.attn")
    assert not is_draft("model.layers.1.self_attn.attn")
    ngram = _vllm_config(target, {"method": "ngram", "num_speculative_tokens": 3,
                                  "prompt_lookup_max": 4})
    assert speculative_factors(ngram) is None  # no draft KV: the prefill engine may run plain
    setup = SpeculativeSetup.from_vllm_config(ngram)
    assert (setup.method, setup.draft_lookahead, setup.prefill_backoff) == ("ngram", 0, 0)
