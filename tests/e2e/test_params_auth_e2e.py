"""Forged and redirected ``kv_transfer_params`` on real engines (issue 33, H3).

A client that reaches a decode engine's API can hand it any params. Before: params of prompt P'
with ``turbowire_prompt_hash`` replaced by prompt P's digest, sent with P, loaded P''s KV into
P's blocks (the answer was P''s continuation, and vLLM cached it under P's block hashes); params
naming another host made the decode engine dial it (with the bearer token). Now:

- with ``auth_token`` the params carry ``turbowire_params_mac`` (the prefill engine's HMAC of
  every field the decode engine acts on) and the decode engine refuses any that do not verify,
  before it dials or resolves anything (``unauthenticated_params``);
- without it the prefill engine binds each lease to the prompt it staged and refuses a claim
  presenting another prompt (``prompt_mismatch``, counted on both engines);
- ``prefill_peers`` (an allowlist) refuses params naming any other peer (``peer_not_allowed``).

Every refused request is answered exactly like the prompt alone (``load_failure_policy:
recompute``), and no lease is left behind on a prefill engine. Five vLLM CPU engines (tiny
model, preset ``raw``, so a transferred prompt answers exactly like a single engine):

- ``pa``/``da``: a prefill and a decode engine sharing an ``auth_token`` (from the
  environment, as the Helm chart passes it);
- ``pn``/``dn``: a pair without a token (``pn`` advertises its side channel as 127.0.0.3);
- ``dl``: a decode engine without a token and ``prefill_peers: ["127.0.0.3"]``.

Each test fails on the code before issue 33 (d6467ff): the forged-hash cases answer P''s
continuation there, the decoy host gets connections, tampered fields are loaded or fail by
other reasons, and ``dl`` does not start (``prefill_peers`` is unknown there).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from conftest import BLOCK_SIZE, MODEL_NAME, metric_sum, scrape_metrics
from support.blackhole import BlackHole
from test_connector_e2e_raw import prompt_ids

from turbowire.connector.params import prompt_digest
from turbowire.serving.launch import (
    EngineSpec,
    EngineStartError,
    ManagedProcess,
    free_port,
    start_engine,
    turbowire_kv_config,
)

pytestmark = pytest.mark.e2e

TOKEN = "e2e-params-auth-token-1"
LEASE_S = 8.0
CALL_S = 2.0  # handshake_timeout_seconds of the decode engines
TIMEOUT_S = 15.0  # transfer_timeout_seconds of the decode engines
N = 45  # prompt tokens: one full block and 13 more
MAX_TOKENS = 8
PN_HOST = "127.0.0.3"  # pn's advertised side-channel address: the only peer dl may dial
FAILURES = "turbowire_kv_transfer_failures_total"

_seeds = itertools.count(330_000)


def fresh_prompt(n: int = N) -> list[int]:
    return prompt_ids(next(_seeds), n)


@dataclass
class Engine:
    name: str
    spec: EngineSpec
    proc: ManagedProcess
    token: str | None = None

    @property
    def url(self) -> str:
        return self.proc.url

    def post(self, prompt, kv=None, max_tokens: int = MAX_TOKENS) -> httpx.Response:
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0}
        if kv is not None:
            body["kv_transfer_params"] = kv
        return httpx.post(self.url + "/v1/completions", json=body, timeout=120)

    def pool(self):
        """The prefill engine's staging pool now, over its real side channel."""
        from turbowire.connector.sidechannel.client import SideChannelClient

        assert self.spec.side_channel_port is not None
        client = SideChannelClient("127.0.0.1", self.spec.side_channel_port, self.token,
                                   timeout=10)
        try:
            return client.pool_status()
        finally:
            client.close()

    def wait_pool_empty(self, timeout: float) -> float | None:
        t0 = time.monotonic()
        while True:
            status = self.pool()
            if status.used_slots == 0 and status.leases == 0:
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout:
                return None
            time.sleep(0.1)

    def failures(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for key, value in scrape_metrics(self.url).items():
            if key.startswith(FAILURES + "{") and 'reason="' in key:
                reason = key.split('reason="', 1)[1].split('"', 1)[0]
                out[reason] = out.get(reason, 0.0) + value
        return out

    def counted(self, before: dict[str, float], timeout: float = 15) -> dict[str, float]:
        """Failure reasons counted since ``before`` (published with the next engine steps)."""
        deadline = time.monotonic() + timeout
        while True:
            now = self.failures()
            delta = {k: v - before.get(k, 0.0) for k, v in now.items() if v > before.get(k, 0.0)}
            if delta or time.monotonic() > deadline:
                return delta
            time.sleep(0.3)


@dataclass
class Pairs:
    engines: dict[str, Engine]
    not_started: dict[str, str] = field(default_factory=dict)
    refs: dict[tuple[int, ...], str] = field(default_factory=dict)

    def __getitem__(self, name: str) -> Engine:
        if name in self.not_started:
            pytest.fail(f"engine {name} failed to start: {self.not_started[name]}")
        return self.engines[name]

    def reference(self, prompt: list[int]) -> str:
        """Prompt ``prompt`` answered by one engine alone (pn, no kv_transfer_params)."""
        key = tuple(prompt)
        if key not in self.refs:
            r = self["pn"].post(prompt)
            assert r.status_code == 200, r.text
            self.refs[key] = r.json()["choices"][0]["text"]
        return self.refs[key]

    def prefill(self, name: str, prompt: list[int]) -> dict:
        r = self[name].post(prompt, {"do_remote_decode": True}, max_tokens=1)
        assert r.status_code == 200, r.text
        kv = r.json()["kv_transfer_params"]
        assert kv["remote_block_ids"] and kv["turbowire_fallback"] is None, kv
        return kv


def _load(r: httpx.Response) -> dict | None:
    return (r.json().get("kv_transfer_params") or {}).get("turbowire_load")


def _spec(name: str, cpu: int, **extra) -> EngineSpec:
    kv = turbowire_kv_config(side_channel_port=free_port(), lease_seconds=LEASE_S,
                             preset="raw", **extra)
    return EngineSpec(name, Path(), free_port(), cpu=cpu, kv_transfer_config=kv, kvcache_gib=1,
                      block_size=BLOCK_SIZE, max_model_len=2048, max_num_seqs=8,
                      max_num_batched_tokens=1024, served_model_name=MODEL_NAME)


@pytest.fixture(scope="module")
def pairs(tiny_model, engine_slot, tmp_path_factory) -> Iterator[Pairs]:
    log_dir = tmp_path_factory.mktemp("logs-params-auth")
    prefill = {"staging_bytes": "4MiB", "recv_bytes": "1MiB"}
    decode = {"staging_bytes": "1MiB", "recv_bytes": "4MiB", "load_failure_policy": "recompute",
              "handshake_timeout_seconds": CALL_S, "transfer_timeout_seconds": TIMEOUT_S}
    specs = {
        # the token from the environment: never inline (vLLM logs its non-default arguments)
        "pa": (_spec("pa", 0, **prefill), TOKEN),
        "da": (_spec("da", 1, **decode), TOKEN),
        "pn": (_spec("pn", 0, side_channel_host=PN_HOST, **prefill), None),
        "dn": (_spec("dn", 1, **decode), None),
        "dl": (_spec("dl", 1, prefill_peers=[PN_HOST], **decode), None),
    }
    p = Pairs({})
    try:
        for name, (spec, token) in specs.items():
            spec.model = tiny_model
            if token:
                spec.env["TURBOWIRE_AUTH_TOKEN"] = token
            p.engines[name] = Engine(name, spec, start_engine(spec, log_dir), token)
        for name, engine in p.engines.items():
            try:
                engine.proc.wait_healthy(900)
            except EngineStartError as exc:  # fails the tests that need this engine only
                p.not_started[name] = exc.summary()
        yield p
    finally:
        for engine in p.engines.values():
            engine.proc.stop()


def _expect_refused(p: Pairs, decode: str, prompt: list[int], kv: dict, reason: str) -> None:
    """The decode engine answers ``prompt`` exactly as the prompt alone, loads nothing from the
    params and counts one failure, ``reason``."""
    ref = p.reference(prompt)
    before = p[decode].failures()
    r = p[decode].post(prompt, kv)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == ref, "answered with the KV of another prompt"
    load = _load(r)
    assert load is None or (load["failed"] and load["tokens"] == 0), load
    assert p[decode].counted(before) == {reason: 1}


def _leak_free(p: Pairs, *prefills: str) -> None:
    """Every lease on these prefill engines is released or has expired (nothing leaks)."""
    for name in prefills:
        waited = p[name].wait_pool_empty(LEASE_S + 5)
        assert waited is not None, f"{name} still holds {p[name].pool()}"


# ---- sanity: honest params go through on every pair --------------------------------------------
@pytest.mark.parametrize(("prefill", "decode"), [("pa", "da"), ("pn", "dn"), ("pn", "dl")])
def test_honest_params_are_transferred(pairs, prefill, decode):
    prompt = fresh_prompt()
    kv = pairs.prefill(prefill, prompt)
    assert (kv.get("turbowire_params_mac") is not None) == (prefill == "pa")
    r = pairs[decode].post(prompt, kv)
    assert r.status_code == 200, r.text
    load = _load(r)
    assert load and load["failed"] is None and load["tokens"] == N, load
    assert r.json()["choices"][0]["text"] == pairs.reference(prompt)


# ---- the forged prompt hash ---------------------------------------------------------------------
def _forged(p: Pairs, prefill: str, prompt: list[int]) -> dict:
    """Params of another prompt P' (same length, every token different) whose
    turbowire_prompt_hash is replaced by the digest of ``prompt``."""
    other = fresh_prompt()
    assert len(other) == len(prompt) and all(a != b for a, b in zip(other, prompt, strict=True))
    kv = p.prefill(prefill, other)
    assert p.reference(other) != p.reference(prompt)  # the case is not vacuous
    return {**kv, "turbowire_prompt_hash": prompt_digest(prompt, len(prompt))}


def test_forged_prompt_hash_is_refused_by_the_mac(pairs):
    """With auth_token: the MAC no longer matches, the decode engine refuses the params before
    anything is dialed; the prefill engine's lease of P' is never claimed and expires."""
    prompt = fresh_prompt()
    kv = _forged(pairs, "pa", prompt)
    p_before = pairs["pa"].failures()
    _expect_refused(pairs, "da", prompt, kv, "unauthenticated_params")
    _leak_free(pairs, "pa")
    pairs["pa"].post("x y z", max_tokens=1)  # an engine step publishes the prefill's counters
    assert pairs["pa"].counted(p_before).get("lease_expired", 0) >= 1


def test_forged_prompt_hash_is_refused_by_the_prefill_engine_without_a_token(pairs):
    """Without auth_token: the decode engine's own check passes (the hash says P), its claim
    presents P, the prefill engine staged P' and refuses it: prompt_mismatch on both engines,
    nothing decoded, the prompt recomputed, the lease released by its holder."""
    prompt = fresh_prompt()
    kv = _forged(pairs, "pn", prompt)
    p_before = pairs["pn"].failures()
    ref = pairs.reference(prompt)
    before = pairs["dn"].failures()
    r = pairs["dn"].post(prompt, kv)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == ref, "answered with the KV of another prompt"
    assert _load(r)["failed"] == "prompt_mismatch", _load(r)
    assert pairs["dn"].counted(before) == {"prompt_mismatch": 1}
    waited = pairs["pn"].wait_pool_empty(LEASE_S - 2)
    assert waited is not None, "the lease of P' was not released"
    pairs["pn"].post("x y z", max_tokens=1)
    assert pairs["pn"].counted(p_before) == {"prompt_mismatch": 1}
    # the decode engine did not cache P''s KV under P: P again (plain) answers P
    r = pairs["dn"].post(prompt)
    assert r.json()["choices"][0]["text"] == ref


# ---- params naming a host that is not the prefill engine ----------------------------------------
@pytest.mark.parametrize(("prefill", "decode", "reason"), [
    ("pa", "da", "unauthenticated_params"),  # the MAC covers remote_host and remote_port
    ("pn", "dl", "peer_not_allowed"),  # the allowlist names only pn's address
])
def test_params_naming_a_decoy_are_refused_without_connecting_to_it(pairs, prefill, decode,
                                                                    reason):
    prompt = fresh_prompt()
    kv = pairs.prefill(prefill, prompt)
    decoy = BlackHole()
    try:
        forged = {**kv, "remote_host": "127.0.0.1", "remote_port": decoy.port}
        _expect_refused(pairs, decode, prompt, forged, reason)
        time.sleep(CALL_S)  # a handshake, heartbeat or release would have connected by now
        assert decoy.accepted == [], "the decode engine connected to the host the params named"
    finally:
        decoy.close()
    _leak_free(pairs, prefill)


# ---- signed params with a field changed ---------------------------------------------------------
def _swap_blocks(p: Pairs, kv: dict) -> dict:
    other = p.prefill("pa", fresh_prompt())  # a live lease's slots
    return {**kv, "remote_block_ids": other["remote_block_ids"]}


TAMPER = {
    "block-ids-of-another-request": _swap_blocks,
    "block-ids-reversed": lambda p, kv: {**kv, "remote_block_ids": kv["remote_block_ids"][::-1]},
    "num-tokens-lowered": lambda p, kv: {**kv, "remote_num_tokens": BLOCK_SIZE,
                                         "remote_block_ids": kv["remote_block_ids"][:1]},
    "request-id-of-another-request": lambda p, kv: {
        **kv, "remote_request_id": p.prefill("pa", fresh_prompt())["remote_request_id"]},
    "lease-seconds-raised": lambda p, kv: {**kv, "turbowire_lease_seconds": 86400},
    "mac-removed": lambda p, kv: {**kv, "turbowire_params_mac": None},
}


@pytest.mark.parametrize("case", list(TAMPER))
def test_signed_params_with_a_field_changed_are_refused(pairs, case):
    prompt = fresh_prompt()
    kv = pairs.prefill("pa", prompt)
    _expect_refused(pairs, "da", prompt, TAMPER[case](pairs, kv), "unauthenticated_params")


def test_no_lease_is_left_and_every_engine_serves(pairs):
    """Runs last: the refused params' leases have expired or were released on both prefill
    engines, and every decode engine still transfers honest params."""
    _leak_free(pairs, "pa", "pn")
    for prefill, decode in (("pa", "da"), ("pn", "dn"), ("pn", "dl")):
        test_honest_params_are_transferred(pairs, prefill, decode)
    m = scrape_metrics(pairs["da"].url)
    assert metric_sum(m, "vllm:num_requests_running") == 0
