"""Scheduler-side bookkeeping with the real codec and vLLM's config types, fake requests."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
from vllm.config import KVTransferConfig
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import RequestStatus

from turbowire.connector.compat import FORMAT_VERSION
from turbowire.connector.config import TurboWireConfig
from turbowire.connector.geometry import block_tag
from turbowire.connector.params import prompt_digest
from turbowire.connector.scheduler import TurboWireScheduler

BS = 32
LEASE_TOKEN = "ab" * 16
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(2)]


def _configs(preset: str = "tq4", staging: str = "1MiB", device: str = "cuda",
             role: str = "kv_both", tp: int = 1):
    ktc = KVTransferConfig(
        kv_connector="TurboWireConnector", kv_role=role,
        kv_connector_extra_config={"preset": preset, "staging_bytes": staging},
    )
    vllm_config = SimpleNamespace(
        kv_transfer_config=ktc,
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, data_parallel_index=0),
        model_config=SimpleNamespace(model="/models/tiny", served_model_name="tiny"),
        speculative_config=None,
        device_config=SimpleNamespace(device_type=device),
        compilation_config=SimpleNamespace(static_forward_context={}),
    )
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    kv_cache_config = KVCacheConfig(
        num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(LAYERS, spec)]
    )
    cfg = TurboWireConfig.from_extra_config(ktc.kv_connector_extra_config, environ={})
    return vllm_config, kv_cache_config, cfg


def make_scheduler(preset: str = "tq4", staging: str = "1MiB", device: str = "cuda",
                   role: str = "kv_both", tp: int = 1) -> TurboWireScheduler:
    return TurboWireScheduler(*_configs(preset, staging, device, role, tp), "engine-P")


class FakeManager:
    def __init__(self) -> None:
        self.blocks: dict[str, list[int]] = {}

    def get_blocks(self, req_id: str) -> SimpleNamespace:
        """vLLM's KVCacheBlocks of the request: one group of real blocks."""
        return SimpleNamespace(blocks=([KVCacheBlock(i) for i in self.blocks[req_id]],))


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
    assert sched.pool.release(["r1"]) == (["r1"], [], [])
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
        "tp_size": 1, "turbowire_preset": "tq4", "turbowire_format_version": FORMAT_VERSION,
        "turbowire_prompt_hash": prompt_digest(list(range(n)), n), "turbowire_lease_seconds": 30,
        "turbowire_lease_token": LEASE_TOKEN,
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
    assert not sched.receiver.heartbeats  # nothing to heartbeat for a refused request
    counters = sched.get_stats().data["counters"]
    assert any("reason=bad_params" in k for k in counters)
    sched.shutdown()


def test_heartbeat_interval_follows_the_parsed_lease():
    sched = make_scheduler()
    req = request("d8", 100, _remote_params(100, turbowire_lease_seconds=6))
    sched.on_new_request(req)
    assert sched.receiver.heartbeats["d8"].interval == pytest.approx(2.0)
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


def _cleanup_request(req_id: str, params: dict):
    """vLLM's pre-aborted request (AsyncLLM.notify_kv_transfer_request_rejected): the serving
    layer's placeholder prompt [0], max_tokens 1, ``abort_immediately``, finished as aborted."""
    return SimpleNamespace(
        request_id=req_id, kv_transfer_params=dict(params), num_prompt_tokens=1,
        num_computed_tokens=0, prompt_token_ids=[0], status=RequestStatus.FINISHED_ABORTED,
        abort_immediately=True,
    )


def _failure_counts(sched) -> dict[str, float]:
    stats = sched.get_stats()
    counters = stats.data["counters"] if stats is not None else {}
    return {k: v for k, v in counters.items() if k.startswith(("failures|", "fallbacks|"))}


def test_cleanup_request_after_a_failed_load_is_not_a_prompt_mismatch():
    """load_failure_policy fail: the load fails (counted by its reason), vLLM finishes the
    request in error, the serving layer answers an error and submits a pre-aborted cleanup
    request with the same params and a placeholder prompt. It used to be validated like a load
    (prompt hash of [0]) and counted ``prompt_mismatch``; it is a cleanup: nothing is counted,
    and the lease its load already released is not released a second time."""
    sched = make_scheduler()
    params = _remote_params(100)
    req = request("d1", 100, params)
    sched.on_new_request(req)
    assert sched.get_num_new_matched_tokens(req, 0) == (100, True)
    sched.update_state_after_alloc(req, _blocks([40, 41, 42, 43], hashed=0), 100)
    (load,) = step(sched, {}).loads
    assert not load.release_only  # the worker's load releases the lease, failed or not
    sched.get_stats()  # the load's own failure would be counted by the worker, not here
    req.status = RequestStatus.FINISHED_ERROR
    assert sched.request_finished(req, [40, 41, 42, 43]) == (False, None)

    cleanup = _cleanup_request("d1", params)
    sched.on_new_request(cleanup)
    assert not sched.receiver.heartbeats  # nothing to wait for
    assert sched.request_finished(cleanup, []) == (False, None)
    assert not step(sched, {}).loads  # no second release of the same lease
    assert _failure_counts(sched) == {}
    sched.shutdown()


def test_cleanup_request_of_a_request_never_seen_releases_without_counting():
    """The serving layer refused the request before the engine saw it: the cleanup is the only
    thing that lets the prefill engine go. Its release is queued; no load check is counted."""
    sched = make_scheduler()
    cleanup = _cleanup_request("d9", _remote_params(100))
    sched.on_new_request(cleanup)
    assert sched.request_finished(cleanup, []) == (False, None)
    (load,) = step(sched, {}).loads
    assert load.release_only and load.remote_request_id == "p-req"
    assert _failure_counts(sched) == {}

    malformed = _cleanup_request("d10", _remote_params(100, remote_port="x"))
    sched.on_new_request(malformed)
    assert sched.request_finished(malformed, []) == (False, None)
    assert not step(sched, {}).loads
    assert _failure_counts(sched) == {}
    sched.shutdown()


# ---- lease capabilities (issue 17): forged params must not release another request's lease
def _finish_prefill(sched, mgr, rid: str, n: int = 64) -> dict:
    req = request(rid, n, {"do_remote_decode": True})
    sched.on_new_request(req)
    mgr.blocks[rid] = list(range(blocks := (n + BS - 1) // BS))
    step(sched, {rid: n})
    req.num_computed_tokens = n
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    _, params = sched.request_finished(req, list(range(blocks)))
    return params


def test_prefill_issues_a_lease_token_the_decode_side_presents(prefill):
    sched, mgr = prefill
    params = _finish_prefill(sched, mgr, "victim")
    token = params["turbowire_lease_token"]
    assert len(token) == 32 and token == sched.pool.get_lease("victim").token
    assert params["turbowire_format_version"] == FORMAT_VERSION == 2

    decode = make_scheduler()
    req = request("d-victim", 64, params)
    decode.on_new_request(req)
    target = decode.receiver.heartbeats["d-victim"]
    assert target.remote_request_id == "victim" and target.lease_token == token
    assert token not in repr(target)
    assert decode.get_num_new_matched_tokens(req, 0) == (64, True)
    decode.update_state_after_alloc(req, _blocks([1, 2], 0), 64)
    (load,) = step(decode, {}).loads
    assert load.remote_request_id == "victim" and type(load.remote_request_id) is str
    assert load.lease_token == token and token not in repr(load)
    assert all(b.tag == block_tag("victim", b.index) for b in load.blocks)  # tags: the plain id
    decode.shutdown()


@pytest.mark.parametrize("forged_token", [None, "wrong"])
def test_forged_params_naming_a_live_request_do_not_release_it(prefill, forged_token):
    """A client (or router) sends the decode engine params naming another live request's
    remote_request_id: before, the decode engine refused the load (prompt_mismatch) and released
    the victim's lease, so the victim recomputed. Now the release carries the forged params'
    token, which is not the victim's: the prefill engine keeps the lease and counts the refusal."""
    from turbowire.connector.sender import GaugedLeases

    sched, mgr = prefill
    victim = _finish_prefill(sched, mgr, "victim")
    sched.get_stats()
    forged = dict(victim, turbowire_prompt_hash="0" * 24)  # not the attacker's prompt either
    if forged_token is None:
        forged.pop("turbowire_lease_token")
    else:
        forged["turbowire_lease_token"] = "f" * 32
    decode = make_scheduler()
    attacker = request("d-attacker", 64, forged)
    decode.on_new_request(attacker)
    assert decode.get_num_new_matched_tokens(attacker, 0) == (0, False)
    decode.update_state_after_alloc(attacker, _blocks([1, 2], 0), 0)
    loads = step(decode, {}).loads
    if forged_token is None:
        assert loads == []  # format 2 params without a token are refused before any call
    for load in loads:
        # what the decode worker sends over the side channel: refused (held, not the caller's)
        rid, token = load.remote_request_id, load.lease_token
        assert rid == "victim" and token == forged["turbowire_lease_token"]
        assert GaugedLeases(sched.sender).release([rid], 0, [token]) == ([], ["victim"], ["victim"])
        assert GaugedLeases(sched.sender).heartbeat([rid], [token]) == ([], ["victim"], ["victim"])
    assert sched.pool.has_lease("victim")  # the victim still gets its KV
    failures = _failure_counts(sched)
    # a wrong token is counted once per lease by the reason the decode side reports it with
    assert failures == ({"failures|reason=lease_refused": 1} if forged_token is not None
                        else {})
    # the real holder releases it
    assert GaugedLeases(sched.sender).release(["victim"], 0, [victim["turbowire_lease_token"]]) == (
        ["victim"], [], [])
    decode.shutdown()


def test_a_release_without_token_is_counted_as_an_older_peer(prefill):
    from turbowire.connector.sender import GaugedLeases

    sched, mgr = prefill
    _finish_prefill(sched, mgr, "r1")
    sched.get_stats()
    for _ in range(3):  # an old decode engine heartbeats repeatedly: counted once
        assert GaugedLeases(sched.sender).heartbeat(["r1"], [""]) == ([], ["r1"], ["r1"])
    counters = sched.get_stats().data["counters"]
    assert {k: v for k, v in counters.items() if k.startswith("failures|")} == {
        "failures|reason=incompatible": 1}
    assert sched.pool.has_lease("r1")


def test_params_of_an_older_prefill_engine_are_refused_as_incompatible():
    """Format 1 params (no lease token): declined naming the version, counted incompatible, and
    the release still goes out (an old prefill engine frees the lease without a token)."""
    sched = make_scheduler()
    old = _remote_params(100, turbowire_format_version=1)
    old.pop("turbowire_lease_token")
    req = request("d-old", 100, old)
    sched.on_new_request(req)
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    sched.update_state_after_alloc(req, _blocks([1, 2, 3, 4], 0), 0)
    (load,) = step(sched, {}).loads
    assert load.release_only and load.remote_request_id == "p-req" and load.lease_token == ""
    counters = sched.get_stats().data["counters"]
    assert {k: v for k, v in counters.items() if k.startswith("failures|")} == {
        "failures|reason=incompatible": 1}
    sched.shutdown()


# ---- staging gauges on an idle engine (issue 17): exported true after the last request
def _exporter(kv_role: str = "kv_both"):
    """vLLM's frontend side: TurboWirePromMetrics on a private registry."""
    import functools

    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from turbowire.connector.prom import build_prom_metrics

    reg = CollectorRegistry()
    types = {Gauge: functools.partial(Gauge, registry=reg),
             Counter: functools.partial(Counter, registry=reg),
             Histogram: functools.partial(Histogram, registry=reg)}
    cfg = SimpleNamespace(kv_transfer_config=KVTransferConfig(
        kv_connector="TurboWireConnector", kv_role=kv_role))
    return reg, build_prom_metrics(cfg, types, ["model_name", "engine"], {0: ["tiny", "0"]})


def _exported(reg) -> dict[str, float]:
    return {name: reg.get_sample_value(name, {"model_name": "tiny", "engine": "0", "role": "both"})
            for name in ("turbowire_staging_in_use_bytes", "turbowire_leases_outstanding")}


def _engine_step(sched, prom) -> None:
    """One step of vLLM's engine core as the connector sees it: schedule (connector metadata),
    update_from_output (scheduler-side stats), the frontend records the stats."""
    step(sched, {})
    stats = sched.get_stats()
    if stats is not None:
        prom.observe(stats.to_dict(), 0)


def _engine_idles(sched, prom, max_steps: int = 20) -> int:
    """vLLM's busy loop with no requests: it steps only while the connector asks for it
    (Scheduler.has_requests -> connector.has_pending_push_work), then blocks on its input queue
    for good. Returns the steps it made."""
    steps = 0
    while sched.has_pending_push_work():
        assert steps < max_steps, "the engine would never go idle"
        _engine_step(sched, prom)
        steps += 1
    return steps


def test_gauges_return_to_zero_after_leases_expire_on_an_idle_engine(prefill):
    """The last request's lease is never read (the decode engine died): the lease reaper frees
    it while no request is left. The pool lives in the engine-core process and /metrics is the
    frontend's, fed only by engine steps; before, an idle engine made no step and the exported
    gauges stayed at their last value forever. Now the connector keeps the engine stepping
    while leases are outstanding and until the exported gauges match the pool."""
    sched, mgr = prefill
    reg, prom = _exporter()
    now = [1000.0]
    sched.pool.clock = lambda: now[0]
    _finish_prefill(sched, mgr, "no-show", n=64)
    _engine_step(sched, prom)
    held = _exported(reg)
    assert held["turbowire_leases_outstanding"] == 1
    assert held["turbowire_staging_in_use_bytes"] == 2 * sched.layout.slot_bytes
    assert sched.has_pending_push_work()  # a lease is out: the engine must not go to sleep

    # no request, no step from traffic; the lease expires and the reaper thread frees it
    now[0] += sched.config.lease_seconds + 1
    sched._start_maintenance()
    for _ in range(100):
        if not sched.pool.snapshot().leases:
            break
        threading.Event().wait(0.05)
    assert sched.pool.snapshot().used_slots == 0
    assert _exported(reg) == held  # not exported yet: only an engine step carries stats

    assert _engine_idles(sched, prom) >= 1
    assert _exported(reg) == {"turbowire_staging_in_use_bytes": 0.0,
                              "turbowire_leases_outstanding": 0.0}
    assert not sched.has_pending_push_work()  # idle for good, and the gauges are true
    sched.shutdown()


def test_an_idle_cpu_engine_does_not_spin_while_a_lease_is_out():
    """On CPU the idle engine's empty steps spin a core other engines' NIXL threads need: it
    steps only while the exported gauges are stale, not for as long as a lease is out."""
    sched = make_scheduler(device="cpu")
    mgr = FakeManager()
    sched.bind_kv_cache_manager(mgr)
    reg, prom = _exporter()
    _finish_prefill(sched, mgr, "held", n=64)
    assert sched.has_pending_push_work()  # the new lease is not exported yet
    _engine_step(sched, prom)
    assert _exported(reg)["turbowire_leases_outstanding"] == 1
    assert not sched.has_pending_push_work()  # exported, lease still out: the engine may idle
    sched.pool.release(["held"])
    assert sched.has_pending_push_work()  # stale again: one more step exports it
    _engine_step(sched, prom)
    assert _exported(reg)["turbowire_leases_outstanding"] == 0
    assert not sched.has_pending_push_work()
    sched.shutdown()


def test_gauges_follow_a_release_made_on_a_side_channel_thread_after_the_last_step(prefill):
    from turbowire.connector.sender import GaugedLeases

    sched, mgr = prefill
    reg, prom = _exporter()
    params = _finish_prefill(sched, mgr, "r1", n=64)
    _engine_step(sched, prom)
    assert _exported(reg)["turbowire_leases_outstanding"] == 1
    done = []
    t = threading.Thread(target=lambda: done.append(GaugedLeases(sched.sender).release(
        ["r1"], 0, [params["turbowire_lease_token"]])))
    t.start()
    t.join()
    assert done == [(["r1"], [], [])]
    _engine_idles(sched, prom)
    assert _exported(reg) == {"turbowire_staging_in_use_bytes": 0.0,
                              "turbowire_leases_outstanding": 0.0}
    assert not sched.has_pending_push_work()


def test_an_idle_engine_with_nothing_staged_does_not_step():
    sched = make_scheduler()
    assert not sched.has_pending_push_work()
    reg, prom = _exporter()
    _engine_step(sched, prom)  # the first step carries the initial gauges
    assert _exported(reg) == {"turbowire_staging_in_use_bytes": 0.0,
                              "turbowire_leases_outstanding": 0.0}
    assert not sched.has_pending_push_work()
    sched.shutdown()


def test_the_connector_facade_forwards_has_pending_push_work():
    from turbowire.connector.connector import TurboWireConnector

    facade = TurboWireConnector.__new__(TurboWireConnector)
    facade.connector_worker = None
    facade.connector_scheduler = SimpleNamespace(has_pending_push_work=lambda: True)
    assert facade.has_pending_push_work() is True
    facade.connector_scheduler = None
    assert facade.has_pending_push_work() is False


# ---- staging_capacity_bytes: one owner (the scheduler), whatever order vLLM merges the stats in
class _NoTransport:
    name = "fake"
    agent_name = "fake-agent"

    def register(self, tensor) -> None:
        pass

    def local_metadata(self) -> bytes:
        return b"md"

    def close(self) -> None:
        pass


def _registered_worker(monkeypatch, role: str, tp: int):
    """A worker of one TP rank after vLLM's register_kv_caches (CPU caches, no NIXL)."""
    from turbowire.connector import worker as worker_mod

    monkeypatch.setattr(worker_mod, "make_transport", lambda config, name: _NoTransport())
    w = worker_mod.TurboWireWorker(*_configs(device="cpu", role=role, tp=tp), "engine-P")
    w.register_kv_caches({n: torch.zeros((2, 64, BS, 2, 64), dtype=torch.bfloat16)
                          for n in LAYERS})
    return w


@pytest.mark.parametrize("role,tp", [("kv_producer", 1), ("kv_consumer", 1), ("kv_both", 1),
                                     ("kv_producer", 2)])
@pytest.mark.parametrize("scheduler_last", [True, False])
def test_staging_capacity_is_the_pool_the_workers_allocated(monkeypatch, role, tp,
                                                             scheduler_last):
    """One engine step as vLLM assembles it: the TP workers' stats aggregated, then (vLLM's
    Scheduler.update_from_output) aggregated with the scheduler's, then exported by the frontend.
    Both sides used to set staging_capacity_bytes on the same series (worker label 0), so the
    last one merged won: a kv_consumer, which allocates no staging pool, exported the
    scheduler's pool size; and with TP 2 the two ranks' pools counted once. Now the scheduler
    alone sets it (the workers set no staging gauge), in either merge order, to the bytes the
    workers really allocated."""
    from turbowire.connector.stats import iter_gauges

    sched = make_scheduler(role=role, tp=tp)
    workers = [_registered_worker(monkeypatch, role, tp) for _ in range(tp)]
    allocated = sum(w.staging.numel() for w in workers if w.staging is not None)
    assert allocated == (tp * sched.layout.pool_bytes if role != "kv_consumer" else 0)
    worker_stats = [st for st in (w.get_stats() for w in workers) if st is not None]
    worker_gauges = [g for st in worker_stats for g in iter_gauges(st.data)]
    merged = sched.get_stats()
    for st in worker_stats:
        merged = st.aggregate(merged) if scheduler_last else merged.aggregate(st)
    reg, prom = _exporter(role)
    prom.observe(merged.to_dict(), 0)
    labels = {"model_name": "tiny", "engine": "0", "role": role.removeprefix("kv_")}
    assert reg.get_sample_value("turbowire_staging_capacity_bytes", labels) == allocated
    assert reg.get_sample_value("turbowire_staging_in_use_bytes", labels) == 0
    assert worker_gauges == []  # one owner: the scheduler
    for w in workers:
        w.shutdown()
    sched.shutdown()


def test_staging_in_use_counts_every_tp_worker_pool():
    """Each TP rank stages its heads of a request into the same slot of its own pool: the bytes
    in use are the slots times the slot size times the ranks, like the capacity."""
    sched = make_scheduler(role="kv_producer", tp=2)
    mgr = FakeManager()
    sched.bind_kv_cache_manager(mgr)
    _finish_prefill(sched, mgr, "r1", n=64)
    gauges = sched.get_stats().gauge_totals()
    assert gauges["staging_bytes_in_use"] == 2 * 2 * sched.layout.slot_bytes
    assert gauges["staging_capacity_bytes"] == 2 * sched.layout.pool_bytes
    sched.shutdown()
