"""The store path's logic with an in-memory blob store and a fake directory (the real LMCache
tiers and Redis are tested in tests/integration/test_store_*.py and the e2e suite):
lookups and their counts, which chunks are saved when, the load plan vLLM's allocation gets,
and the worker's save -> load round trip into real paged CPU caches (bit-exact with ``raw``),
a tail-only load after a non-chunk-aligned prefix hit, and misses/corruption reported as load
errors from the first bad chunk on, nothing of it decoded."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch

from turbowire.codec import Codec
from turbowire.connector.config import TurboWireConfig
from turbowire.connector.geometry import KVGeometry, LayerSpec
from turbowire.connector.metadata import StoreChunk, StoreLoad, StoreSave
from turbowire.connector.stats import TurboWireConnectorStats, iter_counters
from turbowire.connector.store_scheduler import StorePlanner
from turbowire.connector.store_worker import StoreWorker
from turbowire.kernels import LatentPages, PagedKVLayout
from turbowire.store.directory import DirectoryUnavailable
from turbowire.store.keys import StoreScope, chunk_hashes

BS, CHUNK, LAYERS, HEADS, DIM, NUM_BLOCKS = 16, 64, 3, 2, 64, 64


def counters(stats: TurboWireConnectorStats) -> dict[tuple, float]:
    return {(n, tuple(sorted(lbl.items()))): v for n, lbl, v in iter_counters(stats.data)}


def count(stats, name: str, **labels) -> float:
    return sum(v for (n, lbl), v in counters(stats).items()
               if n == name and all((k, labels[k]) in lbl for k in labels))


def make_scope(preset: str = "raw") -> StoreScope:
    return StoreScope("test", "tiny", preset, 1, CHUNK, 1)


def make_config(**kw) -> TurboWireConfig:
    base = dict(transport="store", store_local_cpu_bytes=1 << 20, store_chunk_tokens=CHUNK)
    return TurboWireConfig(**{**base, **kw})


def fake_request(req_id: str, tokens: list[int], computed: int = 0, params=None):
    """vLLM's own Request (the fields the planner reads: tokens, outputs, computed, params)."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    request = Request(req_id, list(tokens), SamplingParams(max_tokens=64, temperature=0), None)
    request.num_computed_tokens = computed
    request.kv_transfer_params = params
    return request


@dataclass
class FakeDirectory:
    stored: dict[bytes, int] = field(default_factory=dict)
    down: bool = False
    lookups: int = 0
    forgotten: list[bytes] = field(default_factory=list)
    touched: list[bytes] = field(default_factory=list)

    def longest_prefix(self, scope, hashes) -> int:
        self.lookups += 1
        if self.down:
            raise DirectoryUnavailable("redis is down")
        n = 0
        while n < len(hashes) and hashes[n] in self.stored:
            n += 1
        return n

    def publish(self, scope, entries) -> None:
        if self.down:
            raise DirectoryUnavailable("redis is down")
        for h, _rank, nbytes in entries:
            self.stored[h] = nbytes

    def touch(self, scope, hashes) -> None:
        self.touched.extend(hashes)

    def forget(self, scope, hashes) -> None:
        self.forgotten.extend(hashes)
        for h in hashes:
            self.stored.pop(h, None)

    def register_engine(self, entry, ttl_seconds) -> None:
        pass

    def close(self) -> None:
        pass


def planner(directory=None, **kw) -> tuple[StorePlanner, TurboWireConnectorStats]:
    stats = TurboWireConnectorStats()
    blocks = {"r": list(range(100, 100 + NUM_BLOCKS))}
    p = StorePlanner(make_config(**kw), make_scope(), BS, "engine-a", stats,
                     lambda rid: blocks.get(rid, list(range(NUM_BLOCKS))),
                     directory=directory or FakeDirectory())
    return p, stats


def alloc(block_ids):
    return SimpleNamespace(blocks=[[SimpleNamespace(block_id=b) for b in block_ids]])


# ---------------------------------------------------------------------------- scheduler side
def test_lookup_counts_only_full_stored_leading_chunks():
    tokens = list(range(5, 5 + 3 * CHUNK + 10))
    directory = FakeDirectory()
    h = chunk_hashes(tokens, CHUNK)
    directory.stored = {h[0]: 1, h[1]: 1}  # chunk 2 missing
    p, stats = planner(directory)
    req = fake_request("r", tokens)
    assert p.lookup(req, 0) == 2 * CHUNK
    assert p.lookup(req, 0) == 2 * CHUNK and directory.lookups == 1, "cached per request"
    assert p.lookup(req, 2 * BS) == 2 * CHUNK - 2 * BS  # vLLM's prefix cache had 2 blocks
    assert count(stats, "store_lookups", result="miss") == 1  # chunk 2 (the tail is no chunk)


def test_lookup_with_directory_down_is_a_counted_miss():
    directory = FakeDirectory(down=True)
    p, stats = planner(directory)
    assert p.lookup(fake_request("r", list(range(2 * CHUNK))), 0) == 0
    assert count(stats, "store_failures", operation="lookup", reason="store_unavailable") == 1


def test_local_index_answers_without_a_directory():
    p = StorePlanner(make_config(), make_scope(), BS, "e", TurboWireConnectorStats(),
                     lambda rid: list(range(NUM_BLOCKS)), directory=None)
    tokens = list(range(2 * CHUNK))
    p.note_stored({chunk_hashes(tokens, CHUNK)[0].hex(): 1})
    assert p.lookup(fake_request("r", tokens), 0) == CHUNK


def test_after_alloc_plans_chunks_from_the_local_prefix():
    tokens = list(range(3 * CHUNK))
    directory = FakeDirectory()
    directory.stored = dict.fromkeys(chunk_hashes(tokens, CHUNK), 1)
    p, _ = planner(directory)
    req = fake_request("r", tokens)
    local = 5 * BS  # 80 tokens: inside chunk 1
    n = p.lookup(req, local)
    assert n == 3 * CHUNK - local
    p.after_alloc(req, alloc(range(10, 10 + 3 * CHUNK // BS)), n)
    (load,) = p.take_loads()
    assert load.first_token == local
    assert [c.token_start for c in load.chunks] == [CHUNK, 2 * CHUNK]
    assert load.block_ids[0] == 10 and p.is_store_load("r")


def test_after_alloc_refuses_a_plan_that_does_not_fit():
    tokens = list(range(2 * CHUNK))
    directory = FakeDirectory()
    directory.stored = dict.fromkeys(chunk_hashes(tokens, CHUNK), 1)
    p, _ = planner(directory)
    req = fake_request("r", tokens)
    n = p.lookup(req, 0)
    p.after_alloc(req, alloc(range(3)), n)  # too few blocks
    assert p.take_loads() == []
    p.after_alloc(req, alloc(range(2 * CHUNK // BS)), n + 1)  # more than stored
    assert p.take_loads() == []


def test_saves_follow_computation_skip_stored_and_dedupe():
    tokens = list(range(3 * CHUNK + 5))
    h = chunk_hashes(tokens, CHUNK)
    directory = FakeDirectory()
    directory.stored = {h[0]: 1}
    p, _ = planner(directory)
    req = fake_request("r", tokens)
    p.lookup(req, 0)
    req.num_computed_tokens = CHUNK  # chunk 0 loaded
    assert p.plan_saves({"r": CHUNK // 2}) == []  # chunk 1 not complete yet
    req.num_computed_tokens = CHUNK + CHUNK // 2
    (save,) = p.plan_saves({"r": CHUNK})  # computes up to 2.5 chunks: chunk 1 completes
    assert [c.token_start for c in save.chunks] == [CHUNK]
    assert save.chunks[0].chunk_hash == h[1]
    assert save.block_ids == list(range(100, 100 + 2 * CHUNK // BS))
    # another request with the same prefix does not encode chunk 1 again
    other = fake_request("o", tokens)
    p.lookup(other, 0)
    other.num_computed_tokens = 0
    saves = p.plan_saves({"o": 3 * CHUNK + 5})
    assert [c.token_start for s in saves for c in s.chunks] == [2 * CHUNK]


def test_opt_out_and_malformed_opt_out():
    tokens = list(range(2 * CHUNK))
    p, stats = planner()
    for rid, params in (("a", {"turbowire_store": False}), ("b", {"turbowire_store": "no"})):
        req = fake_request(rid, tokens, params=params)
        p.lookup(req, 0)
        assert p.plan_saves({rid: 2 * CHUNK}) == []
    assert count(stats, "failures", reason="bad_params") == 1


def test_failed_load_saves_again_from_the_bad_chunk():
    tokens = list(range(3 * CHUNK))
    directory = FakeDirectory()
    directory.stored = dict.fromkeys(chunk_hashes(tokens, CHUNK), 1)
    p, _ = planner(directory)
    req = fake_request("r", tokens)
    p.lookup(req, 0)
    p.load_failed("r", CHUNK)  # chunk 1 was bad: vLLM recomputes from token 256
    req.num_computed_tokens = CHUNK
    (save,) = p.plan_saves({"r": 2 * CHUNK})
    assert [c.token_start for c in save.chunks] == [CHUNK, 2 * CHUNK]


# ---------------------------------------------------------------------------- worker side
class MemoryStore:
    """ChunkStore's interface over a dict (puts complete at once, on this thread)."""

    def __init__(self) -> None:
        self.blobs: dict[tuple[bytes, int], bytes] = {}
        self.lock = threading.Lock()
        self.discarded: list[bytes] = []

    def put(self, scope, chunk_hash, rank, blob, on_done=None) -> bool:
        with self.lock:
            self.blobs[(chunk_hash, rank)] = bytes(blob)
        if on_done is not None:
            on_done(True, None)
        return True

    def get(self, scope, chunk_hash, rank):
        with self.lock:
            return self.blobs.get((chunk_hash, rank))

    def contains_local(self, scope, chunk_hash, rank) -> bool:
        return (chunk_hash, rank) in self.blobs

    def discard(self, scope, chunk_hash, rank) -> None:
        with self.lock:
            self.blobs.pop((chunk_hash, rank), None)
        self.discarded.append(chunk_hash)

    def close(self) -> None:
        pass


@dataclass
class Caches:
    """The part of EngineCaches the store worker uses: CPU paged caches (LBHNC, K|V packed; or
    an MLA model's row tables, ``latent_caches``)."""

    tensors: list[torch.Tensor]
    layouts: list[PagedKVLayout] | list[LatentPages]
    device: torch.device = torch.device("cpu")
    per_token: int = LAYERS * 2 * HEADS * DIM * 2  # dense bytes of a token, all layers

    def dense_bytes_per_token(self) -> int:
        return self.per_token

    def kv_scales(self, layer: int):
        return None


def make_caches(seed: int | None) -> Caches:
    g = torch.Generator().manual_seed(seed or 0)
    tensors = []
    for _ in range(LAYERS):
        t = torch.randn(NUM_BLOCKS, HEADS, BS, 2 * DIM, generator=g).to(torch.bfloat16)
        tensors.append(t if seed is not None else torch.zeros_like(t))
    return Caches(tensors, [PagedKVLayout.from_cache(t, head_dim=DIM) for t in tensors])


def worker(preset: str, caches: Caches, store: MemoryStore, directory=None):
    geometry = KVGeometry(tuple(LayerSpec(f"l.{i}", HEADS, DIM) for i in range(LAYERS)), BS,
                          "bfloat16")
    stats = TurboWireConnectorStats()
    w = StoreWorker(make_config(preset=preset), geometry, Codec(preset, DIM, LAYERS),
                    make_scope(preset), 0, caches, stats, store=store,
                    directory=directory or FakeDirectory())
    return w, stats


def wait_finished(w: StoreWorker, req_id: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while req_id not in w.results():
        assert time.monotonic() < deadline, "store load did not finish"
        time.sleep(0.01)


def tokens_of(caches: Caches, block_ids, start: int, n: int):
    out = []
    for layer in range(LAYERS):
        k, v = caches.layouts[layer].gather(caches.tensors[layer], block_ids, start, n)
        out.append((k, v))
    return out


def saved_chunks(preset: str, n_chunks: int):
    src = make_caches(seed=1)
    store, directory = MemoryStore(), FakeDirectory()
    w, stats = worker(preset, src, store, directory)
    src_blocks = list(range(0, n_chunks * CHUNK // BS))
    hashes = chunk_hashes(list(range(n_chunks * CHUNK)), CHUNK)
    chunks = [StoreChunk(i * CHUNK, h) for i, h in enumerate(hashes)]
    w.save([StoreSave("p", src_blocks, chunks)])
    assert len(store.blobs) == n_chunks and len(directory.stored) == n_chunks
    assert count(stats, "stored_bytes") == sum(len(b) for b in store.blobs.values())
    reports, stored = w.take_reports()
    assert stored == {h.hex(): 1 for h in hashes}
    return src, src_blocks, store, chunks


@pytest.mark.parametrize("preset", ["raw", "tq4"])
def test_save_then_load_into_other_blocks(preset):
    src, src_blocks, store, chunks = saved_chunks(preset, 3)
    dst = make_caches(seed=None)
    dst_blocks = list(range(20, 20 + 3 * CHUNK // BS))
    w, stats = worker(preset, dst, store)
    w.start_loads([StoreLoad("d", dst_blocks, 0, chunks)])
    wait_finished(w, "d")
    assert w.take_invalid_blocks() == set()
    reports, _ = w.take_reports()
    assert reports["d"].tokens == 3 * CHUNK and reports["d"].failed is None
    assert reports["d"].source == "store"
    codec = Codec(preset, DIM, LAYERS)
    for layer, ((ks, vs), (kd, vd)) in enumerate(zip(
            tokens_of(src, src_blocks, 0, 3 * CHUNK), tokens_of(dst, dst_blocks, 0, 3 * CHUNK))):
        if preset == "raw":
            assert torch.equal(ks, kd) and torch.equal(vs, vd)
        else:  # equal to the reference codec's decode of the same tokens
            for c in range(3):
                sl = slice(c * CHUNK, (c + 1) * CHUNK)
                enc = codec.encode(layer, ks[sl], vs[sl], token_offset=c * CHUNK)
                kr, vr = codec.decode(layer, enc)
                assert torch.equal(kr.to(torch.bfloat16), kd[sl])
                assert torch.equal(vr.to(torch.bfloat16), vd[sl])
    assert count(stats, "store_lookups", result="hit") == 3


def test_only_real_loads_refresh_directory_entries():
    """Lookups never refresh an entry's TTL (a proxy probing prompts would keep other tenants'
    chunks alive); the worker does after it loaded them, once per engine (rank 0)."""
    tokens = list(range(2 * CHUNK))
    directory = FakeDirectory()
    directory.stored = dict.fromkeys(chunk_hashes(tokens, CHUNK), 1)
    p, _ = planner(directory)
    assert p.lookup(fake_request("r", tokens), 0) == 2 * CHUNK
    assert directory.touched == []
    _src, _blocks, store, chunks = saved_chunks("raw", 2)
    w, _ = worker("raw", make_caches(seed=None), store, directory)
    w.start_loads([StoreLoad("d", list(range(2 * CHUNK // BS)), 0, chunks)])
    wait_finished(w, "d")
    assert directory.touched == [c.chunk_hash for c in chunks]


def test_the_redis_read_bound_is_the_largest_blob():
    _src, _blocks, store, _chunks = saved_chunks("tq4", 2)
    w, _ = worker("tq4", make_caches(seed=None), store)
    assert w.max_blob_nbytes() == max(len(b) for b in store.blobs.values())


def test_load_after_a_prefix_hit_writes_only_the_tail():
    src, src_blocks, store, chunks = saved_chunks("raw", 2)
    dst = make_caches(seed=7)  # "stale" values everywhere
    before = [t.clone() for t in dst.tensors]
    dst_blocks = list(range(30, 30 + 2 * CHUNK // BS))
    first = 3 * BS  # vLLM holds blocks 0..2 of the request
    w, _ = worker("raw", dst, store)
    w.start_loads([StoreLoad("d", dst_blocks, first, chunks)])
    wait_finished(w, "d")
    reports, _ = w.take_reports()
    assert reports["d"].tokens == 2 * CHUNK - first
    for layer in range(LAYERS):
        held = dst_blocks[:3]
        assert torch.equal(dst.tensors[layer][held], before[layer][held]), "cached blocks kept"
    for (ks, vs), (kd, vd) in zip(tokens_of(src, src_blocks, first, 2 * CHUNK - first),
                                  tokens_of(dst, dst_blocks, first, 2 * CHUNK - first)):
        assert torch.equal(ks, kd) and torch.equal(vs, vd)


@pytest.mark.parametrize("damage", ["missing", "flip", "truncate", "other_chunk"])
def test_bad_chunk_reports_load_errors_from_there_and_is_not_decoded(damage):
    src, src_blocks, store, chunks = saved_chunks("raw", 3)
    bad = chunks[1]
    key = (bad.chunk_hash, 0)
    if damage == "missing":
        del store.blobs[key]
    elif damage == "flip":
        blob = bytearray(store.blobs[key])
        blob[len(blob) // 2] ^= 1
        store.blobs[key] = bytes(blob)
    elif damage == "truncate":
        store.blobs[key] = store.blobs[key][:-16]
    else:
        store.blobs[key] = store.blobs[(chunks[2].chunk_hash, 0)]
    dst = make_caches(seed=None)
    dst_blocks = list(range(10, 10 + 3 * CHUNK // BS))
    directory = FakeDirectory()
    w, stats = worker("raw", dst, store, directory)
    w.start_loads([StoreLoad("d", dst_blocks, 0, chunks)])
    wait_finished(w, "d")
    per_chunk = CHUNK // BS
    assert w.take_invalid_blocks() == set(dst_blocks[per_chunk:])
    reports, _ = w.take_reports()
    assert reports["d"].tokens == CHUNK and reports["d"].failed is not None
    for layer in range(LAYERS):
        assert not dst.tensors[layer][dst_blocks[per_chunk:]].any(), "bad chunk not decoded"
        assert dst.tensors[layer][dst_blocks[:per_chunk]].any()
    assert directory.forgotten == [bad.chunk_hash]
    assert count(stats, "store_failures", operation="load") == 1
    assert count(stats, "store_lookups", result="miss") == 1
    # the chunk that loaded is kept alive; one that is there but wrong is removed (puts never
    # overwrite, so a recomputed save could not replace it otherwise)
    assert directory.touched == [chunks[0].chunk_hash]
    assert store.discarded == ([] if damage == "missing" else [bad.chunk_hash])


def test_a_failed_load_is_not_offered_again():
    """vLLM asks again after a failed load (num_computed rolled back): the store must not offer
    the bad chunks again, or the request would loop load -> fail -> load."""
    tokens = list(range(2 * CHUNK + 3))
    directory = FakeDirectory()
    directory.stored = dict.fromkeys(chunk_hashes(tokens, CHUNK), 1)
    p, _ = planner(directory)
    req = fake_request("r", tokens)
    n = p.lookup(req, 0)
    p.after_alloc(req, alloc(range(2 * CHUNK // BS + 1)), n)
    p.load_failed("r", 0)  # the first chunk was bad
    assert p.lookup(req, 0) == 0
    req2 = fake_request("s", tokens)
    n = p.lookup(req2, 0)
    p.after_alloc(req2, alloc(range(2 * CHUNK // BS + 1)), n)
    p.load_failed("s", CHUNK)  # the second was bad: the first may still be loaded
    assert p.lookup(req2, 0) == CHUNK
    p.after_alloc(req2, alloc(range(2 * CHUNK // BS + 1)), CHUNK)
    assert p.lookup(req2, 0) == 0, "no third load"


def test_registration_is_retried_at_once_after_a_failure():
    """Redis restarted (empty): the engine's registry entry must be back within a maintenance
    tick, not a whole registration period later."""
    class Registry(FakeDirectory):
        calls: int = 0

        def register_engine(self, entry, ttl_seconds) -> None:
            self.calls += 1
            if self.down:
                raise DirectoryUnavailable("redis is down")

    @dataclass
    class Record:
        model: str = "tiny"

    directory = Registry(down=True)
    p, _ = planner(directory)
    record = Record()
    p.maintain("kv_both", "127.0.0.1:5700", record)
    directory.down = False
    p.maintain("kv_both", "127.0.0.1:5700", record)
    assert directory.calls == 2
    p.maintain("kv_both", "127.0.0.1:5700", record)
    assert directory.calls == 2, "after a success, once per period"


def test_a_save_that_never_landed_is_planned_again_later(monkeypatch):
    """A save dropped while Redis was down must not block that chunk forever."""
    import turbowire.connector.store_scheduler as mod

    tokens = list(range(CHUNK))
    p, _ = planner()
    first = fake_request("a", tokens)
    p.lookup(first, 0)
    assert len(p.plan_saves({"a": CHUNK})) == 1
    second = fake_request("b", tokens)
    p.lookup(second, 0)
    assert p.plan_saves({"b": CHUNK}) == [], "another request is saving it right now"
    monkeypatch.setattr(mod, "SAVE_PENDING_SECONDS", 0.0)
    third = fake_request("c", tokens)
    p.lookup(third, 0)
    assert len(p.plan_saves({"c": CHUNK})) == 1


# ---------------------------------------------------------------------------- MLA latents
LATENT, ROPE, VECTOR = 512, 64, 128  # DeepSeek V2/V3's row; the codec's 128-wide vectors


def latent_caches(seed: int | None) -> Caches:
    """An MLA model's CPU caches: one [blocks, block_size, latent + rope] row table per layer."""
    g = torch.Generator().manual_seed(seed or 0)
    tensors = [torch.randn(NUM_BLOCKS, BS, LATENT + ROPE, generator=g).to(torch.bfloat16)
               for _ in range(LAYERS)]
    if seed is None:
        tensors = [torch.zeros_like(t) for t in tensors]
    return Caches(tensors, [LatentPages.from_cache(t, LATENT, ROPE) for t in tensors],
                  per_token=LAYERS * (LATENT + ROPE) * 2)


def latent_worker(preset: str, caches: Caches, store: MemoryStore):
    geometry = KVGeometry(tuple(LayerSpec(f"l.{i}", LATENT // VECTOR, VECTOR, rope_dim=ROPE)
                                for i in range(LAYERS)), BS, "bfloat16")
    assert all(layer.is_latent for layer in geometry.layers)
    return StoreWorker(make_config(preset=preset), geometry, Codec(preset, VECTOR, LAYERS),
                       make_scope(preset), 0, caches, TurboWireConnectorStats(), store=store,
                       directory=FakeDirectory())


@pytest.mark.parametrize("preset", ["raw", "tq4"])
def test_mla_latent_rows_go_through_the_store(preset):
    """Each stored chunk holds every layer's latent chunk (the latent coded with the preset's
    key stream, the RoPE part raw); a load writes exactly what the reference decodes."""
    from turbowire.codec.latent import decode_latent, encode_latent, latent_nbytes

    src, store = latent_caches(1), MemoryStore()
    saver = latent_worker(preset, src, store)
    src_blocks = list(range(3 * CHUNK // BS))
    chunks = [StoreChunk(i * CHUNK, h)
              for i, h in enumerate(chunk_hashes(list(range(3 * CHUNK)), CHUNK))]
    saver.save([StoreSave("p", src_blocks, chunks)])
    codec = Codec(preset, VECTOR, LAYERS)
    for c in chunks:  # the blob's layers are latent chunks of the codec's size
        assert saver.layer_nbytes(c.token_start) == [
            latent_nbytes(codec, layer, CHUNK, LATENT, ROPE, c.token_start)
            for layer in range(LAYERS)]

    dst = latent_caches(None)
    dst_blocks = list(range(20, 20 + 3 * CHUNK // BS))
    loader = latent_worker(preset, dst, store)
    loader.start_loads([StoreLoad("d", dst_blocks, 0, chunks)])
    wait_finished(loader, "d")
    assert loader.take_invalid_blocks() == set()
    reports, _ = loader.take_reports()
    assert reports["d"].tokens == 3 * CHUNK and reports["d"].failed is None
    for layer in range(LAYERS):
        pages = src.layouts[layer]
        for c in chunks:
            latent, rope = pages.gather(src.tensors[layer], src_blocks, c.token_start, CHUNK)
            got = pages.gather(dst.tensors[layer], dst_blocks, c.token_start, CHUNK)
            want = decode_latent(codec, layer, encode_latent(codec, layer, latent, rope,
                                                             token_offset=c.token_start),
                                 LATENT, ROPE)
            assert torch.equal(got[0], want[0].to(torch.bfloat16))
            assert torch.equal(got[1], rope)  # the RoPE part crosses raw
            if preset == "raw":
                assert torch.equal(got[0], latent)


def test_a_damaged_latent_chunk_is_refused_before_anything_is_written():
    src, store = latent_caches(1), MemoryStore()
    chunks = [StoreChunk(i * CHUNK, h)
              for i, h in enumerate(chunk_hashes(list(range(2 * CHUNK)), CHUNK))]
    latent_worker("tq4", src, store).save([StoreSave("p", list(range(2 * CHUNK // BS)),
                                                     chunks)])
    key = (chunks[1].chunk_hash, 0)
    blob = bytearray(store.blobs[key])
    blob[-20] ^= 1  # the last layer's RoPE rows: only its body checksum can tell
    store.blobs[key] = bytes(blob)
    dst = latent_caches(None)
    dst_blocks = list(range(10, 10 + 2 * CHUNK // BS))
    loader = latent_worker("tq4", dst, store)
    loader.start_loads([StoreLoad("d", dst_blocks, 0, chunks)])
    wait_finished(loader, "d")
    per_chunk = CHUNK // BS
    assert loader.take_invalid_blocks() == set(dst_blocks[per_chunk:])
    reports, _ = loader.take_reports()
    assert reports["d"].tokens == CHUNK and "checksum" in str(reports["d"].failed)
    for layer in range(LAYERS):  # no layer of the bad chunk written, the good one all
        assert not dst.tensors[layer][dst_blocks[per_chunk:]].any()
        assert dst.tensors[layer][dst_blocks[:per_chunk]].any()


def test_a_latent_load_after_a_prefix_hit_writes_only_the_tail():
    src, store = latent_caches(1), MemoryStore()
    src_blocks = list(range(2 * CHUNK // BS))
    chunks = [StoreChunk(i * CHUNK, h)
              for i, h in enumerate(chunk_hashes(list(range(2 * CHUNK)), CHUNK))]
    latent_worker("raw", src, store).save([StoreSave("p", src_blocks, chunks)])
    dst = latent_caches(7)  # "stale" rows everywhere
    before = [t.clone() for t in dst.tensors]
    dst_blocks = list(range(30, 30 + 2 * CHUNK // BS))
    first = 3 * BS  # vLLM holds blocks 0..2 of the request, inside the first chunk
    loader = latent_worker("raw", dst, store)
    loader.start_loads([StoreLoad("d", dst_blocks, first, chunks)])
    wait_finished(loader, "d")
    reports, _ = loader.take_reports()
    assert reports["d"].tokens == 2 * CHUNK - first and reports["d"].failed is None
    for layer in range(LAYERS):
        held = dst_blocks[:3]
        assert torch.equal(dst.tensors[layer][held], before[layer][held]), "cached blocks kept"
        pages = src.layouts[layer]
        want = pages.gather(src.tensors[layer], src_blocks, first, 2 * CHUNK - first)
        got = pages.gather(dst.tensors[layer], dst_blocks, first, 2 * CHUNK - first)
        assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
