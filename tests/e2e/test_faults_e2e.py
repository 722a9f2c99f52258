"""Fault matrix with real engines (issue 17): what a P/D pair does when a peer dies, stalls,
comes back, does not show up, differs, or is handed malformed ``kv_transfer_params``.

Five vLLM CPU engines (tiny model, preset ``raw`` so that a transferred prompt answers exactly
like a single engine), started together once for the module, talking straight over HTTP (the
toy-proxy two-step flow: the prompt to a prefill engine with ``do_remote_decode``, its
``kv_transfer_params`` to a decode engine):

- ``pmain``: the prefill engine every decode engine keeps using (never killed, briefly stopped);
- ``pkill``: a prefill engine with a fixed ``engine_id`` that is SIGKILLed (whole process group)
  while decode engines hold its handshake and its leases, then restarted under the same id and
  ports while the other tests run;
- ``ptq4``: a prefill engine with preset ``tq4`` (an incompatible peer for the ``raw`` decoders);
- ``drec``: a decode engine with ``load_failure_policy=recompute``, ``transfer_timeout_seconds``
  12, side-channel calls timing out after 2 s and a 64 KiB receive buffer (so a 150-token prompt
  cannot fit and a 60-token one needs nearly all of it);
- ``dfail``: a decode engine with ``load_failure_policy=fail``, SIGKILLed by the last fault.

Every fault prints ``FAULT|name|outcome|seconds|leaked`` (collect with ``pytest -s``): how long
until the client had its answer (or error), and what was still held afterwards (prefill staging
and leases over the real side channel, the decode engine's requests and KV cache usage from its
``/metrics``, its receive buffer by a load that needs nearly all of it).

Integration tests cover what needs no engine: each compatibility field at the gRPC handshake
(tests/integration/test_connector_handshake.py), corrupted and truncated payloads
(tests/integration/test_faults_payload.py); the loader's quarantine and stale handshakes with a
fake transport (tests/unit/connector/test_loader.py).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import copy
import itertools
import json
import math
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from conftest import BLOCK_SIZE, MODEL_NAME, metric_sum, scrape_metrics
from test_connector_e2e_raw import prompt_ids

from turbowire.serving.launch import (
    EngineSpec,
    EngineStartError,
    ManagedProcess,
    free_port,
    start_engine,
    turbowire_kv_config,
)

pytestmark = pytest.mark.e2e

LEASE_S = 6.0  # every engine's lease_seconds
TIMEOUT_S = 12.0  # transfer_timeout_seconds of both decode engines
CALL_S = 2.0  # handshake_timeout_seconds: side-channel calls of the decode engines
RECV_BYTES = 64 << 10  # drec's receive buffer: ~62 tokens of raw KV of the tiny model
PKILL_ENGINE_ID = "tw-faults-prefill-kill"
FAILURES = "turbowire_kv_transfer_failures_total"
REAPER_S = 0.5  # the prefill scheduler's maintenance period (scheduler.MAINTENANCE_PERIOD_S)
MAX_TOKENS = 8
# gRPC's default reconnect backoff grows to 120 s: a decode engine may refuse to retry a peer
# that was down for minutes for up to that long after it is back (see the restart test)
RECONNECT_S = 150.0

_seeds = itertools.count(170_000)


def fresh_prompt(n: int) -> list[int]:
    """A prompt no engine has seen (no prefix-cache hit can make a case vacuous)."""
    return prompt_ids(next(_seeds), n)


@dataclass
class Engine:
    name: str
    spec: EngineSpec
    proc: ManagedProcess

    @property
    def url(self) -> str:
        return self.proc.url

    @property
    def side_port(self) -> int:
        assert self.spec.side_channel_port is not None
        return self.spec.side_channel_port

    def alive(self) -> bool:
        return self.proc.alive()

    def signal_group(self, sig: int) -> None:
        os.killpg(self.proc.popen.pid, sig)

    def kill(self) -> None:
        """SIGKILL the engine's whole process tree (API server, engine core, worker)."""
        pgid = self.proc.popen.pid
        os.killpg(pgid, signal.SIGKILL)
        self.proc.popen.wait(timeout=30)
        deadline = time.monotonic() + 10
        while _group_members(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _group_members(pgid), f"{self.name}: processes survived SIGKILL"

    def pool(self):
        """The prefill engine's staging pool now, over its real side channel."""
        from turbowire.connector.sidechannel.client import SideChannelClient

        client = SideChannelClient("127.0.0.1", self.side_port, None, timeout=10)
        try:
            return client.pool_status()
        finally:
            client.close()

    def wait_pool_empty(self, timeout: float) -> float | None:
        """Seconds until no staging slot and no lease is held, None if still held."""
        t0 = time.monotonic()
        while True:
            status = self.pool()
            if status.used_slots == 0 and status.leases == 0:
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout:
                return None
            time.sleep(0.1)

    def metrics(self) -> dict[str, float]:
        return scrape_metrics(self.url)

    def log(self) -> str:
        return self.proc.log_text()


def _group_members(pgid: int) -> list[str]:
    out = subprocess.run(["ps", "-o", "pid=,stat=", "-g", str(pgid)], capture_output=True,
                         text=True).stdout
    return [line for line in out.splitlines() if line.strip() and "Z" not in line.split()[1]]


@dataclass
class Faults:
    engines: dict[str, Engine]
    log_dir: Path
    extra: list[ManagedProcess] = field(default_factory=list)  # restarted engines, to stop
    refs: dict[tuple[int, ...], str] = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)
    not_started: dict[str, str] = field(default_factory=dict)  # engine -> why

    def __getitem__(self, name: str) -> Engine:
        """An engine of the matrix; a test needing one that failed to start fails (only it)."""
        if name in self.not_started:
            pytest.fail(f"engine {name} failed to start: {self.not_started[name]}")
        return self.engines[name]

    # ---- requests
    @staticmethod
    def post(engine: Engine, prompt, kv=None, max_tokens: int = MAX_TOKENS,
             timeout: float = 120) -> tuple[httpx.Response, float]:
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0}
        if kv is not None:
            body["kv_transfer_params"] = kv
        # serialized here: httpx refuses NaN/Infinity, which a client may well send
        content = json.dumps(body).encode()
        t0 = time.monotonic()
        r = httpx.post(engine.url + "/v1/completions", content=content, timeout=timeout,
                       headers={"content-type": "application/json"})
        return r, time.monotonic() - t0

    def prefill(self, engine: Engine, prompt) -> dict:
        r, _ = self.post(engine, prompt, {"do_remote_decode": True}, max_tokens=1)
        assert r.status_code == 200, r.text
        kv = r.json()["kv_transfer_params"]
        assert kv["remote_block_ids"] and kv["turbowire_fallback"] is None, kv
        return kv

    def reference(self, prompt) -> str:
        """The answer of one engine alone (pmain, no kv_transfer_params)."""
        key = tuple(prompt)
        if key not in self.refs:
            r, _ = self.post(self["pmain"], prompt)
            assert r.status_code == 200, r.text
            self.refs[key] = r.json()["choices"][0]["text"]
        return self.refs[key]

    def load(self, r: httpx.Response) -> dict | None:
        return ((r.json().get("kv_transfer_params") or {}).get("turbowire_load")
                if r.status_code == 200 else None)

    def transfer_ok(self, decode: Engine, n: int = 40, prefill: str = "pmain") -> None:
        """A clean P/D request: transferred in full and answered like a single engine."""
        prompt = fresh_prompt(n)
        ref = self.reference(prompt)
        r, _ = self.post(decode, prompt, self.prefill(self[prefill], prompt))
        assert r.status_code == 200, r.text
        load = self.load(r)
        assert load and load["failed"] is None and load["tokens"] == n, load
        assert r.json()["choices"][0]["text"] == ref

    # ---- leaks
    def decode_idle(self, decode: Engine, timeout: float = 15) -> list[str]:
        """What a decode engine still holds once idle: requests, KV blocks (vLLM's gauges)."""
        deadline = time.monotonic() + timeout
        while True:
            m = decode.metrics()
            held = {
                "requests": metric_sum(m, "vllm:num_requests_running")
                + metric_sum(m, "vllm:num_requests_waiting"),
                "kv_fetches": metric_sum(m, "vllm:num_requests_kv_fetch_by_stage"),
                "kv_blocks%": metric_sum(m, "vllm:kv_cache_usage_perc") * 100,
            }
            leaked = [f"{decode.name}:{k}={v:g}" for k, v in held.items() if v]
            if not leaked or time.monotonic() > deadline:
                return leaked
            time.sleep(0.3)

    def recv_whole(self) -> list[str]:
        """drec's receive buffer is whole: a load needing ~94 % of it is transferred at once."""
        prompt = fresh_prompt(60)
        ref = self.reference(prompt)
        r, seconds = self.post(self["drec"], prompt, self.prefill(self["pmain"], prompt))
        load = self.load(r)
        if r.status_code != 200 or r.json()["choices"][0]["text"] != ref:
            return [f"drec:recv-probe-answer({r.status_code})"]
        if not load or load["failed"] is not None or load["tokens"] != 60:
            return [f"drec:recv-buffer(probe load {load and load['failed']}, {seconds:.1f}s)"]
        return []

    def prefill_leaks(self, *names: str, timeout: float = 10) -> list[str]:
        out = []
        for name in names:
            if self.wait_pool_empty(name, timeout) is None:
                status = self[name].pool()
                out.append(f"{name}:staging={status.used_slots}slots,{status.leases}leases")
        return out

    def wait_pool_empty(self, name: str, timeout: float) -> float | None:
        return self[name].wait_pool_empty(timeout)

    def quiesce(self, name: str) -> None:
        """Wait until the leases earlier tests left on a prefill engine have expired."""
        assert self.wait_pool_empty(name, LEASE_S + 5) is not None, self[name].pool()

    def record(self, name: str, outcome: str, seconds: float, leaked: list[str]) -> None:
        line = f"FAULT|{name}|{outcome}|{seconds:.2f}|{','.join(leaked) or 'none'}"
        self.lines.append(line)
        print(line, flush=True)


def failures(engine: Engine) -> dict[str, float]:
    out: dict[str, float] = {}
    for key, value in engine.metrics().items():
        if key.startswith(FAILURES + "{") and 'reason="' in key:
            reason = key.split('reason="', 1)[1].split('"', 1)[0]
            out[reason] = out.get(reason, 0.0) + value
    return out


def counted(engine: Engine, before: dict[str, float], timeout: float = 15) -> dict[str, float]:
    """Failure reasons counted since ``before`` (vLLM publishes them with the next steps)."""
    deadline = time.monotonic() + timeout
    while True:
        now = failures(engine)
        delta = {k: v - before.get(k, 0.0) for k, v in now.items() if v > before.get(k, 0.0)}
        if delta or time.monotonic() > deadline:
            return delta
        time.sleep(0.3)


def _spec(name: str, cpu: int, port: int, side: int, engine_id: str | None = None,
          **extra) -> EngineSpec:
    kv = turbowire_kv_config(side_channel_port=side, lease_seconds=LEASE_S, **extra)
    if engine_id:
        kv["engine_id"] = engine_id
    return EngineSpec(name, Path(), port, cpu=cpu, kv_transfer_config=kv, kvcache_gib=1,
                      block_size=BLOCK_SIZE, max_model_len=2048, max_num_seqs=8,
                      max_num_batched_tokens=1024, served_model_name=MODEL_NAME)


@pytest.fixture(scope="module")
def faults(tiny_model, engine_slot, tmp_path_factory) -> Iterator[Faults]:
    log_dir = tmp_path_factory.mktemp("logs-faults")
    small = {"recv_bytes": "1MiB"}  # prefill engines receive nothing
    decode = {"staging_bytes": "1MiB", "transfer_timeout_seconds": TIMEOUT_S,
              "handshake_timeout_seconds": CALL_S}
    specs = {
        "pmain": dict(cpu=0, preset="raw", staging_bytes="8MiB", **small),
        "pkill": dict(cpu=0, preset="raw", staging_bytes="4MiB", engine_id=PKILL_ENGINE_ID,
                      **small),
        "ptq4": dict(cpu=0, preset="tq4", staging_bytes="4MiB", **small),
        "drec": dict(cpu=1, preset="raw", load_failure_policy="recompute",
                     recv_bytes=RECV_BYTES, **decode),
        "dfail": dict(cpu=1, preset="raw", load_failure_policy="fail", recv_bytes="4MiB",
                      **decode),
    }
    f = Faults({}, log_dir)
    try:
        for name, kw in specs.items():
            spec = _spec(name, port=free_port(), side=free_port(), **kw)
            spec.model = tiny_model
            f.engines[name] = Engine(name, spec, start_engine(spec, log_dir))
        t0 = time.monotonic()
        for name, engine in f.engines.items():
            try:
                engine.proc.wait_healthy(900)
            except EngineStartError as exc:  # fails the tests that need this engine, not all
                f.not_started[name] = exc.summary()
        print(f"\n{len(f.engines) - len(f.not_started)} engines healthy after "
              f"{time.monotonic() - t0:.0f} s; not started: {sorted(f.not_started) or 'none'}")
        # warm-up: every decode engine handshakes with both raw prefill engines and moves KV
        for d in ("drec", "dfail"):
            for p in ("pmain", "pkill"):
                if not {d, p} & f.not_started.keys():
                    f.transfer_ok(f[d], prefill=p)
        yield f
    finally:
        for engine in f.engines.values():
            engine.proc.stop()
        for proc in f.extra:
            proc.stop()
        if f.lines:
            print("\n" + "\n".join(f.lines))


# -- a. the prefill engine dies while decode engines hold its handshake and leases -------------


@pytest.fixture(scope="module")
def prefill_killed(faults) -> dict:
    """Stage prompts on pkill, SIGKILL its process tree while drec READs some of them, then
    restart it under the same engine_id and ports in the background (for the recovery test)."""
    f = faults
    during = [fresh_prompt(40 + 7 * i) for i in range(4)]
    after_rec, after_fail = fresh_prompt(45), fresh_prompt(45)
    for prompt in (*during, after_rec, after_fail):
        f.reference(prompt)
    params = {tuple(p): f.prefill(f["pkill"], p) for p in (*during, after_rec, after_fail)}
    before = {"drec": failures(f["drec"]), "dfail": failures(f["dfail"])}
    with cf.ThreadPoolExecutor(len(during)) as pool:
        futures = [pool.submit(f.post, f["drec"], p, params[tuple(p)]) for p in during]
        time.sleep(0.03)  # the first loads are on their way
        t_kill = time.monotonic()
        f["pkill"].kill()
        results = [fut.result() for fut in futures]
    # the same ports: decode engines know this peer by them
    restarted = start_engine(f["pkill"].spec, f.log_dir / "restarted", fresh_ports_on_clash=False)
    f.extra.append(restarted)
    return dict(during=during, during_results=results, t_kill=t_kill, params=params,
                after_rec=after_rec, after_fail=after_fail, before=before, restarted=restarted)


def test_prefill_killed_recompute_policy_answers_right_within_the_timeout(faults, prefill_killed):
    f, k = faults, prefill_killed
    outcomes = []
    for prompt, (r, seconds) in zip(k["during"], k["during_results"], strict=True):
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == f.reference(prompt)
        assert seconds < TIMEOUT_S
        outcomes.append((f.load(r) or {}).get("failed") or "transferred")
    prompt = k["after_rec"]
    r, seconds = f.post(f["drec"], prompt, k["params"][tuple(prompt)])
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == f.reference(prompt)
    reason = f.load(r)["failed"]
    assert reason in ("transport", "peer_unreachable"), f.load(r)
    assert seconds < TIMEOUT_S, f"{seconds:.1f} s: not within transfer_timeout_seconds"
    delta = counted(f["drec"], k["before"]["drec"])
    assert set(delta) & {"transport", "peer_unreachable"}, delta
    # the decode engine keeps serving, with the other prefill engine
    f.transfer_ok(f["drec"])
    leaked = f.decode_idle(f["drec"]) + f.recv_whole()
    during = "/".join(sorted(set(outcomes)))
    f.record("prefill-sigkill-during-reads(recompute)", f"answers-right:{during}",
             max(s for _, s in k["during_results"]), leaked)
    f.record("prefill-sigkill-before-read(recompute)", f"recomputed:{reason}", seconds, leaked)
    assert leaked == []


def test_prefill_killed_fail_policy_is_a_clean_error_and_the_engine_keeps_serving(
        faults, prefill_killed):
    f, k = faults, prefill_killed
    prompt = k["after_fail"]
    r, seconds = f.post(f["dfail"], prompt, k["params"][tuple(prompt)])
    assert r.status_code >= 400, f"fail policy must fail the request: {r.status_code} {r.text}"
    assert "error" in r.json(), r.text
    assert seconds < TIMEOUT_S
    assert f["dfail"].alive()
    delta = counted(f["dfail"], k["before"]["dfail"])
    assert set(delta) & {"transport", "peer_unreachable"}, delta
    f.transfer_ok(f["dfail"])
    leaked = f.decode_idle(f["dfail"])
    f.record("prefill-sigkill-before-read(fail)", f"http-{r.status_code}:{sorted(delta)}",
             seconds, leaked)
    assert leaked == []


# -- f (e2e). A stalled prefill engine: READs stay on the wire after the load failed ------------


def test_stalled_prefill_quarantines_the_receive_range_and_gives_it_back(faults):
    """SIGSTOP the prefill engine after it answered: drec's claim times out (2 s) and is sent
    again while the lease may hold (lease_seconds, 6 s), then the prompt is recomputed, and the
    READs it had posted stay PENDING, so their receive range is quarantined (never decoded from,
    never handed to another load). After SIGCONT the READs end and the
    range comes back: a load needing ~94 % of the 64 KiB buffer then goes through at once
    (before the fix it waited for transfer_timeout_seconds and failed ``timeout``)."""
    f = faults
    prompt = fresh_prompt(40)
    ref = f.reference(prompt)
    f.post(f["drec"], prompt[:BLOCK_SIZE] + fresh_prompt(3))  # drec caches block 0 of prompt:
    # only the last 8 tokens move, READs small enough to need the stopped engine's progress
    f.quiesce("pmain")
    kv = f.prefill(f["pmain"], prompt)
    before = failures(f["drec"])
    log_before = len(f["drec"].log())
    f["pmain"].signal_group(signal.SIGSTOP)
    try:
        r, seconds = f.post(f["drec"], prompt, kv)
    finally:
        f["pmain"].signal_group(signal.SIGCONT)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == ref, r.text
    assert f.load(r)["failed"] == "peer_unreachable", f.load(r)
    assert CALL_S <= seconds < TIMEOUT_S
    assert "peer_unreachable" in counted(f["drec"], before)
    quarantined = "quarantined" in f["drec"].log()[log_before:]
    deadline = time.monotonic() + 20
    while (quarantined and "reclaimed" not in f["drec"].log()[log_before:]
           and time.monotonic() < deadline):
        time.sleep(0.2)
    leaked = f.recv_whole() + f.decode_idle(f["drec"])
    # the stalled request's lease: drec's release could not reach the stopped engine; the lease
    # expires on its own (counted lease_expired), within lease_seconds of the engine resuming
    waited = f.wait_pool_empty("pmain", LEASE_S + 5)
    if waited is None:
        leaked.append("pmain:staging")
    f.record("prefill-sigstop(recompute)",
             f"recomputed:peer_unreachable,{'quarantined+reclaimed' if quarantined else 'no-read'}",
             seconds, leaked)
    assert leaked == []


# -- c. no-show and late readers, requests that cannot fit ---------------------------------------


def test_late_reader_after_the_lease_expired_recomputes(faults):
    f = faults
    prompt = fresh_prompt(45)
    ref = f.reference(prompt)
    f.quiesce("pmain")
    p_before = failures(f["pmain"])
    kv = f.prefill(f["pmain"], prompt)
    expired_after = f.wait_pool_empty("pmain", LEASE_S + 5)
    assert expired_after is not None and expired_after > LEASE_S - 3, expired_after
    d_before = failures(f["drec"])
    r, seconds = f.post(f["drec"], prompt, kv)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == ref, r.text
    assert f.load(r)["failed"] == "lease_expired"
    assert counted(f["drec"], d_before).get("lease_expired") == 1
    f.post(f["pmain"], "x y z", max_tokens=1)  # an engine step publishes the prefill's counters
    assert counted(f["pmain"], p_before).get("lease_expired", 0) >= 1
    leaked = f.decode_idle(f["drec"]) + f.prefill_leaks("pmain")
    f.record("decode-no-show-then-late-reader", "recomputed:lease_expired",
             seconds, leaked)
    f.record("unread-lease-expiry(no-show)", "prefill-freed:lease_expired", expired_after, [])
    assert leaked == []


def test_request_larger_than_the_receive_buffer_falls_back_at_once(faults):
    """150 raw tokens need ~154 KB of receive buffer, drec has 64 KiB: the load fails at its
    first step (no waiting for space that can never be free) and the prompt is recomputed."""
    f = faults
    prompt = fresh_prompt(150)
    ref = f.reference(prompt)
    kv = f.prefill(f["pmain"], prompt)
    before = failures(f["drec"])
    r, seconds = f.post(f["drec"], prompt, kv)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == ref, r.text
    assert f.load(r)["failed"] == "recv_buffer_too_small"
    assert counted(f["drec"], before).get("recv_buffer_too_small") == 1
    assert seconds < TIMEOUT_S / 3, f"{seconds:.1f} s: it waited (timeout {TIMEOUT_S} s)"
    leaked = f.decode_idle(f["drec"]) + f.prefill_leaks("pmain", timeout=5)  # released at once
    f.record("request-larger-than-recv-buffer", "recomputed:recv_buffer_too_small", seconds,
             leaked)
    assert leaked == []


# -- d. incompatible peers ---------------------------------------------------------------------


def test_incompatible_preset_is_refused_naming_the_field_and_recomputed(faults):
    """ptq4 (tq4) -> drec (raw). Honest params carry ``turbowire_preset``: the decode scheduler
    refuses them before any handshake. A proxy that rewrote the field gets past that check and
    the handshake refuses the pair, naming ``preset``. Both: recomputed, counted incompatible."""
    f = faults
    for forged in (False, True):
        prompt = fresh_prompt(40)
        ref = f.reference(prompt)
        kv = f.prefill(f["ptq4"], prompt)
        if forged:
            kv = {**kv, "turbowire_preset": "raw"}
        before = failures(f["drec"])
        log_before = len(f["drec"].log())
        r, seconds = f.post(f["drec"], prompt, kv)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == ref, r.text
        assert counted(f["drec"], before) == {"incompatible": 1}
        new_log = f["drec"].log()[log_before:]
        if forged:
            assert f.load(r)["failed"] == "incompatible"
            assert "preset differs" in new_log, new_log[-2000:]
        else:
            assert f.load(r) is None  # nothing was loaded: no report
            assert "prefill preset 'tq4' differs from this engine's 'raw'" in new_log
        leaked = f.decode_idle(f["drec"]) + f.prefill_leaks("ptq4")
        f.record(f"incompatible-preset{'-forged-params' if forged else ''}",
                 f"recomputed:incompatible({'handshake' if forged else 'params'})", seconds,
                 leaked)
        assert leaked == []


# -- e. malformed kv_transfer_params -------------------------------------------------------------


def _replace(**over):
    return lambda kv, other: {**kv, **over}


def _first_slot(slot: int):
    return lambda kv, other: {**kv, "remote_block_ids": [slot, *kv["remote_block_ids"][1:]]}


MALFORMED = {
    # name: (params made from a live lease ``kv`` and ``other()``, the params of another live
    #        lease; expectation: the failure reason counted, "transferred", or the HTTP status)
    "negative-block-id": (_first_slot(-1), "bad_params"),
    "huge-block-id": (_first_slot(10**12), "bounds"),
    "block-id-beyond-uint64": (_first_slot(2**70), "http-400"),
    "duplicated-block-ids": (
        lambda kv, o: {**kv, "remote_block_ids": [kv["remote_block_ids"][0]] * 2}, "bad_params"),
    "block-ids-of-another-request": (
        lambda kv, o: {**kv, "remote_block_ids": o()["remote_block_ids"]}, "format"),
    "request-id-of-another-request": (
        # the claim presents this request's lease token for the other request's lease, which
        # the prefill engine holds: refused (not expired; the other lease is left alone), so
        # the load fails as lease_refused before any chunk is decoded
        lambda kv, o: {**kv, "remote_request_id": o()["remote_request_id"]}, "lease_refused"),
    "oversized-block-list": (_replace(remote_block_ids=list(range(200_000))), "bad_params"),
    "oversized-consistent-list": (_replace(remote_block_ids=list(range(10**6, 10**6 + 100_000)),
                                           remote_num_tokens=100_000 * BLOCK_SIZE), "bounds"),
    "oversized-host": (_replace(remote_host="h" * 1_000_000), "bad_params"),
    "oversized-engine-id": (_replace(remote_engine_id="e" * 1_000_000), "bad_params"),
    "oversized-request-id": (_replace(remote_request_id="r" * 1_000_000), "bad_params"),
    "block-ids-a-string": (_replace(remote_block_ids="0,1"), "bad_params"),
    "block-ids-nested": (_replace(remote_block_ids=[[0], [1]]), "bad_params"),
    "num-tokens-a-float": (_replace(remote_num_tokens=45.0), "bad_params"),
    "num-tokens-too-many": (_replace(remote_num_tokens=64), "transferred"),
    "port-a-string": (_replace(remote_port="5700"), "bad_params"),
    "port-zero": (_replace(remote_port=0), "bad_params"),
    "tp-size-a-string": (_replace(tp_size="1"), "bad_params"),
    "prompt-hash-an-int": (_replace(turbowire_prompt_hash=123), "bad_params"),
    "unknown-fields": (_replace(foo="bar", remote_xyz=[1, 2], turbowire_zzz={"a": 1}),
                       "transferred"),
    "unreachable-host": (_replace(remote_host="127.0.0.2", remote_port=1), "peer_unreachable"),
    # gRPC would read these as a target of its own (a resolver scheme, a unix socket, a port):
    # remote_host must be a plain host name or IP literal (issue 33)
    "host-a-grpc-target": (_replace(remote_host="dns:///127.0.0.1"), "bad_params"),
    "host-a-unix-socket": (_replace(remote_host="unix:/tmp/tw.sock"), "bad_params"),
    "host-with-a-port": (_replace(remote_host="127.0.0.1:1"), "bad_params"),
    "params-a-list": (lambda kv, o: [1, 2, 3], "http-400"),
    "lease-seconds-a-string": (_replace(turbowire_lease_seconds="abc"), "bad_params"),
    "lease-seconds-negative": (_replace(turbowire_lease_seconds=-5), "bad_params"),
    "lease-seconds-nan": (_replace(turbowire_lease_seconds=math.nan), "bad_params"),
    "lease-seconds-huge": (_replace(turbowire_lease_seconds=1e308), "bad_params"),
    "lease-seconds-a-list": (_replace(turbowire_lease_seconds=[8]), "bad_params"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_params_answer_right_or_error_and_the_engine_keeps_serving(faults, case):
    f = faults
    make, expect = MALFORMED[case]
    prompt = fresh_prompt(45)
    ref = f.reference(prompt)
    kv = f.prefill(f["pmain"], prompt)

    def other() -> dict:
        return f.prefill(f["pmain"], fresh_prompt(45))

    before = failures(f["drec"])
    r, seconds = f.post(f["drec"], prompt, make(copy.deepcopy(kv), other))
    assert f["drec"].alive(), "the decode engine died"
    assert httpx.get(f["drec"].url + "/health", timeout=10).status_code == 200
    if expect.startswith("http-"):
        assert r.status_code == int(expect[5:]), r.text
        outcome = expect
    else:
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == ref, "wrong answer"
        load = f.load(r)
        if expect == "transferred":
            assert load and load["failed"] is None and load["tokens"] == 45, load
            outcome = "transferred"
        else:
            assert counted(f["drec"], before) == {expect: 1}
            outcome = f"recomputed:{expect}"
    if expect not in ("bad_params", "http-400"):  # it went through the loader: the next load
        f.transfer_ok(f["drec"])  # is served normally (refused params never reach it)
    leaked = f.decode_idle(f["drec"])
    # leases of params the decode engine refused to trust are not released by it: they expire
    # (checked by test_every_prefill_lease_is_released_or_expired)
    f.record(f"malformed-{case}", outcome, seconds, leaked)
    assert leaked == []


def test_params_of_another_prompt_without_their_hash_are_not_loaded(faults):
    f = faults
    prompt, other_prompt = fresh_prompt(45), fresh_prompt(45)
    ref = f.reference(prompt)
    other = f.prefill(f["pmain"], other_prompt)
    r, seconds = f.post(f["drec"], prompt, {**other, "turbowire_prompt_hash": None})
    assert r.status_code == 200, r.text
    load = f.load(r)
    f.record("malformed-other-prompt-hash-removed",
             f"{'transferred' if load and not load['failed'] else 'refused'}:"
             f"{'right' if r.json()['choices'][0]['text'] == ref else 'WRONG-ANSWER'}",
             seconds, [])
    assert r.json()["choices"][0]["text"] == ref


def test_replayed_params_after_release_never_read_the_reused_slots(faults):
    """A request's params sent again after its lease was released and its slots were staged
    for another request: the claim says the lease is gone, nothing is read, recomputed."""
    f = faults
    prompt = fresh_prompt(45)  # 1 full block (drec caches it) + 13 tokens (loaded again)
    ref = f.reference(prompt)
    kv = f.prefill(f["pmain"], prompt)
    r, _ = f.post(f["drec"], prompt, kv)
    assert f.load(r)["failed"] is None
    reuse = fresh_prompt(45)
    reuse_kv = f.prefill(f["pmain"], reuse)  # lowest free slots first: most likely kv's
    reused = sorted(set(kv["remote_block_ids"]) & set(reuse_kv["remote_block_ids"]))
    before = failures(f["drec"])
    r, seconds = f.post(f["drec"], prompt, kv)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == ref
    assert f.load(r)["failed"] == "lease_expired" and f.load(r)["tokens"] == 0
    assert counted(f["drec"], before) == {"lease_expired": 1}
    # the request the slots now belong to is unaffected
    r2, _ = f.post(f["drec"], reuse, reuse_kv)
    assert f.load(r2)["failed"] is None and r2.json()["choices"][0]["text"] == f.reference(reuse)
    leaked = f.decode_idle(f["drec"])
    f.record("replayed-params-after-release", f"recomputed:lease_expired(slots {reused} reused)",
             seconds, leaked)
    assert leaked == []


# -- b. the decode engine dies with READs on the wire --------------------------------------------


def test_decode_killed_mid_transfer_frees_the_prefill_staging(faults):
    """dfail posts its READs and claims the lease while pmain is stopped (so the READs stay on
    the wire), then dfail's process tree is SIGKILLed and pmain resumes: pmain frees the staging
    within lease_seconds (+ reaper period), its gauges go back to 0, and its other requests
    are unaffected."""
    f = faults
    prompt = fresh_prompt(40)
    f.reference(prompt)
    f.quiesce("pmain")
    kv = f.prefill(f["pmain"], prompt)
    assert f["pmain"].pool().leases == 1
    p_before = failures(f["pmain"])
    stuck = threading.Thread(target=lambda: _ignore(f.post, f["dfail"], prompt, kv, timeout=60))
    f["pmain"].signal_group(signal.SIGSTOP)
    try:
        stuck.start()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # dfail has the request and is fetching its KV
            if metric_sum(f["dfail"].metrics(), "vllm:num_requests_kv_fetch_by_stage") >= 1:
                break
            time.sleep(0.05)
        time.sleep(0.3)  # handshake cached: claim and READs are out
        f["dfail"].kill()
    finally:
        f["pmain"].signal_group(signal.SIGCONT)
    t0 = time.monotonic()
    freed = f.wait_pool_empty("pmain", LEASE_S + 2 * REAPER_S + 5)
    stuck.join(timeout=30)
    leaked = [] if freed is not None else ["pmain:staging"]
    # the gauges follow, but only with the next engine step: an idle engine publishes nothing,
    # so a plain request (no staging of its own) nudges it
    f.post(f["pmain"], "x y z", max_tokens=1)
    gauges = ("turbowire_staging_in_use_bytes", "turbowire_leases_outstanding")
    deadline = time.monotonic() + 10
    while True:
        m = f["pmain"].metrics()
        held = {g: metric_sum(m, g) for g in gauges if metric_sum(m, g)}
        if not held or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    leaked += [f"pmain:{g}={v:g}" for g, v in held.items()]
    f.transfer_ok(f["drec"])  # pmain's other requests are unaffected
    assert counted(f["pmain"], p_before).get("lease_expired", 0) >= 1
    f.record("decode-sigkill-mid-transfer", "prefill-freed:lease_expired",
             freed if freed is not None else time.monotonic() - t0, leaked)
    assert freed is not None and freed <= LEASE_S + 2 * REAPER_S + 2, freed
    assert leaked == []


def _ignore(fn, *args, **kw) -> None:
    with contextlib.suppress(httpx.HTTPError):
        fn(*args, **kw)


# -- a (recovery). The killed prefill engine is back under the same engine_id ------------------


def test_restarted_prefill_with_the_same_engine_id_is_handshaken_again(faults, prefill_killed):
    """drec still holds the handshake of pkill's first incarnation (same engine_id, host and
    port, a dead NIXL agent). The first load may fail on it (recomputed, and the handshake is
    dropped); the next one handshakes again and transfers. Before the fix every load from the
    restarted engine failed ``transport`` until the decode engine was restarted too."""
    f, k = faults, prefill_killed
    k["restarted"].wait_healthy(900)
    f["pkill"].proc = k["restarted"]
    outcomes: list[str] = []
    t0 = time.monotonic()
    while time.monotonic() - t0 < RECONNECT_S:
        prompt = fresh_prompt(40)
        ref = f.reference(prompt)
        r, _ = f.post(f["drec"], prompt, f.prefill(f["pkill"], prompt))
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == ref, r.text
        outcomes.append(f.load(r)["failed"] or "transferred")
        if outcomes[-1] == "transferred":
            break
        time.sleep(0.5)
    recovered = time.monotonic() - t0
    runs = [f"{o}x{len(list(g))}" for o, g in itertools.groupby(outcomes)]
    leaked = f.decode_idle(f["drec"]) + f.prefill_leaks("pkill")
    f.record("prefill-restarted-same-engine-id", "->".join(runs), recovered, leaked)
    assert outcomes[-1] == "transferred", outcomes
    # the stale handshake costs at most one load; peer_unreachable before it is the side
    # channel's gRPC reconnect backoff (up to 120 s by default), not the loader
    assert outcomes.count("transport") <= 1, outcomes
    assert leaked == []


def test_every_prefill_lease_is_released_or_expired_and_no_engine_crashed(faults):
    """Runs last: nothing is held on any live prefill engine, every engine that was not killed
    on purpose is alive, and the decode engine still answers like a single engine."""
    f = faults
    leaked = f.prefill_leaks("pmain", "ptq4", "pkill", timeout=LEASE_S + 5)
    for name in ("pmain", "ptq4", "pkill", "drec"):
        assert f[name].alive(), f"{name} died"
    f.transfer_ok(f["drec"])
    leaked += f.decode_idle(f["drec"]) + f.recv_whole()
    assert leaked == []
