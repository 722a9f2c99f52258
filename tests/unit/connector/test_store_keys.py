"""Store chunk keys carry what vLLM's prefix cache keys on (issue 33, H1), checked against vLLM's
own ``Request`` objects and its own block hasher (``vllm/v1/core/kv_cache_utils.py``):

- equal inputs give equal keys; another ``cache_salt``, LoRA adapter (name or path) or image
  gives other keys, from the first chunk the difference touches on;
- over a grid of requests, two chunks share a key exactly when vLLM's block hashes at the
  chunk's end are equal (KV is reused only where vLLM itself would reuse it, and wherever it
  would);
- prompt embeddings are refused (``store_unsupported_input``): the planner neither looks them
  up nor saves them, and counts the fallback;
- the chain's version moved to v2: keys of the token-only chain are never produced again.
"""

from __future__ import annotations

import hashlib
import itertools

import pytest
import torch

from turbowire.connector.config import TurboWireConfig
from turbowire.connector.stats import TurboWireConnectorStats, iter_counters
from turbowire.connector.store_scheduler import UNSUPPORTED_REASON, StorePlanner
from turbowire.store.keys import (
    CHAIN_VERSION,
    ROOT_HASH,
    ChainInputs,
    MMSpan,
    StoreKeyError,
    StoreScope,
    UnsupportedStoreInput,
    chain_inputs_of,
    chunk_hashes,
    extend_chunk_hashes,
)

BLOCK, CHUNK = 16, 64  # 4 vLLM blocks per chunk
N = 4 * CHUNK + 10


def request(req_id: str = "r", tokens: list[int] | None = None, *, salt: str | None = None,
            lora: tuple[str, str, int] | None = None, mm: list[tuple[str, int, int]] = (),
            hasher=None, embeds: bool = False):
    """vLLM's own Request with a salt, a LoRA adapter (name, path, int id) and images
    (identifier, offset, length)."""
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.v1.request import Request

    tokens = list(range(1000, 1000 + N)) if tokens is None else tokens
    features = [MultiModalFeatureSpec(data=None, modality="image", identifier=ident,
                                      mm_position=PlaceholderRange(offset=off, length=length))
                for ident, off, length in mm]
    return Request(
        req_id, None if embeds else tokens, SamplingParams(max_tokens=8), None,
        prompt_embeds=torch.zeros(len(tokens), 8) if embeds else None,
        mm_features=features or None,
        lora_request=LoRARequest(lora[0], lora[2], lora[1]) if lora else None,
        cache_salt=salt, block_hasher=hasher,
    )


def keys(req) -> list[bytes]:
    return chunk_hashes(req.prompt_token_ids, CHUNK, inputs=chain_inputs_of(req))


def test_equal_inputs_equal_keys():
    kw = dict(salt="tenant-a", lora=("ad", "/adapters/ad", 1), mm=[("img-1", 70, 40)])
    assert keys(request("x", **kw)) == keys(request("y", **kw))
    assert len(keys(request(**kw))) == 4
    # vLLM's lora_int_id is a per-engine counter: not part of the key (vLLM ignores it too)
    assert keys(request(lora=("ad", "/p", 1))) == keys(request(lora=("ad", "/p", 7)))
    # an empty salt is no salt (vLLM mixes only a non-empty one)
    assert ChainInputs(cache_salt="") == ChainInputs()


@pytest.mark.parametrize("a,b", [
    (dict(salt="tenant-a"), dict(salt="tenant-b")),
    (dict(salt="tenant-a"), dict()),
    (dict(lora=("ad-a", "/adapters/a", 1)), dict(lora=("ad-b", "/adapters/a", 1))),
    (dict(lora=("ad-a", "/adapters/a", 1)), dict(lora=("ad-a", "/adapters/a2", 1))),
    (dict(lora=("ad-a", "/adapters/a", 1)), dict()),
    (dict(salt="s", lora=None), dict(salt=None, lora=("s", "s", 1))),
])
def test_salt_and_adapter_change_every_chunk(a, b):
    ka, kb = keys(request(**a)), keys(request(**b))
    assert len(ka) == len(kb) == 4
    assert all(x != y for x, y in zip(ka, kb, strict=True))


def test_another_image_changes_the_chunks_it_overlaps_and_all_after():
    # the image fills tokens 70..109: chunk 1 (64..127); chunk 0 is shared
    a = keys(request(mm=[("img-A", 70, 40)]))
    b = keys(request(mm=[("img-B", 70, 40)]))
    plain = keys(request())
    assert a[0] == b[0] == plain[0]
    assert all(x != y for x, y in zip(a[1:], b[1:], strict=True))
    assert all(x != y for x, y in zip(a[1:], plain[1:], strict=True))
    # the same image at another place in the same tokens is another key
    assert keys(request(mm=[("img-A", 72, 40)]))[1] != a[1]
    # an image spanning two chunks is mixed into both
    span = keys(request(mm=[("img-A", 100, 60)]))
    assert span[0] == plain[0] and span[1] != plain[1] and span[2] != plain[2]


def test_prompt_embeds_are_refused():
    with pytest.raises(UnsupportedStoreInput) as info:
        chain_inputs_of(request(embeds=True))
    assert info.value.reason == UNSUPPORTED_REASON == "store_unsupported_input"


def test_chain_version_is_part_of_every_key():
    assert CHAIN_VERSION == 2
    v1_root = hashlib.sha256(b"turbowire/store/chunk-chain/v1").digest()[:16]
    assert ROOT_HASH != v1_root
    tokens = list(range(CHUNK))
    v1_first = hashlib.sha256(v1_root + torch.tensor(tokens, dtype=torch.int32)
                              .numpy().astype("<u4").tobytes()).digest()[:16]
    assert chunk_hashes(tokens, CHUNK) != [v1_first]


def test_chain_grows_with_outputs_under_the_same_inputs():
    inputs = ChainInputs(cache_salt="s", mm=(MMSpan("img", 60, 10),))
    tokens = list(range(3 * CHUNK))
    grown = extend_chunk_hashes(chunk_hashes(tokens[:CHUNK + 5], CHUNK, inputs=inputs), tokens,
                                CHUNK, inputs)
    assert grown == chunk_hashes(tokens, CHUNK, inputs=inputs)


def test_bad_inputs_are_key_errors():
    for bad in (dict(cache_salt=5), dict(lora_path="/p"), dict(mm=[MMSpan("a", 1, 1)]),
                dict(cache_salt="x" * 5000)):
        with pytest.raises(StoreKeyError):
            ChainInputs(**bad)
    for bad in (("", 0, 1), ("a", -1, 1), ("a", 0, 1 << 40), ("a", True, 1)):
        with pytest.raises(StoreKeyError):
            MMSpan(*bad)


def test_keys_agree_with_vllms_own_block_hashes():
    """Two requests share chunk i exactly when vLLM's block hash at the chunk's last block is
    equal (that hash chains every earlier block and all extra keys)."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK, sha256)
    base = list(range(1000, 1000 + N))
    other_tail = base[:CHUNK * 2 + 3] + [7] * (N - CHUNK * 2 - 3)  # differs from token 131
    variants = []
    for tokens, salt, lora, mm in itertools.product(
        (base, other_tail),
        (None, "a", "b"),
        (None, ("ad", "/p", 1), ("ad", "/q", 2)),
        ([], [("img-A", 70, 40)], [("img-B", 70, 40)], [("img-A", 150, 40)],
         [("img-A", 10, 20), ("img-C", 200, 30)]),
    ):
        variants.append(request(tokens=tokens, salt=salt, lora=lora, mm=mm, hasher=hasher))
    blocks_per_chunk = CHUNK // BLOCK
    ours = [keys(r) for r in variants]
    theirs = [[r.block_hashes[(i + 1) * blocks_per_chunk - 1] for i in range(len(k))]
              for r, k in zip(variants, ours, strict=True)]
    shared = 0
    for (ko, kv), (lo, lv) in itertools.combinations(zip(ours, theirs, strict=True), 2):
        for i in range(len(ko)):
            assert (ko[i] == lo[i]) == (kv[i] == lv[i]), i
            shared += ko[i] == lo[i]
    assert shared > 0, "the grid must contain shared chunks too"


# -- the planner (scheduler side) ------------------------------------------------------------


class Dir:
    def __init__(self, stored: set[bytes]) -> None:
        self.stored, self.lookups = stored, 0

    def longest_prefix(self, scope, hashes) -> int:
        self.lookups += 1
        n = 0
        while n < len(hashes) and hashes[n] in self.stored:
            n += 1
        return n

    def close(self) -> None:
        pass


def planner(stored: set[bytes]) -> tuple[StorePlanner, TurboWireConnectorStats, Dir]:
    stats = TurboWireConnectorStats()
    directory = Dir(stored)
    config = TurboWireConfig(transport="store", store_local_cpu_bytes=1 << 20,
                             store_chunk_tokens=CHUNK)
    p = StorePlanner(config, StoreScope("t", "m", "raw", 1, CHUNK, 1), BLOCK, "e", stats,
                     lambda rid: list(range(64)), directory=directory)
    return p, stats, directory


def fallbacks(stats: TurboWireConnectorStats, reason: str) -> float:
    return sum(v for n, lbl, v in iter_counters(stats.data)
               if n == "fallbacks" and lbl.get("reason") == reason)


def test_planner_looks_up_under_the_requests_salt():
    stored = set(keys(request(salt="tenant-a")))
    p, _, _ = planner(stored)
    assert p.lookup(request("a", salt="tenant-a"), 0) == 4 * CHUNK
    assert p.lookup(request("b", salt="tenant-b"), 0) == 0
    assert p.lookup(request("c"), 0) == 0
    assert p.lookup(request("d", lora=("tenant-a", "x", 1)), 0) == 0


def test_planner_skips_prompt_embeds_and_counts_once():
    p, stats, directory = planner(set())
    req = request("e", embeds=True)
    for _ in range(3):  # vLLM asks again on every scheduling attempt
        assert p.lookup(req, 0) == 0
    p.track_decode(req, 0)
    assert directory.lookups == 0
    assert fallbacks(stats, "store_unsupported_input") == 1
    req.num_computed_tokens = N
    assert p.plan_saves({"e": N}) == []
    p.finished("e")  # forgotten: a new request under that id is looked at (and counted) anew
    assert p.lookup(request("e", embeds=True), 0) == 0
    assert fallbacks(stats, "store_unsupported_input") == 2


def test_planner_saves_under_the_requests_inputs():
    p, _, _ = planner(set())
    req = request("s", salt="tenant-a", mm=[("img", 70, 40)])
    assert p.lookup(req, 0) == 0
    req.num_computed_tokens = 0
    saves = p.plan_saves({"s": N})
    assert [c.chunk_hash for c in saves[0].chunks] == keys(req)
