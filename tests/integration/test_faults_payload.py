"""Corrupt and truncated P2P payloads with real components (issue 17, fault matrix part 2).

The connector's own data path without vLLM engines, as in test_connector_nixl_roundtrip.py: a
prefill scheduler+worker encode a request's paged KV into their real NIXL-registered staging
pool and lease it over the real gRPC side channel; a decode scheduler+worker handshake, claim,
READ over UCX and decode into their own paged cache. Between the prefill engine's encode and the
decode engine's READ each test damages the staged bytes the way a bad disk, a buggy peer or a
reused slot would: bit flips in the header, the codes, the norms (scales), the centring mean and
the sink rows; a size field rewritten with a valid header checksum (truncation); a chunk cut off
half way; and well-formed chunks of another request, another layer or another block copied in.

Each case checks that the decode side:
- detects it (the chunk's checksum, format or tag check) and the load lands in vLLM's failed set
  (vLLM then recomputes the prompt or fails the request, by ``load_failure_policy``);
- counts it by reason (``turbowire_kv_transfer_failures_total{reason}``: ``checksum`` for
  flipped bits, ``format`` for a chunk that is well formed but not the one expected);
- writes nothing into the destination blocks of a layer that had a bad chunk (a canary fill
  survives). With the READ pipelined per layer group, layers *before* the damaged one were
  already verified and decoded into the request's own blocks: those hold exactly the prefill
  engine's KV (checked bit for bit with ``raw``), never garbage, and vLLM frees or recomputes
  them with the failed request;
- leaks nothing: the prefill lease is released (staging back to 0 slots), the receive buffer is
  whole again and no load is left pending.

Each case prints ``FAULT|payload-<name>|<outcome>|<seconds to detection>|<leaked>``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
from test_connector_nixl_roundtrip import BS, LAYERS, NUM_BLOCKS, engine, request
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.request import RequestStatus

from turbowire.connector.stats import iter_counters

pytestmark = pytest.mark.integration

N = 100  # 3 full blocks of 32 tokens + 4: the last block is partial
P_BLOCKS = {"A": [5, 9, 2, 30], "B": [6, 10, 3, 31]}  # two prefill requests, other contents
D_BLOCKS = [11, 12, 13, 14]
CANARY = 3.0  # every decode-side cache element before a load (bf16-exact)


class Manager:
    """The prefill engine's KV cache manager, as the scheduler asks it for a request's blocks."""

    def __init__(self) -> None:
        self.blocks: dict[str, list[int]] = {}

    def get_blocks(self, req_id: str) -> SimpleNamespace:
        return SimpleNamespace(blocks=([KVCacheBlock(i) for i in self.blocks[req_id]],))


@dataclass
class Pair:
    preset: str
    p_sched: object
    p_worker: object
    p_caches: dict[str, torch.Tensor]
    d_sched: object
    d_worker: object
    d_caches: dict[str, torch.Tensor]
    manager: Manager
    serial: int = 0

    def stage(self, which: str) -> tuple[str, dict]:
        """Prefill request ``which`` (A or B contents): encode it, finish it; its params."""
        self.serial += 1
        req_id = f"p-{which}-{self.serial}"
        self.manager.blocks[req_id] = P_BLOCKS[which]
        preq = request(req_id, N, {"do_remote_decode": True})
        self.p_sched.on_new_request(preq)
        for computed, scheduled in ((0, 40), (40, N - 40)):  # two steps (chunked prefill)
            preq.num_computed_tokens = computed
            meta = self.p_sched.build_connector_meta(
                SimpleNamespace(num_scheduled_tokens={req_id: scheduled}))
            for name in LAYERS:
                self.p_worker.save_kv_layer(name, self.p_caches[name], meta)
            self.p_worker.wait_for_save(meta)
        preq.num_computed_tokens = N
        preq.status = RequestStatus.FINISHED_LENGTH_CAPPED
        _, params = self.p_sched.request_finished(preq, P_BLOCKS[which])
        assert params["remote_num_tokens"] == N and len(params["remote_block_ids"]) == 4
        return req_id, params

    def chunk(self, slot: int, layer: int, block: int) -> tuple[int, int]:
        """(staging offset, size) of the chunk of request block ``block`` of ``layer``."""
        size = self.p_worker.chunk_nbytes(layer, min(BS, N - block * BS), block)
        return self.p_worker.layout.chunk_offset(slot, layer), size

    def load(self, params: dict) -> tuple[bool, bool, object, float]:
        """Decode side: match, allocate, load into D_BLOCKS; (finished, failed, its report,
        seconds from start_load_kv to the load's end)."""
        self.serial += 1
        req_id = f"d-{self.serial}"
        dreq = request(req_id, N, params)
        self.d_sched.on_new_request(dreq)
        count, is_async = self.d_sched.get_num_new_matched_tokens(dreq, 0)
        assert (count, is_async) == (N, True)
        blocks = [KVCacheBlock(b) for b in D_BLOCKS]
        self.d_sched.update_state_after_alloc(dreq, SimpleNamespace(blocks=(blocks,)), count)
        meta = self.d_sched.build_connector_meta(SimpleNamespace(num_scheduled_tokens={}))
        t0 = time.perf_counter()
        self.d_worker.start_load_kv(meta)
        finished: set[str] = set()
        failed: set[str] = set()
        deadline = time.monotonic() + 60
        while req_id not in finished and time.monotonic() < deadline:
            f, x = self.d_worker.get_transfer_results()
            finished |= f
            failed |= x
            time.sleep(0.002)
        seconds = time.perf_counter() - t0
        report = self.d_worker.take_reports().reports[req_id]
        dreq.status = RequestStatus.FINISHED_STOPPED
        self.d_sched.request_finished(dreq, D_BLOCKS)
        return req_id in finished, req_id in failed, report, seconds

    def failures(self) -> dict[str, float]:
        return {labels["reason"]: v for name, labels, v in iter_counters(self.d_worker.stats.data)
                if name == "failures"}

    def layer_untouched(self, layer: int) -> bool:
        cache = self.d_caches[LAYERS[layer]]
        return bool(torch.all(cache[D_BLOCKS] == CANARY))

    def layer_equals_prefill(self, layer: int) -> bool:
        """The decoded layer holds exactly the prefill engine's KV of request A (raw)."""
        d_lay, p_lay = self.d_worker.paged_layouts[layer], self.p_worker.paged_layouts[layer]
        name = LAYERS[layer]
        got = d_lay.gather(self.d_caches[name], D_BLOCKS, 0, N)
        want = p_lay.gather(self.p_caches[name], P_BLOCKS["A"], 0, N)
        return all(torch.equal(g, w) for g, w in zip(got, want, strict=True))

    def leaks(self) -> list[str]:
        """What is still held after the load ended (empty: nothing leaked)."""
        out = []
        deadline = time.monotonic() + 10
        while self.p_sched.pool.snapshot().used_slots and time.monotonic() < deadline:
            # the engine keeps stepping: a finished load's release goes out at the next step,
            # fire-and-forget on the decode worker's executor
            self.d_worker.get_transfer_results()
            time.sleep(0.02)
        snap = self.p_sched.pool.snapshot()
        if snap.used_slots or snap.leases:
            out.append(f"staging:{snap.used_slots}slots/{snap.leases}leases")
        ranges = self.d_worker.recv_ranges
        if ranges.free_bytes != ranges.capacity:
            out.append(f"recv:{ranges.capacity - ranges.free_bytes}B")
        if self.d_worker.loader.pending:
            out.append(f"loads:{self.d_worker.loader.pending}")
        return out

    def reset_decode_cache(self) -> None:
        for cache in self.d_caches.values():
            cache.fill_(CANARY)


PRESETS = ("tq4", "raw")


@pytest.fixture(scope="module")
def pair(request) -> Iterator[Pair]:
    """One prefill and one decode connector per preset, shared by the cases (NIXL agents and the
    side channel start once)."""
    from turbowire.connector.sidechannel.server import wait_port_free
    from turbowire.serving.launch import free_port

    preset = request.param
    p_port = free_port()
    p_sched, p_worker = engine(preset, p_port, f"P-faults-{preset}")
    d_sched, d_worker = engine(preset, free_port(), f"D-faults-{preset}")
    torch.manual_seed(0)
    p_caches = {n: torch.randn(NUM_BLOCKS, 2, BS, 2 * 64).to(torch.bfloat16) for n in LAYERS}
    d_caches = {n: torch.full((NUM_BLOCKS, 2, BS, 2 * 64), CANARY, dtype=torch.bfloat16)
                for n in LAYERS}
    try:
        p_worker.register_kv_caches(p_caches)
        d_worker.register_kv_caches(d_caches)
        p_sched.set_handshake_metadata({(0, 0): p_worker.handshake_metadata})
        manager = Manager()
        p_sched.bind_kv_cache_manager(manager)
        pair = Pair(preset, p_sched, p_worker, p_caches, d_sched, d_worker, d_caches, manager)
        # a clean load first: handshake and UCX connection made, the path works
        _, params = pair.stage("A")
        finished, failed, report, _ = pair.load(params)
        assert finished and not failed and report.failed is None
        if preset == "raw":
            assert all(pair.layer_equals_prefill(layer) for layer in range(len(LAYERS)))
        assert pair.leaks() == []
        yield pair
    finally:
        for obj in (d_worker, p_worker, d_sched, p_sched):
            obj.shutdown()
        wait_port_free("127.0.0.1", p_port)


# -- the damage -----------------------------------------------------------------------------------

Mutation = Callable[[Pair, dict], int]
"""mutate(pair, params of request A) -> the layer it damaged (staging bytes changed in place)."""


def _flip(pair: Pair, at: int, bit: int = 0x10) -> None:
    pair.p_worker.staging[at] ^= bit


def _section(pair: Pair, layer: int, block: int, stream: str, name: str) -> int:
    """Staging offset of section ``name`` of the K or V stream of a chunk of request A."""
    lay = pair.p_worker.codec.layout(layer, min(BS, N - block * BS), 2, block * BS)
    base = lay.k_offset if stream == "k" else lay.v_offset
    sections = (lay.k if stream == "k" else lay.v).sections
    if name not in sections:
        raise AssertionError(f"layer {layer} of {pair.preset} has no {stream}.{name} section")
    return base + sections[name][0]


def header_byte(offset: int, layer: int = 0) -> Mutation:
    def mutate(pair: Pair, params: dict) -> int:
        at, _ = pair.chunk(params["remote_block_ids"][1], layer, 1)
        _flip(pair, at + offset)
        return layer
    return mutate


def body_section(stream: str, name: str, layer: int = 0, block: int = 1) -> Mutation:
    def mutate(pair: Pair, params: dict) -> int:
        at, _ = pair.chunk(params["remote_block_ids"][block], layer, block)
        _flip(pair, at + _section(pair, layer, block, stream, name) + 3, 0x04)
        return layer
    return mutate


def truncated_size(layer: int = 0, consistent: bool = False) -> Mutation:
    """The header claims 16 body bytes fewer, with a *valid* header checksum; ``consistent``: the
    body checksum is recomputed over the shorter body too, so only the size can give it away."""
    from turbowire.codec.wire import HEADER_BYTES, parse_header, wsum32

    def mutate(pair: Pair, params: dict) -> int:
        at, size = pair.chunk(params["remote_block_ids"][1], layer, 1)
        staging = pair.p_worker.staging
        header = parse_header(staging[at : at + size].clone())
        body = header.body_nbytes - 16
        checksum = header.body_checksum
        if consistent:
            checksum = wsum32(staging[at + HEADER_BYTES : at + HEADER_BYTES + body].clone())
        forged = dataclasses.replace(header, body_nbytes=body, body_checksum=checksum).pack()
        staging[at : at + HEADER_BYTES] = torch.frombuffer(bytearray(forged), dtype=torch.uint8)
        return layer
    return mutate


def cut_off_half(layer: int = 0) -> Mutation:
    """The encode of the chunk stopped half way (the rest of the slot holds zeros)."""
    def mutate(pair: Pair, params: dict) -> int:
        at, size = pair.chunk(params["remote_block_ids"][1], layer, 1)
        pair.p_worker.staging[at + size // 2 : at + size] = 0
        return layer
    return mutate


def copied_from(source: str, layer: int = 0) -> Mutation:
    """A well-formed chunk that is not the one the decode engine asked for, copied over block 1
    of ``layer``: of request B (a slot reused by another request), of another layer, or of
    another block of the same request (a wrong slot id)."""
    def mutate(pair: Pair, params: dict) -> int:
        dst_slot = params["remote_block_ids"][1]
        dst, size = pair.chunk(dst_slot, layer, 1)
        if source == "other-request":
            _, other = pair.stage("B")
            src, src_size = pair.chunk(other["remote_block_ids"][1], layer, 1)
            pair.p_sched.pool.release([other["remote_request_id"]])  # B's lease is not the test
        elif source == "other-layer":
            src, src_size = pair.chunk(dst_slot, (layer + 1) % len(LAYERS), 1)
        else:  # other block: block 2 has 32 tokens too, at another position with another tag
            src, src_size = pair.chunk(params["remote_block_ids"][2], layer, 2)
        staging = pair.p_worker.staging
        n = min(size, src_size)
        staging[dst : dst + n] = staging[src : src + n].clone()
        return layer
    return mutate


LAST = len(LAYERS) - 1
CASES: dict[str, tuple[Mutation, str]] = {
    # name: (damage, the reason the decode side must count)
    "header-magic": (header_byte(0), "format"),
    "header-token-count": (header_byte(20), "checksum"),
    "header-tag": (header_byte(32), "checksum"),
    "header-checksum": (header_byte(44), "checksum"),
    "k-codes": (body_section("k", "codes"), "checksum"),
    "v-codes": (body_section("v", "codes"), "checksum"),
    "k-norms": (body_section("k", "scales"), "checksum"),
    "v-norms": (body_section("v", "scales"), "checksum"),
    "k-mean": (body_section("k", "mean"), "checksum"),
    "k-sink": (body_section("k", "sink", block=0), "checksum"),
    "raw-data": (body_section("k", "data"), "checksum"),
    "truncated-size": (truncated_size(), "checksum"),
    "truncated-size-consistent": (truncated_size(consistent=True), "format"),
    "cut-off-half": (cut_off_half(), "checksum"),
    "other-request": (copied_from("other-request"), "format"),
    "other-layer": (copied_from("other-layer"), "format"),
    "other-block": (copied_from("other-block"), "format"),
    "last-layer-codes": (body_section("k", "codes", layer=LAST), "checksum"),
    "last-layer-other-request": (copied_from("other-request", layer=LAST), "format"),
}


LLOYD_ONLY = {"k-codes", "v-codes", "k-norms", "v-norms", "k-mean", "k-sink", "last-layer-codes"}
RAW_ONLY = {"raw-data"}


def _applies(preset: str, case: str) -> bool:
    return case not in (LLOYD_ONLY if preset == "raw" else RAW_ONLY)


@pytest.mark.parametrize(
    "pair,case",
    [(p, c) for p in PRESETS for c in sorted(CASES) if _applies(p, c)],
    indirect=["pair"],
)
def test_damaged_payload_is_refused_counted_and_never_decoded(pair, case):
    mutate, reason = CASES[case]
    pair.reset_decode_cache()
    _, params = pair.stage("A")
    damaged = mutate(pair, params)
    before = pair.failures()
    finished, failed, report, seconds = pair.load(params)
    after = pair.failures()

    assert finished and failed, "the load must land in the failed set"
    assert report.failed == reason and report.tokens == 0, report
    delta = {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
    assert delta == {reason: 1}, delta
    for layer in range(len(LAYERS)):
        if layer >= damaged:
            assert pair.layer_untouched(layer), f"layer {layer} was written"
        elif pair.preset == "raw":  # decoded before the damaged layer landed: verified bytes
            assert pair.layer_equals_prefill(layer), f"layer {layer} holds garbage"
    leaked = pair.leaks()
    print(f"FAULT|payload-{pair.preset}-{case}|refused:{reason}|{seconds:.3f}|"
          f"{','.join(leaked) or 'none'}")
    assert leaked == []


@pytest.mark.parametrize("pair", PRESETS, indirect=True)
def test_the_path_works_after_the_faults(pair):
    """Runs last per preset: a clean load still decodes exactly (nothing stuck, no stale state)."""
    pair.reset_decode_cache()
    _, params = pair.stage("A")
    finished, failed, report, _ = pair.load(params)
    assert finished and not failed and report.failed is None
    if pair.preset == "raw":
        assert all(pair.layer_equals_prefill(layer) for layer in range(len(LAYERS)))
    else:
        assert not any(pair.layer_untouched(layer) for layer in range(len(LAYERS)))
    assert pair.leaks() == []
