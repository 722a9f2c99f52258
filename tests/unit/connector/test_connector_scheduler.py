"""Scheduler-side bookkeeping with the real codec and vLLM's config types, fake requests."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm.config import KVTransferConfig
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import RequestStatus

from turbowire.connector.config import TurboWireConfig
from turbowire.connector.geometry import block_tag
from turbowire.connector.params import prompt_digest
from turbowire.connector.scheduler import TurboWireScheduler

BS = 32
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(2)]


def make_scheduler(preset: str = "tq4", staging: str = "1MiB") -> TurboWireScheduler:
    ktc = KVTransferConfig(
        kv_connector="TurboWireConnector", kv_role="kv_both",
        kv_connector_extra_config={"preset": preset, "staging_bytes": staging},
    )
    vllm_config = SimpleNamespace(
        kv_transfer_config=ktc,
        parallel_config=SimpleNamespace(tensor_parallel_size=1, data_parallel_index=0),
        model_config=SimpleNamespace(model="/models/tiny", served_model_name="tiny"),
        speculative_config=None,
    )
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    kv_cache_config = KVCacheConfig(
        num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(LAYERS, spec)]
    )
    cfg = TurboWireConfig.from_extra_config(ktc.kv_connector_extra_config, environ={})
    sched = TurboWireScheduler(vllm_config, kv_cache_config, cfg, "engine-P")
    return sched


class FakeManager:
    def __init__(self) -> None:
        self.blocks: dict[str, list[int]] = {}

    def get_block_ids(self, req_id: str) -> tuple[list[int], ...]:
        return (self.blocks[req_id],)


def request(req_id: str, n: int, params: dict | None, computed: int = 0):
    return SimpleNamespace(
        request_id=req_id, kv_transfer_params=params, num_prompt_tokens=n,
        num_computed_tokens=computed, prompt_token_ids=list(range(n)),
        status=RequestStatus.RUNNING,
    )


def step(sched, scheduled: dict[str, int]):
    return sched.build_connector_meta(SimpleNamespace(num_scheduled_tokens=scheduled))


@pytest.fixture
def prefill():
    sched = make_scheduler()
    mgr = FakeManager()
    sched.bind_kv_cache_manager(mgr)
    yield sched, mgr
    sched.shutdown()


def test_chunked_prefill_encodes_each_block_once_and_partial_last(prefill):
    sched, mgr = prefill
    req = request("r1", 100, {"do_remote_decode": True})
    sched.on_new_request(req)
    mgr.blocks["r1"] = [7, 8]
    meta = step(sched, {"r1": 40})
    assert [b.index for s in meta.saves for b in s.blocks] == [0]  # block 1 not complete yet
    assert meta.saves[0].block_ids == [7]
    req.num_computed_tokens = 40
    mgr.blocks["r1"] = [7, 8, 9, 10]
    meta = step(sched, {"r1": 60})
    blocks = meta.saves[0].blocks
    assert [(b.index, b.block_id, b.num_tokens) for b in blocks] == [
        (1, 8, 32), (2, 9, 32), (3, 10, 4)
    ]
    assert meta.saves[0].block_ids == [7, 8, 9, 10]
    assert all(b.tag == block_tag("r1", b.index) for b in blocks)
    req.num_computed_tokens = 100
    assert not step(sched, {"r1": 1}).saves  # decode step: nothing new to stage
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    delay, params = sched.request_finished(req, [7, 8, 9, 10])
    assert delay is False  # dense blocks are freed at once
    assert params["do_remote_prefill"] is True and params["remote_request_id"] == "r1"
    assert params["remote_num_tokens"] == 100 and len(params["remote_block_ids"]) == 4
    assert params["turbowire_prompt_hash"] == prompt_digest(list(range(100)), 100)
    codec = sched.codec
    want = sum(
        codec.encoded_nbytes(layer, n, 2, i * BS)
        for layer in range(2)
        for i, n in enumerate([32, 32, 32, 4])
    )
    assert params["turbowire_wire_bytes"] == want
    assert params["turbowire_dense_bytes"] == 100 * 2 * (2 * 2 * 64 * 2)
    assert sched.pool.snapshot().leases == 1
    assert sched.pool.release(["r1"]) == (["r1"], [])
    assert sched.pool.snapshot().used_slots == 0


def test_full_staging_falls_back_and_counts(prefill):
    sched = make_scheduler(staging="64KiB")
    mgr = FakeManager()
    sched.bind_kv_cache_manager(mgr)
    slots = sched.layout.num_slots
    n = (slots + 2) * BS
    req = request("big", n, {"do_remote_decode": True})
    sched.on_new_request(req)
    mgr.blocks["big"] = list(range(slots + 2))
    meta = step(sched, {"big": n})
    assert not meta.saves
    assert sched.pool.snapshot().used_slots == 0
    req.num_computed_tokens = n
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    delay, params = sched.request_finished(req, [])
    assert delay is False
    assert params["turbowire_fallback"] == "staging_full"
    assert params["remote_num_tokens"] == 0 and params["remote_block_ids"] == []
    stats = sched.get_stats()
    assert any("fallbacks|reason=staging_full" in k for k in stats.data["counters"])
    sched.shutdown()


def test_abort_frees_reserved_slots(prefill):
    sched, mgr = prefill
    req = request("r2", 64, {"do_remote_decode": True})
    sched.on_new_request(req)
    mgr.blocks["r2"] = [1, 2]
    step(sched, {"r2": 64})
    assert sched.pool.snapshot().used_slots == 2
    req.status = RequestStatus.FINISHED_ABORTED
    assert sched.request_finished(req, [1, 2]) == (False, None)
    assert sched.pool.snapshot().used_slots == 0


def _remote_params(n: int, **over) -> dict:
    p = {
        "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "engine-P",
        "remote_request_id": "p-req", "remote_host": "127.0.0.1", "remote_port": 5700,
        "remote_block_ids": list(range(10, 10 + (n + BS - 1) // BS)), "remote_num_tokens": n,
        "tp_size": 1, "turbowire_preset": "tq4", "turbowire_format_version": 1,
        "turbowire_prompt_hash": prompt_digest(list(range(n)), n), "turbowire_lease_seconds": 30,
    }
    p.update(over)
    return p


def _blocks(ids: list[int], hashed: int) -> SimpleNamespace:
    blocks = [KVCacheBlock(i) for i in ids]
    for b in blocks[:hashed]:
        b._block_hash = b"h"  # stands for a local prefix-cache hit
    return SimpleNamespace(blocks=(blocks,))


def test_decode_side_partial_local_hit():
    sched = make_scheduler()
    req = request("d1", 100, _remote_params(100))
    sched.on_new_request(req)
    # side-effect free: the same answer every time
    for _ in range(3):
        assert sched.get_num_new_matched_tokens(req, 32) == (68, True)
    sched.update_state_after_alloc(req, _blocks([40, 41, 42, 43], hashed=1), 68)
    meta = step(sched, {})
    (load,) = meta.loads
    assert [(b.index, b.block_id, b.slot, b.num_tokens) for b in load.blocks] == [
        (1, 41, 11, 32), (2, 42, 12, 32), (3, 43, 13, 4)
    ]
    assert load.block_ids == [40, 41, 42, 43]
    assert all(b.tag == block_tag("p-req", b.index) for b in load.blocks)
    assert load.remote_request_id == "p-req" and load.peer.port == 5700
    assert not step(sched, {}).loads  # queued once
    assert sched.get_num_new_matched_tokens(req, 32) == (0, False)  # already loading
    sched.shutdown()


def test_decode_side_refusals_still_release_the_lease():
    sched = make_scheduler()
    bad_prompt = request("d2", 100, _remote_params(100, turbowire_prompt_hash="0" * 24))
    sched.on_new_request(bad_prompt)
    assert sched.get_num_new_matched_tokens(bad_prompt, 0) == (0, False)
    sched.update_state_after_alloc(bad_prompt, _blocks([1, 2, 3, 4], 0), 0)
    (load,) = step(sched, {}).loads
    assert load.release_only and load.remote_request_id == "p-req"

    malformed = request("d3", 100, _remote_params(100, remote_port="x"))
    sched.on_new_request(malformed)
    assert sched.get_num_new_matched_tokens(malformed, 0) == (0, False)
    other_preset = request("d4", 100, _remote_params(100, turbowire_preset="raw"))
    sched.on_new_request(other_preset)
    assert sched.get_num_new_matched_tokens(other_preset, 0) == (0, False)
    counters = sched.get_stats().data["counters"]
    assert any("reason=prompt_mismatch" in k for k in counters)
    assert any("reason=bad_params" in k for k in counters)
    assert any("reason=incompatible" in k for k in counters)
    sched.shutdown()


@pytest.mark.parametrize("lease", ["30", -1, float("nan"), 1e30, [30], {"s": 1}])
def test_malformed_lease_seconds_is_recomputed_not_raised_in_the_engine_loop(lease):
    """``turbowire_lease_seconds`` sets the heartbeat interval: it is validated like the rest
    (it used to be read unchecked in on_new_request, where a bad value raised in vLLM's loop)."""
    sched = make_scheduler()
    req = request("d7", 100, _remote_params(100, turbowire_lease_seconds=lease))
    sched.on_new_request(req)
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    assert not sched._heartbeats  # nothing to heartbeat for a refused request
    counters = sched.get_stats().data["counters"]
    assert any("reason=bad_params" in k for k in counters)
    sched.shutdown()


def test_heartbeat_interval_follows_the_parsed_lease():
    sched = make_scheduler()
    req = request("d8", 100, _remote_params(100, turbowire_lease_seconds=6))
    sched.on_new_request(req)
    assert sched._heartbeats["d8"].interval == pytest.approx(2.0)
    sched.shutdown()


def test_a_refused_request_is_counted_once_through_its_whole_life():
    """get_num_new_matched_tokens, the allocation and request_finished all look at the params;
    the refusal is one failure, not one per look (request_finished used to re-parse)."""
    sched = make_scheduler()
    malformed = request("d6", 100, _remote_params(100, remote_port="x"))
    sched.on_new_request(malformed)
    assert sched.get_num_new_matched_tokens(malformed, 0) == (0, False)
    assert sched.get_num_new_matched_tokens(malformed, 0) == (0, False)
    sched.update_state_after_alloc(malformed, _blocks([1, 2, 3, 4], 0), 0)
    step(sched, {})
    sched.request_finished(malformed, [1, 2, 3, 4])
    counters = sched.get_stats().data["counters"]
    bad = {k: v for k, v in counters.items() if "reason=bad_params" in k}
    assert sum(bad.values()) == 1, bad
    sched.shutdown()


def test_decode_request_aborted_before_scheduling_releases():
    sched = make_scheduler()
    req = request("d5", 70, _remote_params(70))
    sched.on_new_request(req)
    req.status = RequestStatus.FINISHED_ABORTED
    assert sched.request_finished(req, []) == (False, None)
    (load,) = step(sched, {}).loads
    assert load.release_only and load.remote_request_id == "p-req"
    sched.shutdown()


def test_full_local_hit_only_releases():
    sched = make_scheduler()
    req = request("d6", 64, _remote_params(64))
    sched.on_new_request(req)
    assert sched.get_num_new_matched_tokens(req, 64) == (0, False)
    sched.update_state_after_alloc(req, _blocks([5, 6], 2), 0)
    (load,) = step(sched, {}).loads
    assert load.release_only
    sched.shutdown()


def test_expired_lease_is_counted(prefill):
    sched, mgr = prefill
    now = [1000.0]
    sched.pool.clock = lambda: now[0]
    req = request("r9", 40, {"do_remote_decode": True})
    sched.on_new_request(req)
    mgr.blocks["r9"] = [3, 4]
    step(sched, {"r9": 40})
    req.num_computed_tokens = 40
    req.status = RequestStatus.FINISHED_STOPPED
    sched.request_finished(req, [3, 4])
    sched.get_stats()
    now[0] += sched.config.lease_seconds + 1
    step(sched, {})
    assert sched.pool.snapshot().used_slots == 0
    counters = sched.get_stats().data["counters"]
    assert any("reason=lease_expired" in k for k in counters)


def test_load_config_validates_and_sets_vllm_failure_policy():
    from turbowire.connector.config import ConnectorConfigError
    from turbowire.connector.connector import load_config

    ktc = KVTransferConfig(
        kv_connector="TurboWireConnector", kv_role="kv_both",
        kv_connector_extra_config={"preset": "k8v4", "load_failure_policy": "recompute"},
    )
    cfg = load_config(SimpleNamespace(kv_transfer_config=ktc))
    assert cfg.preset == "k8v4"
    assert ktc.kv_load_failure_policy == "recompute"  # what vLLM's scheduler reads next
    bad = KVTransferConfig(
        kv_connector="TurboWireConnector", kv_role="kv_both",
        kv_connector_extra_config={"preset": "tq9"},
    )
    with pytest.raises(ConnectorConfigError, match="preset='tq9' is unknown"):
        load_config(SimpleNamespace(kv_transfer_config=bad))
