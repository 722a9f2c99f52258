"""The connector's own data path without vLLM engines: a prefill scheduler+worker stage a
request's paged KV (real codec, real NIXL-registered staging, real gRPC side channel), a decode
scheduler+worker handshake, claim, READ over UCX, verify and decode into their own paged cache.
The decoded blocks must equal the source (raw) or match it within the preset's error (tq4), with
the READ in one piece or pipelined per layer group; a corrupted chunk in the last group fails the
load (checksum) and frees everything."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch
from support.fakes import stand_in_configs
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.request import RequestStatus

from turbowire.connector.config import TurboWireConfig
from turbowire.connector.scheduler import TurboWireScheduler
from turbowire.connector.sidechannel.server import wait_port_free
from turbowire.connector.worker import TurboWireWorker

pytestmark = pytest.mark.integration

BS, HEADS, DIM, NUM_BLOCKS = 32, 2, 64, 48
# 5 layers, 5 groups: two READs, then one READ of the other three (the loader's coalescing)
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(5)]


FP8_SCALES = (0.05, 0.08)


def engine(preset: str, port: int, engine_id: str, role: str = "kv_both", groups: int = 8,
           fp8_scales: tuple[float, float] | None = None, save_schedule: str = "layerwise",
           decode_tp: int = 0):
    extra = {"preset": preset, "staging_bytes": "2MiB", "side_channel_port": port,
             "lease_seconds": 5, "decode_pipeline_groups": groups,
             "save_schedule": save_schedule, "decode_tp_size": decode_tp}
    # vLLM's attention layers by name, as the worker reads an fp8 cache's k/v scales
    context = ({name: SimpleNamespace(_k_scale_float=fp8_scales[0], _v_scale_float=fp8_scales[1])
                for name in LAYERS} if fp8_scales else None)
    vcfg, kcfg = stand_in_configs(extra, LAYERS, block_size=BS, num_kv_heads=HEADS,
                                  head_size=DIM, num_blocks=NUM_BLOCKS, engine_id=engine_id,
                                  kv_role=role, forward_context=context)
    cfg = TurboWireConfig.from_extra_config(extra, environ={})
    sched = TurboWireScheduler(vcfg, kcfg, cfg, engine_id)
    worker = TurboWireWorker(vcfg, kcfg, cfg, engine_id)
    return sched, worker


class Manager:
    def __init__(self, blocks):
        self.blocks = blocks

    def get_blocks(self, req_id):
        return SimpleNamespace(blocks=([KVCacheBlock(i) for i in self.blocks],))


def request(req_id, n, params, computed=0):
    return SimpleNamespace(request_id=req_id, kv_transfer_params=params, num_prompt_tokens=n,
                           num_computed_tokens=computed, prompt_token_ids=list(range(n)),
                           status=RequestStatus.RUNNING)


def token_kv(worker, layer: int, cache: torch.Tensor, blocks: list[int], t: int) -> torch.Tensor:
    """K and V of token t as vLLM's CPU attention stores them (the worker's layout)."""
    k, v = worker.paged_layouts[layer].gather(cache, blocks, t, 1)
    return torch.cat([k, v], dim=-1).float()


def make_caches(fp8: bool, fill_random: bool) -> dict[str, torch.Tensor]:
    """vLLM CPU attention caches (bf16), or fp8 e4m3 caches in vLLM's GPU layout
    [2, blocks, block_size, heads, head_dim] (on the CPU here) holding values / scale."""
    if not fp8:
        if fill_random:
            return {n: torch.randn(NUM_BLOCKS, HEADS, BS, 2 * DIM).to(torch.bfloat16)
                    for n in LAYERS}
        return {n: torch.zeros(NUM_BLOCKS, HEADS, BS, 2 * DIM, dtype=torch.bfloat16)
                for n in LAYERS}
    scale = torch.tensor(FP8_SCALES).reshape(2, 1, 1, 1, 1)
    out = {}
    for n in LAYERS:
        x = (torch.randn(2, NUM_BLOCKS, BS, HEADS, DIM) if fill_random
             else torch.zeros(2, NUM_BLOCKS, BS, HEADS, DIM))
        out[n] = (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    return out


@pytest.mark.parametrize(
    "preset,local_hit_blocks,groups,corrupt,fp8,schedule,cut",
    [("raw", 0, 1, False, False, "layerwise", False),
     ("raw", 1, 8, False, False, "layerwise", False),
     ("tq4", 0, 8, False, False, "layerwise", False),
     ("tq4", 0, 2, False, False, "layerwise", False),
     ("tq4", 0, 8, True, False, "layerwise", False),
     ("raw", 0, 2, False, True, "layerwise", False),
     ("tq4", 1, 8, False, True, "layerwise", False),
     ("tq4", 0, 8, False, False, "after_forward", False),
     # the prefill engine cuts its chunks per head (decode_tp_size 2): this decode engine of
     # its own TP size reads both runs of every chunk
     ("raw", 0, 8, False, False, "layerwise", True),
     ("tq4", 1, 2, False, False, "after_forward", True),
     ("tq4", 0, 8, True, False, "layerwise", True)],
)
def test_stage_read_decode_roundtrip(preset, local_hit_blocks, groups, corrupt, fp8, schedule,
                                     cut):
    from turbowire.serving.launch import free_port

    n = 100  # 3 full blocks + 4 tokens
    p_port = free_port()
    tag = f"{preset}-{local_hit_blocks}-{groups}-{corrupt}-{fp8}-{schedule}-{cut}"
    scales = FP8_SCALES if fp8 else None
    p_sched, p_worker = engine(preset, p_port, f"P-{tag}", fp8_scales=scales,
                               save_schedule=schedule, decode_tp=2 if cut else 0)
    assert p_worker.layout.head_groups == (2 if cut else 1)
    d_sched, d_worker = engine(preset, free_port(), f"D-{tag}", groups=groups, fp8_scales=scales)
    torch.manual_seed(0)
    p_caches = make_caches(fp8, fill_random=True)
    d_caches = make_caches(fp8, fill_random=False)
    try:
        p_worker.register_kv_caches(p_caches)
        d_worker.register_kv_caches(d_caches)
        p_sched.set_handshake_metadata({(0, 0): p_worker.handshake_metadata})

        # ---- prefill: two chunks (chunked prefill), encode, finish
        p_blocks = [5, 9, 2, 30]
        p_sched.bind_kv_cache_manager(Manager(p_blocks))
        preq = request("p-req", n, {"do_remote_decode": True})
        p_sched.on_new_request(preq)
        for computed, sched_tokens in ((0, 40), (40, 60)):
            preq.num_computed_tokens = computed
            meta = p_sched.build_connector_meta(
                SimpleNamespace(num_scheduled_tokens={"p-req": sched_tokens}))
            for name in LAYERS:  # what vLLM calls after each attention layer
                p_worker.save_kv_layer(name, p_caches[name], meta)
            p_worker.wait_for_save(meta)
        preq.num_computed_tokens = n
        preq.status = RequestStatus.FINISHED_LENGTH_CAPPED
        delay, params = p_sched.request_finished(preq, p_blocks)
        assert delay is False and params["remote_num_tokens"] == n
        assert p_sched.pool.snapshot().leases == 1
        if fp8 and preset == "raw":  # the wire carries what the model sees: bf16(q * k_scale)
            at = p_worker.layout.chunk_offset(params["remote_block_ids"][0], 0) + 48
            body = p_worker.staging[at : at + BS * HEADS * DIM * 2].view(torch.bfloat16)
            k0 = p_caches[LAYERS[0]][0][p_blocks[0]]  # [BS, HEADS, DIM] e4m3
            want_k = (k0.float() * torch.tensor(FP8_SCALES[0])).to(torch.bfloat16)
            assert torch.equal(body.reshape(BS, HEADS, DIM), want_k)
        if corrupt:  # flip a body byte of the last layer's chunk of the second block
            slot = params["remote_block_ids"][1]
            last = len(LAYERS) - 1
            at = p_worker.layout.chunk_offset(slot, last) + 200
            p_worker.staging[at] ^= 0x5A

        # ---- decode: match, allocate, load
        d_blocks = [11, 12, 13, 14]
        dreq = request("d-req", n, params)
        d_sched.on_new_request(dreq)
        computed = local_hit_blocks * BS
        count, is_async = d_sched.get_num_new_matched_tokens(dreq, computed)
        assert (count, is_async) == (n - computed, True)
        blocks = [KVCacheBlock(b) for b in d_blocks]
        for b in blocks[:local_hit_blocks]:
            b._block_hash = b"local"
        d_sched.update_state_after_alloc(dreq, SimpleNamespace(blocks=(blocks,)), count)
        meta = d_sched.build_connector_meta(SimpleNamespace(num_scheduled_tokens={}))
        d_worker.start_load_kv(meta)
        deadline = time.monotonic() + 60
        finished, failed = set(), set()
        while time.monotonic() < deadline and "d-req" not in finished:
            f, x = d_worker.get_transfer_results()
            finished |= f
            failed |= x
            time.sleep(0.01)
        d_worker.get_transfer_results()  # the engine's next step: the lease release goes out
        report = d_worker.take_reports().reports["d-req"]
        if corrupt:
            assert finished == {"d-req"} and failed == {"d-req"}
            assert report.failed == "checksum"
            assert d_worker.recv_ranges.free_bytes == d_worker.recv_ranges.capacity
            from turbowire.connector.stats import iter_counters

            counts = {labels.get("reason"): v
                      for name, labels, v in iter_counters(d_worker.stats.data)
                      if name == "failures"}
            assert counts == {"checksum": 1}
        else:
            assert finished == {"d-req"} and not failed
            assert report.tokens == n - computed and report.failed is None

        # ---- the decoded KV equals (raw) or approximates (tq4) the prefill's
        for layer, name in enumerate(LAYERS if not corrupt else []):
            for t in range(n):
                got = token_kv(d_worker, layer, d_caches[name], d_blocks, t)
                if t < computed:
                    assert torch.count_nonzero(got) == 0, "a locally cached block was overwritten"
                    continue
                want = token_kv(p_worker, layer, p_caches[name], p_blocks, t)
                if preset == "raw":
                    assert torch.equal(got, want), (name, t)
                else:
                    err = (got - want).norm() / want.norm()
                    assert err < 0.2, (name, t, float(err))

        # ---- the decode side released the lease: the prefill staging is free again
        deadline = time.monotonic() + 10
        while p_sched.pool.snapshot().used_slots and time.monotonic() < deadline:
            time.sleep(0.05)
        assert p_sched.pool.snapshot().used_slots == 0
    finally:
        for obj in (d_worker, p_worker, d_sched, p_sched):
            obj.shutdown()
        wait_port_free("127.0.0.1", p_port)


@pytest.mark.parametrize("case", ["cpu-attention-layout", "no-scales", "float32"])
def test_unservable_caches_are_refused_at_registration(case):
    """fp8 caches need vLLM's GPU layout and every layer's scales in the forward context; the
    worker says so when the caches are registered instead of failing inside a forward pass."""
    from turbowire.connector.geometry import GeometryError
    from turbowire.serving.launch import free_port

    port = free_port()
    sched, worker = engine("tq4", port, f"P-refuse-{case}",
                           fp8_scales=None if case == "no-scales" else FP8_SCALES)
    if case == "cpu-attention-layout":
        caches = {n: torch.zeros(NUM_BLOCKS, HEADS, BS, 2 * DIM, dtype=torch.float8_e4m3fn)
                  for n in LAYERS}
        match = "GPU cache layout"
    elif case == "no-scales":
        caches = make_caches(True, fill_random=False)
        match = "static forward context"
    else:
        caches = make_caches(True, fill_random=False)
        caches[LAYERS[0]] = caches[LAYERS[0]].to(torch.float32)
        match = "not \\['torch.float32'\\]"
    try:
        with pytest.raises(GeometryError, match=match):
            worker.register_kv_caches(caches)
    finally:
        for obj in (worker, sched):
            obj.shutdown()
        wait_port_free("127.0.0.1", port)
