"""Issue 33 on the scheduler side, with vLLM's real ``Request`` objects: transfer params that are
not a mapping (H2), hooks that fall back instead of raising into vLLM's engine loop (L3),
authenticated params and the peer allowlist checked before anything is dialed (H3b), the lease
bound to its prompt (H3a), heartbeats isolated per peer (M2) and the start-up warnings (M5)."""

from __future__ import annotations

import logging
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from test_connector_scheduler import LAYERS, FakeManager, _blocks, step
from vllm import SamplingParams
from vllm.config import KVTransferConfig
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request, RequestStatus

from turbowire.connector.compat import FORMAT_VERSION
from turbowire.connector.config import TurboWireConfig
from turbowire.connector.connector import TurboWireConnector
from turbowire.connector.params import (
    PARAMS_MAC_FIELD,
    RemotePrefill,
    params_mac,
    params_mac_key,
    prompt_digest,
)
from turbowire.connector.scheduler import TurboWireScheduler
from turbowire.connector.sender import GaugedLeases

BS = 32
TOKEN = "shared-token-123"


def make(role: str = "kv_both", **extra) -> TurboWireScheduler:
    """A scheduler of the tiny test geometry with ``extra`` kv_connector_extra_config keys."""
    ktc = KVTransferConfig(
        kv_connector="TurboWireConnector", kv_role=role,
        kv_connector_extra_config={"preset": "tq4", "staging_bytes": "1MiB", **extra},
    )
    vllm_config = SimpleNamespace(
        kv_transfer_config=ktc,
        parallel_config=SimpleNamespace(tensor_parallel_size=1, data_parallel_index=0),
        model_config=SimpleNamespace(model="/models/tiny", served_model_name="tiny"),
        speculative_config=None,
        device_config=SimpleNamespace(device_type="cuda"),
        compilation_config=SimpleNamespace(static_forward_context={}),
    )
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    kv_cache_config = KVCacheConfig(
        num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(LAYERS, spec)]
    )
    cfg = TurboWireConfig.from_extra_config(ktc.kv_connector_extra_config, environ={})
    sched = TurboWireScheduler(vllm_config, kv_cache_config, cfg, "engine-P")
    sched._start_maintenance = lambda: None  # no background heartbeats: nothing dials
    return sched


def facade(sched: TurboWireScheduler) -> TurboWireConnector:
    c = TurboWireConnector.__new__(TurboWireConnector)
    c.connector_worker = None
    c.connector_scheduler = sched
    return c


def vllm_request(req_id: str, prompt: list[int], params=None, xargs=None) -> Request:
    """vLLM's own Request: ``xargs`` become SamplingParams.extra_args, as vllm_xargs do."""
    sp = SamplingParams(max_tokens=8, temperature=0, extra_args=xargs)
    request = Request(req_id, list(prompt), sp, None)
    if params is not None:
        request.kv_transfer_params = params
    return request


def counters(sched: TurboWireScheduler) -> dict[str, float]:
    stats = sched.get_stats()
    data = stats.data["counters"] if stats is not None else {}
    return {k: v for k, v in data.items() if k.startswith(("failures|", "fallbacks|"))}


def vllm_reads_params_like_its_scheduler(request: Request) -> None:
    """vllm/v1/core/sched/scheduler.py add_request, right after connector.on_new_request."""
    kv_transfer_params = request.kv_transfer_params
    if kv_transfer_params and kv_transfer_params.get("do_remote_prefill"):
        pass


# ---- H2: kv_transfer_params that are not a mapping ---------------------------------------------
@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer", "kv_both"])
@pytest.mark.parametrize("bad", ["x", "", ["do_remote_prefill"], 7, 1.5, True])
def test_non_mapping_params_are_dropped_before_vllm_reads_them(role, bad):
    sched = make(role)
    sched.bind_kv_cache_manager(FakeManager())
    conn = facade(sched)
    req = vllm_request("r-bad", list(range(40)), xargs={"kv_transfer_params": bad})
    assert req.kv_transfer_params == bad  # vLLM took it from vllm_xargs unchecked
    if bad:  # what killed the engine loop (AttributeError: 'str' object has no attribute 'get')
        with pytest.raises(AttributeError):
            vllm_reads_params_like_its_scheduler(req)
    conn.on_new_request(req)
    assert req.kv_transfer_params is None
    vllm_reads_params_like_its_scheduler(req)
    assert conn.get_num_new_matched_tokens(req, 0) == (0, False)
    conn.update_state_after_alloc(req, _blocks([1, 2], 0), 0)
    assert step(sched, {"r-bad": 40}).is_empty()
    req.status = RequestStatus.FINISHED_STOPPED
    assert conn.request_finished(req, [1, 2]) == (False, None)
    assert counters(sched) == {"failures|reason=bad_params": 1}
    sched.shutdown()


def test_a_mapping_is_left_alone():
    sched = make("kv_producer")
    req = vllm_request("r-ok", list(range(40)), xargs={"kv_transfer_params":
                                                       {"do_remote_decode": True}})
    facade(sched).on_new_request(req)
    assert req.kv_transfer_params == {"do_remote_decode": True}
    assert "r-ok" in sched.sender.sending and counters(sched) == {}
    sched.shutdown()


# ---- L3: an exception in turbowire's code never reaches vLLM's engine loop ---------------------
def _boom(*args, **kwargs):
    raise RuntimeError("a bug in turbowire")


@pytest.mark.parametrize(("hook", "args", "fallback"), [
    ("on_new_request", ("req",), None),
    ("get_num_new_matched_tokens", ("req", 0), (0, False)),
    ("update_state_after_alloc", ("req", "blocks", 0), None),
    ("build_connector_meta", (SimpleNamespace(num_scheduled_tokens={}),), "meta"),
    ("update_connector_output", (SimpleNamespace(finished_recving=None),), None),
    ("request_finished", ("req", []), (False, None)),
    ("has_pending_push_work", (), False),
])
def test_a_failing_hook_falls_back_logs_the_traceback_and_counts_internal(
        monkeypatch, caplog, hook, args, fallback):
    sched = make()
    conn = facade(sched)
    req = vllm_request("r1", list(range(40)), {"do_remote_decode": True})
    args = tuple(req if a == "req" else _blocks([1, 2], 0) if a == "blocks" else a for a in args)
    monkeypatch.setattr(sched, hook, _boom)
    with caplog.at_level(logging.ERROR, logger="turbowire.connector.connector"):
        got = getattr(conn, hook)(*args)
    if fallback == "meta":
        assert got.is_empty()
    else:
        assert got == fallback
    assert any(r.exc_info and "a bug in turbowire" in str(r.exc_info[1]) for r in caplog.records)
    assert counters(sched).get("failures|reason=internal") == 1
    sched.shutdown()


def test_a_repeated_request_id_on_the_prefill_engine_falls_back_without_touching_the_lease():
    """L3: with vLLM's request-id randomization off, a client repeating X-Request-Id sends a
    second request with the id of one whose lease is still held. staging.reserve raised
    ValueError into build_connector_meta, i.e. into vLLM's schedule(): the engine died."""
    sched = make("kv_producer")
    mgr = FakeManager()
    sched.bind_kv_cache_manager(mgr)
    conn = facade(sched)
    first = vllm_request("dup", list(range(64)), {"do_remote_decode": True})
    conn.on_new_request(first)
    mgr.blocks["dup"] = [1, 2]
    conn.build_connector_meta(SimpleNamespace(num_scheduled_tokens={"dup": 64}))
    first.num_computed_tokens = 64
    first.status = RequestStatus.FINISHED_LENGTH_CAPPED
    _, held = conn.request_finished(first, [1, 2])
    lease = sched.pool.get_lease("dup")
    assert lease is not None
    second = vllm_request("dup", list(range(100, 164)), {"do_remote_decode": True})
    conn.on_new_request(second)
    mgr.blocks["dup"] = [3, 4]
    meta = conn.build_connector_meta(SimpleNamespace(num_scheduled_tokens={"dup": 64}))
    assert meta.saves == []
    second.num_computed_tokens = 64
    second.status = RequestStatus.FINISHED_LENGTH_CAPPED
    _, params = conn.request_finished(second, [3, 4])
    assert params["turbowire_fallback"] == "internal" and params["remote_block_ids"] == []
    assert sched.pool.get_lease("dup") is lease and lease.token == held["turbowire_lease_token"]
    assert counters(sched) == {"failures|reason=internal": 1}
    sched.shutdown()


def test_a_load_that_could_not_be_planned_is_reported_failed_not_left_waiting(monkeypatch):
    """update_state_after_alloc raising after vLLM was told to wait for KV (async load): the
    fallback queues a load the workers fail at once, so vLLM recomputes instead of waiting."""
    from test_loader import rig

    from turbowire.connector.metadata import LoadRequest

    sched = make()
    conn = facade(sched)
    params = _decode_params(64)
    req = vllm_request("d1", list(range(64)), params)
    conn.on_new_request(req)
    assert conn.get_num_new_matched_tokens(req, 0) == (64, True)
    monkeypatch.setattr(sched.receiver, "remote_total", _boom)
    conn.update_state_after_alloc(req, _blocks([1, 2], 0), 64)
    (load,) = step(sched, {}).loads
    assert isinstance(load, LoadRequest) and load.fail_reason == "internal"
    assert load.remote_request_id == "p-req" and load.lease_token == params[
        "turbowire_lease_token"]
    r = rig()
    r.loader.start([load])
    assert r.loader.results() == ({"d1"}, {"d1"})
    assert r.loader.take_reports()["d1"].failed == "internal"
    assert r.client.released == ["p-req"]  # the prefill engine's lease is let go
    assert r.transport.reads == [] and r.decoded == []
    sched.shutdown()


# ---- H3: authenticated params, allowlist, prompt binding ---------------------------------------
def _decode_params(n: int, prompt: list[int] | None = None, key: bytes | None = None,
                   **over) -> dict:
    prompt = list(range(n)) if prompt is None else prompt
    p = {
        "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "engine-P",
        "remote_request_id": "p-req", "remote_host": "127.0.0.1", "remote_port": 5700,
        "remote_block_ids": list(range(10, 10 + (n + BS - 1) // BS)), "remote_num_tokens": n,
        "tp_size": 1, "turbowire_preset": "tq4", "turbowire_format_version": FORMAT_VERSION,
        "turbowire_prompt_hash": prompt_digest(prompt, n), "turbowire_lease_seconds": 30.0,
        "turbowire_lease_token": "ab" * 16,
    }
    if key is not None:
        p[PARAMS_MAC_FIELD] = params_mac(key, RemotePrefill.parse(p, BS).mac_fields())
    p.update(over)
    return p


class NoDial:
    """A ClientPool that fails the test when anything would be dialed."""

    def get(self, host, port):
        pytest.fail(f"dialed {host}:{port}")

    def close(self):
        pass


def _nothing_dialed(sched: TurboWireScheduler, req: Request) -> None:
    sched.receiver.clients = NoDial()
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    sched.update_state_after_alloc(req, _blocks([1, 2], 0), 0)
    assert step(sched, {}).loads == []  # not even a release
    req.status = RequestStatus.FINISHED_STOPPED
    sched.request_finished(req, [1, 2])
    assert step(sched, {}).loads == []
    assert req.request_id not in sched.receiver.heartbeats
    sched.receiver.send_heartbeats()


KEY = params_mac_key(TOKEN)


@pytest.mark.parametrize(("case", "over"), [
    ("unsigned", {PARAMS_MAC_FIELD: None}),
    ("another-host", {"remote_host": "10.9.9.9"}),
    ("another-port", {"remote_port": 6000}),
    ("forged-prompt-hash", {"turbowire_prompt_hash": prompt_digest(list(range(64)), 64)}),
    ("fewer-tokens", {"remote_num_tokens": 32, "remote_block_ids": [10]}),
    ("swapped-slots", {"remote_block_ids": [11, 10]}),
    ("signed-with-another-token", "other-key"),
])
def test_a_decode_engine_with_a_token_refuses_unauthenticated_params_before_dialing(case, over):
    sched = make("kv_consumer", auth_token=TOKEN)
    prompt = list(range(64))
    if over == "other-key":
        params = _decode_params(64, key=params_mac_key("another-token-9"))
    else:
        params = _decode_params(64, prompt=list(range(100, 164)) if "forged" in case else None,
                                key=KEY, **over)
    req = vllm_request("d1", prompt, params)
    sched.on_new_request(req)
    _nothing_dialed(sched, req)
    assert counters(sched) == {"failures|reason=unauthenticated_params": 1}
    sched.shutdown()


def test_signed_params_load_and_the_claim_carries_this_engines_prompt():
    sched = make("kv_consumer", auth_token=TOKEN)
    prompt = list(range(64))
    req = vllm_request("d1", prompt, _decode_params(64, key=KEY))
    sched.on_new_request(req)
    assert sched.receiver.heartbeats["d1"].prompt == (prompt_digest(prompt, 64), 64)
    assert sched.get_num_new_matched_tokens(req, 0) == (64, True)
    sched.update_state_after_alloc(req, _blocks([1, 2], 0), 64)
    (load,) = step(sched, {}).loads
    assert (load.prompt_digest, load.prompt_tokens) == (prompt_digest(prompt, 64), 64)
    assert counters(sched) == {}
    sched.shutdown()


def test_without_a_token_the_mac_is_not_checked():
    sched = make("kv_consumer")
    req = vllm_request("d1", list(range(64)), _decode_params(64, key=params_mac_key("x" * 8),
                                                              remote_port=5701))
    sched.on_new_request(req)
    assert sched.get_num_new_matched_tokens(req, 0) == (64, True)
    sched.shutdown()


def test_params_naming_a_peer_outside_the_allowlist_are_refused_before_dialing():
    sched = make("kv_consumer", prefill_peers=["127.0.0.1:5700", "10.0.0.0/8"])
    ok = vllm_request("ok", list(range(64)), _decode_params(64))
    sched.on_new_request(ok)
    assert sched.get_num_new_matched_tokens(ok, 0) == (64, True)
    for i, (host, port) in enumerate([("127.0.0.1", 5701), ("192.168.0.1", 5700),
                                      ("prefill.example", 5700)]):
        req = vllm_request(f"d{i}", list(range(64)),
                           _decode_params(64, remote_host=host, remote_port=port))
        sched.on_new_request(req)
        _nothing_dialed(sched, req)
    assert counters(sched) == {"failures|reason=peer_not_allowed": 3}
    sched.shutdown()


def test_the_prefill_engine_signs_its_params_and_binds_the_lease_to_the_prompt():
    prefill = make("kv_producer", auth_token=TOKEN)
    mgr = FakeManager()
    prefill.bind_kv_cache_manager(mgr)
    prompt = list(range(500, 570))
    req = vllm_request("p1", prompt, {"do_remote_decode": True})
    prefill.on_new_request(req)
    mgr.blocks["p1"] = [1, 2, 3]
    step(prefill, {"p1": 70})
    req.num_computed_tokens = 70
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    _, params = prefill.request_finished(req, [1, 2, 3])
    RemotePrefill.parse(params, BS).verify_mac(KEY)
    lease = prefill.pool.get_lease("p1")
    assert lease is not None
    assert (lease.prompt_digest, lease.num_tokens) == (prompt_digest(prompt, 70), 70)
    # the fallback answer is signed as well (nothing in it may be swapped either)
    fb = make("kv_producer", auth_token=TOKEN, staging_bytes="64KiB")
    fb.bind_kv_cache_manager(mgr)
    big = vllm_request("p2", list(range(4000)), {"do_remote_decode": True})
    fb.on_new_request(big)
    mgr.blocks["p2"] = list(range(125))
    step(fb, {"p2": 4000})
    big.num_computed_tokens = 4000
    big.status = RequestStatus.FINISHED_LENGTH_CAPPED
    _, fallback = fb.request_finished(big, [])
    assert fallback["turbowire_fallback"] == "staging_full"
    RemotePrefill.parse(fallback, BS).verify_mac(KEY)
    prefill.shutdown()
    fb.shutdown()


def test_the_forged_hash_case_without_a_token_is_refused_by_the_prefill_engine():
    """Params of prompt P' with turbowire_prompt_hash replaced by P's digest, presented with P:
    the decode engine's own check passes (the hash says P), its claim presents P's digest and
    the prefill engine, which staged P', refuses it (counted prompt_mismatch once); the holder
    may still release the lease."""
    prefill = make("kv_producer")
    mgr = FakeManager()
    prefill.bind_kv_cache_manager(mgr)
    p_prime, p = list(range(1000, 1045)), list(range(2000, 2045))
    req = vllm_request("p-prime", p_prime, {"do_remote_decode": True})
    prefill.on_new_request(req)
    mgr.blocks["p-prime"] = [1, 2]
    step(prefill, {"p-prime": 45})
    req.num_computed_tokens = 45
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    _, params = prefill.request_finished(req, [1, 2])
    prefill.get_stats()
    forged = {**params, "turbowire_prompt_hash": prompt_digest(p, 45)}

    decode = make("kv_consumer")
    victim = vllm_request("d-p", p, forged)
    decode.on_new_request(victim)
    assert decode.get_num_new_matched_tokens(victim, 0) == (45, True)  # the local check passes
    decode.update_state_after_alloc(victim, _blocks([5, 6], 0), 45)
    (load,) = step(decode, {}).loads
    assert (load.prompt_digest, load.prompt_tokens) == (prompt_digest(p, 45), 45)
    leases = GaugedLeases(prefill.sender)
    for _ in range(2):  # the claim, then a heartbeat: refused both times, counted once
        answer = leases.heartbeat([load.remote_request_id], [load.lease_token],
                                  [(load.prompt_digest, load.prompt_tokens)])
        assert answer == ([], ["p-prime"], []) and answer.mismatched == ["p-prime"]
    assert counters(prefill) == {"failures|reason=prompt_mismatch": 1}
    assert leases.release(["p-prime"], 0, [load.lease_token]) == (["p-prime"], [], [])
    assert prefill.pool.snapshot().used_slots == 0
    prefill.shutdown()
    decode.shutdown()


# ---- M2: heartbeats to a peer that never answers delay no other peer ---------------------------
class SlowPeers:
    """A ClientPool: calls to ``hung`` block until released, the others answer at once."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.calls: list[tuple[str, float, list[tuple[str, int]] | None]] = []

    def get(self, host, port):
        pool = self

        class Client:
            def heartbeat(self, ids, engine_id="", lease_tokens=None, prompts=None, tp_size=0):
                pool.calls.append((host, time.monotonic(), prompts))
                if host == "hung.example":
                    pool.release.wait(10)
                return SimpleNamespace(done=list(ids), unknown=[], refused=[],
                                       prompt_mismatch=[])
        return Client()

    def close(self):
        pass


def test_heartbeats_go_to_each_peer_on_its_own_thread():
    sched = make("kv_consumer")
    peers = SlowPeers()
    sched.receiver.clients = peers
    for rid, host in [("d-hung", "hung.example"), ("d-ok", "127.0.0.1")]:
        req = vllm_request(rid, list(range(64)), _decode_params(64, remote_host=host))
        sched.on_new_request(req)
        sched.receiver.heartbeats[rid].last_sent = 0.0  # due now
    try:
        t0 = time.monotonic()
        sched.receiver.send_heartbeats()
        assert time.monotonic() - t0 < 0.5  # the maintenance thread never waits on a peer
        deadline = time.monotonic() + 5
        while not any(h == "127.0.0.1" for h, _, _ in peers.calls):
            assert time.monotonic() < deadline, "the healthy peer's heartbeat never went out"
            time.sleep(0.01)
        for rid in sched.receiver.heartbeats:
            sched.receiver.heartbeats[rid].last_sent = 0.0
        sched.receiver.send_heartbeats()  # the hung peer's last one is still on the wire: skipped
        deadline = time.monotonic() + 5
        while sum(h == "127.0.0.1" for h, _, _ in peers.calls) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert sum(h == "hung.example" for h, _, _ in peers.calls) == 1
        assert peers.calls[-1][2] == [(prompt_digest(list(range(64)), 64), 64)]
    finally:
        peers.release.set()
        sched.shutdown()


def test_a_mismatched_or_refused_lease_is_not_heartbeated_again():
    sched = make("kv_consumer")
    req = vllm_request("d1", list(range(64)), _decode_params(64))
    sched.on_new_request(req)
    target = sched.receiver.heartbeats["d1"]
    sched.receiver.heartbeat_answered("127.0.0.1", 5700, [target], SimpleNamespace(
        done=[], unknown=["p-req"], refused=[], prompt_mismatch=["p-req"]))
    assert "d1" not in sched.receiver.heartbeats
    sched.shutdown()


# ---- M5: what the engine says at start --------------------------------------------------------
def _warnings(caplog, **extra) -> list[str]:
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="turbowire.connector.scheduler"):
        make(**extra).shutdown()
    return [r.getMessage() for r in caplog.records if "turbowire security" in r.getMessage()]


def test_start_up_warnings_name_the_exposure_and_never_the_secret(caplog, tmp_path):
    lines = _warnings(caplog, role="kv_both")
    assert any("serves without auth_token" in w for w in lines)
    assert any("binds 0.0.0.0:5700 (not loopback) without TLS" in w for w in lines)
    assert any("kv_transfer_params are not authenticated" in w for w in lines)
    inline = _warnings(caplog, role="kv_both", auth_token=TOKEN, side_channel_bind="127.0.0.1")
    assert len(inline) == 1 and "given inline" in inline[0] and TOKEN not in inline[0]
    secret = tmp_path / "token"
    secret.write_text(TOKEN + "\n")
    assert _warnings(caplog, role="kv_both", auth_token_file=str(secret),
                     side_channel_bind="127.0.0.1") == []
    assert TOKEN not in caplog.text
    consumer = _warnings(caplog, role="kv_consumer")
    assert len(consumer) == 1 and "not authenticated" in consumer[0]


def test_the_token_is_read_from_a_file_and_never_echoed(tmp_path):
    from turbowire.connector.config import ConnectorConfigError

    f = tmp_path / "token"
    f.write_text(f"  {TOKEN}\n")
    assert TurboWireConfig.from_extra_config({"auth_token_file": str(f)},
                                             environ={}).auth_token == TOKEN
    # the file wins over the environment variable, inline and file together are refused
    cfg = TurboWireConfig.from_extra_config({"auth_token_file": str(f)},
                                            environ={"TURBOWIRE_AUTH_TOKEN": "env-token-1"})
    assert cfg.auth_token == TOKEN
    with pytest.raises(ConnectorConfigError, match="both set"):
        TurboWireConfig.from_extra_config({"auth_token": TOKEN, "auth_token_file": str(f)},
                                          environ={})
    with pytest.raises(ConnectorConfigError, match="cannot be read") as info:
        TurboWireConfig.from_extra_config({"auth_token_file": str(tmp_path / "nope")},
                                          environ={})
    short = tmp_path / "short"
    short.write_text("s3cret")
    with pytest.raises(ConnectorConfigError, match="auth_token is too short") as info:
        TurboWireConfig.from_extra_config({"auth_token_file": str(short)}, environ={})
    assert "s3cret" not in str(info.value)
    big = tmp_path / "big"
    big.write_text("x" * 5000)
    with pytest.raises(ConnectorConfigError, match="larger than 4096 bytes") as info:
        TurboWireConfig.from_extra_config({"auth_token_file": str(big)}, environ={})
    assert "xxxx" not in str(info.value)
    empty = tmp_path / "empty"
    empty.write_text("\n")
    assert TurboWireConfig.from_extra_config({"auth_token_file": str(empty)},
                                             environ={}).auth_token is None


# ---- M1: claim deadline, age cap and per-request share, from the config ------------------------
def test_pool_limits_come_from_the_config():
    sched = make("kv_producer", lease_seconds=20, claim_timeout_seconds=4,
                 lease_max_seconds=60, staging_request_share=0.25)
    pool = sched.pool
    assert (pool.claim_seconds, pool.max_age_seconds) == (4, 60)
    assert pool.max_request_slots == max(1, int(0.25 * sched.layout.num_slots))
    default = make("kv_producer")
    assert (default.pool.claim_seconds, default.pool.max_age_seconds) == (10, 120)
    assert default.pool.max_request_slots is None
    short = make("kv_producer", lease_seconds=3, lease_max_seconds=1)
    assert (short.pool.claim_seconds, short.pool.max_age_seconds) == (3, 3)  # never below
    for s in (sched, default, short):
        s.shutdown()


def test_a_request_over_its_share_of_the_pool_falls_back_by_its_own_reason():
    sched = make("kv_producer", staging_request_share=0.1)
    mgr = FakeManager()
    sched.bind_kv_cache_manager(mgr)
    cap = sched.pool.max_request_slots
    n = (cap + 1) * BS
    req = vllm_request("big", list(range(n)), {"do_remote_decode": True})
    sched.on_new_request(req)
    mgr.blocks["big"] = list(range(cap + 1))
    assert step(sched, {"big": n}).saves == []
    req.num_computed_tokens = n
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    _, params = sched.request_finished(req, [])
    assert params["turbowire_fallback"] == "staging_share"
    assert counters(sched) == {"fallbacks|reason=staging_share": 1}
    assert sched.pool.snapshot().used_slots == 0
    sched.shutdown()


@pytest.mark.parametrize("share", [0, -0.5, 1.5, "nan", True, "x"])
def test_a_bad_share_is_refused_at_start(share):
    from turbowire.connector.config import ConnectorConfigError

    with pytest.raises(ConnectorConfigError, match="staging_request_share"):
        TurboWireConfig.from_extra_config({"staging_request_share": share}, environ={})


@pytest.mark.parametrize(("key", "value"), [("claim_timeout_seconds", 1.5),
                                            ("max_peers", 0), ("max_peers", 4097)])
def test_new_bounds_are_refused_at_start(key, value):
    from turbowire.connector.config import ConnectorConfigError

    with pytest.raises(ConnectorConfigError, match=f"^{key}="):
        TurboWireConfig.from_extra_config({key: value}, environ={})


def test_the_token_is_not_in_the_configs_repr():
    cfg = TurboWireConfig.from_extra_config({"auth_token": TOKEN}, environ={})
    assert cfg.auth_token == TOKEN and TOKEN not in repr(cfg) and TOKEN not in f"{cfg}"
