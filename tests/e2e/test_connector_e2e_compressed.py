"""Real engines with a compressed preset: completions are produced, the decode engine counts the
prompt tokens as external (vLLM's prompt-tokens-by-source metric), the bytes that crossed the
wire are exactly the codec's chunk sizes (so the ratio is the preset's), and an unread lease
expires and frees the prefill engine's staging."""

from __future__ import annotations

import concurrent.futures as cf
import time

import httpx
import pytest
from conftest import BLOCK_SIZE, MODEL_NAME, metric_sum, start_stack
from support.pki import engine_pki
from test_connector_e2e_raw import pd, prompt_ids, staging_bytes_for

pytestmark = pytest.mark.e2e

PRESET = "tq4"
LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 64
DENSE_PER_TOKEN = LAYERS * 2 * KV_HEADS * HEAD_DIM * 2


@pytest.fixture(scope="module")
def stack(tiny_model, engine_slot, tmp_path_factory):
    """The P/D pair runs ``transport: both`` (the NIXL hand-off, and every computed chunk also
    stored in a real redis-server): the P/D assertions below must hold with the store on."""
    from support.redis_server import RedisServer

    with RedisServer() as redis:
        # the side channel runs mutual TLS with a token, as a hardened deployment would
        tls = engine_pki(tmp_path_factory.mktemp("pki"))
        group, st = start_stack(
            tiny_model, PRESET, tmp_path_factory.mktemp("logs-tq"), staging_bytes_for(PRESET, 64),
            extra={"load_failure_policy": "recompute", "transport": "both",
                   "store_url": redis.url, "store_namespace": "pd-both",
                   "auth_token": "e2e-side-channel-token", **tls},
        )
        st.redis = redis
        yield st
        group.stop()


def test_both_transports_store_what_the_prefill_engine_computed(stack):
    """With ``both``, the prefill engine also stores the full chunks of what it computed."""
    from turbowire.store.directory import Directory

    prompt = prompt_ids(6100, 2 * 256 + 17)
    pd(stack, prompt, max_tokens=2)
    directory = Directory(stack.redis.url, ttl_seconds=3600)
    try:
        deadline = time.monotonic() + 20
        while directory.usage("pd-both")[0] < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert directory.usage("pd-both")[0] >= 2
    finally:
        directory.close()


def expected_wire_bytes(n: int) -> int:
    from turbowire.codec import Codec

    codec = Codec(PRESET, HEAD_DIM, LAYERS)
    total = 0
    for i in range((n + BLOCK_SIZE - 1) // BLOCK_SIZE):
        tokens = min(BLOCK_SIZE, n - i * BLOCK_SIZE)
        total += sum(
            codec.encoded_nbytes(layer, tokens, KV_HEADS, i * BLOCK_SIZE) for layer in range(LAYERS)
        )
    return total


def _wait_metric(stack, url, name, target, **labels) -> dict:
    deadline = time.monotonic() + 10
    while True:
        m = stack.metrics(url)
        if metric_sum(m, name, **labels) >= target or time.monotonic() > deadline:
            return m
        time.sleep(0.2)


@pytest.mark.parametrize("n", [7, 64, 97, 300])
def test_compressed_transfer_bytes_ratio_and_external_tokens(stack, n):
    d = stack.decode.url
    before = stack.metrics(d)
    prompt = prompt_ids(5000 + n, n)
    out = pd(stack, prompt, max_tokens=10)
    assert out["choices"][0]["text"].strip(), "a completion must be produced"
    load = out["kv_transfer_params"]["turbowire_load"]
    assert load["failed"] is None and load["tokens"] == n
    want_wire = expected_wire_bytes(n)
    assert load["wire_bytes"] == want_wire
    assert load["dense_bytes"] == n * DENSE_PER_TOKEN

    after = _wait_metric(
        stack, d, "turbowire_kv_transfers_total",
        metric_sum(before, "turbowire_kv_transfers_total", direction="recv") + 1,
        direction="recv",
    )

    def delta(name: str, **labels: str) -> float:
        return metric_sum(after, name, **labels) - metric_sum(before, name, **labels)

    assert delta("turbowire_kv_wire_bytes_total", direction="recv", preset=PRESET) == want_wire
    assert delta("turbowire_kv_dense_bytes_total", direction="recv", preset=PRESET) == (
        n * DENSE_PER_TOKEN
    )
    ratio = (n * DENSE_PER_TOKEN) / want_wire
    if n >= BLOCK_SIZE:
        assert ratio > 3.0, f"{PRESET} should move >3x fewer bytes than bf16, got {ratio:.2f}"
    # vLLM itself counts the loaded prompt tokens as coming from a KV transfer.
    external = delta("vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    assert n - 1 <= external <= n


def test_concurrent_compressed_requests(stack):
    prompts = [prompt_ids(6000 + i, 50 + 41 * i) for i in range(5)]
    with cf.ThreadPoolExecutor(5) as pool:
        outs = list(pool.map(lambda p: pd(stack, p, max_tokens=8), prompts))
    for out, prompt in zip(outs, prompts, strict=True):
        assert out["choices"][0]["text"].strip()
        assert out["kv_transfer_params"]["turbowire_load"]["tokens"] == len(prompt)


def test_unread_lease_expires_and_frees_staging(stack):
    """A prefill whose decode never comes: the lease (10 s here) expires, staging is freed."""
    p = stack.prefill.url
    before = stack.metrics(p)
    body = {"model": MODEL_NAME, "prompt": prompt_ids(7000, 120), "max_tokens": 1,
            "temperature": 0, "kv_transfer_params": {"do_remote_decode": True}}
    kv = httpx.post(p + "/v1/completions", json=body, timeout=300).json()["kv_transfer_params"]
    assert len(kv["remote_block_ids"]) == 4
    held = stack.pool_status()
    assert held.leases == 1 and held.used_slots == 4
    t0 = time.monotonic()
    status = stack.wait_pool_empty(timeout=30)
    waited = time.monotonic() - t0
    assert status.leases == 0 and status.used_slots == 0, status
    assert waited > 5, "the lease must not vanish long before lease_seconds (10 s)"
    # the expiry is counted (the gauge/counter reach /metrics with the next engine step)
    httpx.post(p + "/v1/completions", timeout=300,
               json={"model": MODEL_NAME, "prompt": "x y z", "max_tokens": 1})
    expired = _wait_metric(
        stack, p, "turbowire_kv_transfer_failures_total",
        metric_sum(before, "turbowire_kv_transfer_failures_total", reason="lease_expired") + 1,
        reason="lease_expired",
    )
    assert metric_sum(expired, "turbowire_kv_transfer_failures_total", reason="lease_expired") == (
        metric_sum(before, "turbowire_kv_transfer_failures_total", reason="lease_expired") + 1
    )
    # A decode engine arriving after expiry learns it when it claims the lease, reads nothing,
    # and (load_failure_policy=recompute) computes the prompt itself.
    d = stack.decode.url
    d_before = stack.metrics(d)
    d_body = {"model": MODEL_NAME, "prompt": body["prompt"], "max_tokens": 4, "temperature": 0,
              "kv_transfer_params": kv}
    late = httpx.post(d + "/v1/completions", json=d_body, timeout=300)
    assert late.status_code == 200 and late.json()["choices"][0]["text"].strip()
    d_after = _wait_metric(
        stack, d, "turbowire_kv_transfer_failures_total",
        metric_sum(d_before, "turbowire_kv_transfer_failures_total", reason="lease_expired") + 1,
        reason="lease_expired",
    )
    assert metric_sum(d_after, "turbowire_kv_transfer_failures_total", reason="lease_expired") == (
        metric_sum(d_before, "turbowire_kv_transfer_failures_total", reason="lease_expired") + 1
    )


def test_prometheus_recording_rule_matches_logged_ratio(stack):
    """Real Prometheus scrapes this pair (metrics engineer's check, tests/e2e/metrics_pd_check.py):
    the recording rule's compression ratio equals the ratio each connector logged within 5 %, and
    the dashboard's key queries have data."""
    from metrics_pd_check import check_prometheus_against_pd

    prompts = [prompt_ids(8000 + i, 90 + 57 * i) for i in range(6)]
    check_prometheus_against_pd(stack, MODEL_NAME, prompts, max_tokens=4)


def test_side_channel_serves_mutual_tls_and_refuses_plain_callers(stack):
    """The pair above handshakes over mTLS with a token (every load in this module proves it
    works); the prefill engine logs the mode, and a caller without the CA-signed certificate,
    or without the token, learns nothing of its staging pool."""
    from turbowire.connector.sidechannel.client import SideChannelClient, SideChannelError
    from turbowire.connector.sidechannel.server import SideChannelTLS

    assert "(mTLS)" in stack.prefill.log_text()
    sc = stack.side_channel
    tls = SideChannelTLS.from_files(sc["side_channel_tls_cert"], sc["side_channel_tls_key"],
                                    sc["side_channel_tls_ca"])
    for token, client_tls in ((sc["auth_token"], None), (None, tls)):
        client = SideChannelClient("127.0.0.1", stack.prefill_side_port, token, timeout=5,
                                   tls=client_tls)
        try:
            with pytest.raises(SideChannelError):
                client.pool_status()
        finally:
            client.close()
    assert stack.pool_status().capacity_slots > 0  # certificate and token: answered
