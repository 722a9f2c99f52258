"""Real turbowire engines behind llm-d's routing sidecar protocol (issue 37).

``tests/support/llmd_sidecar.py`` re-does the sidecar's ``nixlv2`` flow field for field from its
Go source (llm-d-router at ebab687927f5331c1b39defcb579a07951bce56c). The prefill request gets
the API's token limits set to 1, ``stream`` false, no ``stream_options`` and NixlConnector's
``do_remote_decode`` params. The decode request gets the client's body back with the prefill
answer's ``kv_transfer_params`` and nothing else. The client's headers go along with one
``x-request-id``, and every body goes through Go's JSON (numbers as float64). The relay carries
nothing more, so these tests fail the day turbowire needs a field or header the sidecar does
not relay.

One P/D pair per preset (``raw``, then ``tq4``): a prefill engine (``kv_producer``, core 0) and a
decode engine (``kv_consumer``, core 1). They share an ``auth_token``, so the params are signed,
and verified after the trip through Go's JSON. They have a chat template, and
``--enable-scale-out`` for vLLM's generate API.

Every API the sidecar serves goes through the relay: completions, chat completions, the
Responses API and Anthropic messages, streaming and not, and vLLM's token-in generate. In each,
the decode engine loads the whole prompt (its load report, ``turbowire_kv_*`` and vLLM's
external prompt tokens) and the bytes on the wire are the preset's. The greedy answer equals
the prefill engine's alone (``raw``) or is produced (``tq4``).

Then what the sidecar lets a client do:

- send no prefill header: the decode engine serves alone;
- smuggle params in ``vllm_xargs``: refused;
- name the prefill host itself: its fake prefill engine's params would send the decode engine
  to a decoy, and are refused as unsigned, with nothing dialed.

At the end no lease is left on the prefill engine.
"""

from __future__ import annotations

import copy
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import BLOCK_SIZE, MODEL_NAME, metric_sum, scrape_metrics
from support.blackhole import BlackHole
from support.llmd_sidecar import (
    GENERATE_PATH,
    PREFILL_HEADER,
    PREFILL_KV_PARAMS,
    ROUTES,
    Exchange,
    SidecarRelay,
)
from test_connector_e2e_raw import prompt_ids, staging_bytes_for
from test_presets_e2e import ELEMENTS_PER_TOKEN, wire_bytes

from turbowire.serving.launch import (
    EngineSpec,
    ManagedProcess,
    ProcessGroup,
    free_port,
    start_engine,
    turbowire_kv_config,
)

pytestmark = pytest.mark.e2e

TOKEN = "e2e-llmd-sidecar-token-1"
MAX_TOKENS = 8
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions",
         "responses": "/v1/responses", "messages": "/v1/messages", "generate": GENERATE_PATH}
#: APIs without ignore_eos (Anthropic's messages): an answer may end before MAX_TOKENS.
MAY_STOP_EARLY = {"messages"}
#: Headers a client's request loses on the way (the prefill header; Connection is hop-by-hop)
#: and gains (the sidecar's request id, the reverse proxy's X-Forwarded-For).
DROPPED_HEADERS = {PREFILL_HEADER, "connection"}
ADDED_HEADERS = {"x-request-id", "x-forwarded-for"}


@dataclass
class Pair:
    preset: str
    prefill: ManagedProcess
    decode: ManagedProcess
    relay: SidecarRelay
    words: list[str]

    @property
    def prefill_hostport(self) -> str:
        return self.prefill.url.removeprefix("http://")

    def metrics(self) -> dict[str, float]:
        return scrape_metrics(self.decode.url)


def _spec(name: str, model: Path, cpu: int, role: str, preset: str, template: Path) -> EngineSpec:
    kv = turbowire_kv_config(role, side_channel_port=free_port(), preset=preset,
                             staging_bytes=staging_bytes_for(preset, 64))
    # the token from the environment, as the Helm chart passes it (vLLM logs the extra config)
    return EngineSpec(name, model, free_port(), cpu=cpu, kv_transfer_config=kv, kvcache_gib=1,
                      block_size=BLOCK_SIZE, max_model_len=2048, max_num_seqs=8,
                      max_num_batched_tokens=1024, served_model_name=MODEL_NAME,
                      env={"TURBOWIRE_AUTH_TOKEN": TOKEN},
                      extra_args=["--chat-template", str(template), "--enable-scale-out"])


def _vocabulary(model: Path) -> list[str]:
    """The tiny model's alphabetic words: chat prompts of known, distinct tokens."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    words = [tok.id_to_token(i) for i in range(3, tok.get_vocab_size())]
    return [w for w in words if w and w.isalpha()]


@pytest.fixture(scope="module", params=["raw", "tq4"])
def pair(request, tiny_model, engine_slot, tmp_path_factory) -> Iterator[Pair]:
    preset = request.param
    log_dir = tmp_path_factory.mktemp(f"logs-llmd-{preset}")
    template = log_dir / "chat-template.jinja"
    template.write_text(CHAT_TEMPLATE)
    group = ProcessGroup()
    relay = None
    try:
        p = group.add(start_engine(
            _spec("prefill", tiny_model, 0, "kv_producer", preset, template), log_dir))
        d = group.add(start_engine(
            _spec("decode", tiny_model, 1, "kv_consumer", preset, template), log_dir))
        p.wait_healthy(900)
        d.wait_healthy(900)
        relay = SidecarRelay(d.url)  # the sidecar runs beside the decode engine
        st = Pair(preset, p, d, relay, _vocabulary(tiny_model))
        # warm-up: the side-channel handshake and the NIXL connection
        warm = httpx.post(relay.url + "/v1/completions", timeout=300,
                          headers={PREFILL_HEADER: st.prefill_hostport},
                          json={"model": MODEL_NAME, "prompt": "warm up the connection please",
                                "max_tokens": 2})
        assert warm.status_code == 200, warm.text
        yield st
    finally:
        if relay is not None:
            relay.close()
        group.stop()


# ---- requests ---------------------------------------------------------------------------------
def _body(pair: Pair, endpoint: str, seed: int, n: int, stream: bool) -> dict[str, Any]:
    """A greedy request of MAX_TOKENS tokens, in each API's own names for the prompt (``n``
    token ids or words) and the token limit."""
    text = " ".join(pair.words[t % len(pair.words)] for t in prompt_ids(seed, n))
    body: dict[str, Any] = {"model": MODEL_NAME, "temperature": 0, "ignore_eos": True}
    if endpoint == "completions":  # min_tokens: the sidecar caps it to 1 on the prefill leg
        body.update(prompt=prompt_ids(seed, n), max_tokens=MAX_TOKENS, min_tokens=2)
    elif endpoint == "chat":  # the field OpenAI documents for chat
        body.update(messages=[{"role": "user", "content": text}],
                    max_completion_tokens=MAX_TOKENS)
    elif endpoint == "responses":
        body.update(input=text, max_output_tokens=MAX_TOKENS)
    elif endpoint == "messages":
        del body["ignore_eos"]
        body.update(messages=[{"role": "user", "content": text}], max_tokens=MAX_TOKENS)
    else:  # generate: the sampling parameters nested, token ids in
        body = {"model": MODEL_NAME, "token_ids": prompt_ids(seed, n), "sampling_params": {
            "temperature": 0, "ignore_eos": True, "max_tokens": MAX_TOKENS}}
    if stream:
        body["stream"] = True
        if endpoint in ("completions", "chat"):  # the others stream their usage anyway
            body["stream_options"] = {"include_usage": True}
    return body


@dataclass
class Relayed:
    status: int
    text: str  # the whole answer (a non-200's body)
    answer: str  # the generated text (streamed: the deltas joined; generate: the token ids)
    payload: dict[str, Any] | None  # the JSON answer (non-streaming)
    usage: dict[str, Any] | None  # prompt_tokens and completion_tokens (any API)
    client_headers: set[str]  # the header names the client sent
    legs: list[Exchange]


def _choice_text(choice: dict[str, Any]) -> str:
    if "token_ids" in choice and "text" not in choice:
        return " ".join(str(t) for t in choice["token_ids"] or [])
    if "text" in choice:
        return choice["text"] or ""
    part = choice.get("message") or choice.get("delta") or {}
    return part.get("content") or ""


def _answer_text(payload: dict[str, Any]) -> str:
    """The generated text of a completions, chat, Responses or messages answer (generate: its
    token ids)."""
    if "choices" in payload:
        return _choice_text(payload["choices"][0])
    if "output" in payload:
        return "".join(part["text"] for item in payload["output"] if item["type"] == "message"
                       for part in item["content"] if part["type"] == "output_text")
    return "".join(block["text"] for block in payload["content"] if block["type"] == "text")


def _usage(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    """Usage in the chat APIs' names (the Responses and messages APIs say input/output)."""
    if usage is None or "prompt_tokens" in usage:
        return usage
    return {"prompt_tokens": usage["input_tokens"], "completion_tokens": usage["output_tokens"]}


def _stream_events(lines: list[str]) -> tuple[str, dict[str, Any] | None]:
    """(text, usage) of an SSE answer: chat/completions chunks up to ``[DONE]``, the Responses
    API's events up to ``response.completed``, or Anthropic's up to ``message_stop``."""
    events = [line[len("data: "):] for line in lines if line.startswith("data: ")]
    if events and events[-1] == "[DONE]":
        chunks = [json.loads(e) for e in events[:-1]]
        text = "".join(_choice_text(c["choices"][0]) for c in chunks if c.get("choices"))
        return text, next((c["usage"] for c in reversed(chunks) if c.get("usage")), None)
    typed = [json.loads(e) for e in events]
    assert typed, lines[-5:]
    if typed[-1]["type"] == "response.completed":
        text = "".join(e["delta"] for e in typed if e["type"] == "response.output_text.delta")
        return text, _usage(typed[-1]["response"]["usage"])
    assert typed[-1]["type"] == "message_stop", lines[-5:]
    text = "".join(e["delta"].get("text", "") for e in typed
                   if e["type"] == "content_block_delta")
    start = next(e for e in typed if e["type"] == "message_start")["message"]["usage"]
    end = [e["usage"] for e in typed if e["type"] == "message_delta"][-1]
    return text, {"prompt_tokens": start["input_tokens"], "completion_tokens": end["output_tokens"]}


def via_sidecar(pair: Pair, endpoint: str, body: dict[str, Any], *, prefill: str | None = "P",
                ) -> Relayed:
    """``body`` through the relay; ``prefill`` the x-prefiller-host-port value ("P": the pair's
    prefill engine, None: no header)."""
    host = pair.prefill_hostport if prefill == "P" else prefill
    headers = {PREFILL_HEADER: host} if host else {}
    mark = len(pair.relay.exchanges)
    url = pair.relay.url + PATHS[endpoint]
    if not body.get("stream"):
        r = httpx.post(url, json=body, headers=headers, timeout=300)
        payload = r.json() if r.status_code == 200 else None
        return Relayed(r.status_code, r.text, _answer_text(payload) if payload else "", payload,
                       _usage(payload.get("usage")) if payload else None,
                       {k.lower() for k in r.request.headers}, pair.relay.since(mark))
    with httpx.stream("POST", url, json=body, headers=headers, timeout=300) as r:
        lines = list(r.iter_lines())
        sent = {k.lower() for k in r.request.headers}
        status = r.status_code
    assert status == 200, lines
    answer, usage = _stream_events(lines)
    return Relayed(status, "\n".join(lines), answer, None, usage, sent, pair.relay.since(mark))


def reference(pair: Pair, endpoint: str, body: dict[str, Any]) -> str:
    """The prefill engine answering alone (no kv_transfer_params, no streaming)."""
    alone = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    r = httpx.post(pair.prefill.url + PATHS[endpoint], json=alone, timeout=300)
    assert r.status_code == 200, r.text
    return _answer_text(r.json())


# ---- checks -----------------------------------------------------------------------------------
def sidecar_prefill_body(body: dict[str, Any], endpoint: str) -> dict[str, Any]:
    """The prefill body connector_nixlv2.go builds from a client's ``body``."""
    p = copy.deepcopy(body)
    limits = p.setdefault("sampling_params", {}) if endpoint == "generate" else p
    for name in ROUTES[PATHS[endpoint]]:
        limits[name] = 1
    p["kv_transfer_params"] = PREFILL_KV_PARAMS
    p["stream"] = False
    p.pop("stream_options", None)
    return p


def assert_sidecar_legs(out: Relayed, body: dict[str, Any], endpoint: str) -> dict[str, Any]:
    """The two legs carry exactly what the Go sidecar sends (and so nothing turbowire-specific):
    returns the prefill engine's kv_transfer_params as the decode engine got them."""
    assert [leg.stage for leg in out.legs] == ["prefill", "decode"], out.legs
    p_leg, d_leg = out.legs
    assert p_leg.json() == sidecar_prefill_body(body, endpoint)
    kv = p_leg.response_json()["kv_transfer_params"]
    assert d_leg.json() == {**body, "kv_transfer_params": kv}
    # the params the decode engine acted on are signed: it verified them after Go's JSON
    assert isinstance(kv.get("turbowire_params_mac"), str) and len(kv["turbowire_params_mac"]) == 64
    want = (out.client_headers - DROPPED_HEADERS) | ADDED_HEADERS
    for leg in out.legs:
        assert leg.header_names() == want, (leg.stage, leg.header_names(), want)
    ids = {leg.header("x-request-id")[0] for leg in out.legs}
    assert len(ids) == 1 and all(len(leg.header("x-request-id")) == 1 for leg in out.legs)
    return kv


def wait_loaded(pair: Pair, before: dict[str, float], n: int) -> dict[str, float]:
    """The decode engine's metrics once it has counted one more load and the prompt's tokens
    as external (published with its next steps)."""
    deadline = time.monotonic() + 20
    while True:
        after = pair.metrics()
        loads = (metric_sum(after, "turbowire_kv_transfers_total", direction="recv")
                 - metric_sum(before, "turbowire_kv_transfers_total", direction="recv"))
        external = (metric_sum(after, "vllm:prompt_tokens_by_source_total",
                               source="external_kv_transfer")
                    - metric_sum(before, "vllm:prompt_tokens_by_source_total",
                                 source="external_kv_transfer"))
        if (loads >= 1 and external >= n - 1) or time.monotonic() > deadline:
            return after
        time.sleep(0.2)


def assert_loaded(pair: Pair, before: dict[str, float], n: int) -> None:
    """Exactly one load of the whole ``n``-token prompt, at the preset's wire size."""
    after = wait_loaded(pair, before, n)

    def delta(name: str, **labels: str) -> float:
        return metric_sum(after, name, **labels) - metric_sum(before, name, **labels)

    assert delta("turbowire_kv_transfers_total", direction="recv") == 1
    assert delta("turbowire_kv_wire_bytes_total", direction="recv", preset=pair.preset) == (
        wire_bytes(pair.preset, n))
    assert delta("turbowire_kv_dense_bytes_total", direction="recv", preset=pair.preset) == (
        n * ELEMENTS_PER_TOKEN * 2)
    assert n - 1 <= delta("vllm:prompt_tokens_by_source_total",
                          source="external_kv_transfer") <= n
    assert delta("turbowire_kv_transfer_failures_total") == 0


def assert_answer(pair: Pair, out: Relayed, endpoint: str, body: dict[str, Any]) -> None:
    assert out.usage is not None, out.text
    produced = out.usage["completion_tokens"]
    if endpoint in MAY_STOP_EARLY:
        assert 1 <= produced <= MAX_TOKENS, out.usage
    else:
        assert produced == MAX_TOKENS, out.usage
    if pair.preset == "raw":  # bf16 passed through: greedy equals one engine alone
        assert out.answer == reference(pair, endpoint, body)


# ---- the sidecar's P/D flow -------------------------------------------------------------------
CASES = {  # (endpoint, stream, prompt length): token ids or words, not block-aligned
    "completions": ("completions", False, 150),
    "completions-stream": ("completions", True, 97),
    "chat": ("chat", False, 120),
    "chat-stream": ("chat", True, 45),
    "responses": ("responses", False, 80),
    "responses-stream": ("responses", True, 33),
    "messages": ("messages", False, 70),
    "messages-stream": ("messages", True, 52),
    "generate": ("generate", False, 90),
}


@pytest.mark.parametrize("case", list(CASES))
def test_pd_through_the_sidecar_loads_the_prompt(pair, case):
    endpoint, stream, length = CASES[case]
    body = _body(pair, endpoint, 37_000 + list(CASES).index(case), length, stream)
    before = pair.metrics()
    out = via_sidecar(pair, endpoint, body)
    assert out.status == 200, out.text
    kv = assert_sidecar_legs(out, body, endpoint)
    n = _usage(out.legs[0].response_json()["usage"])["prompt_tokens"]
    assert kv["remote_num_tokens"] == n and kv["turbowire_preset"] == pair.preset
    if not stream:  # the decode engine's load report reaches the client through the sidecar
        load = out.payload["kv_transfer_params"]["turbowire_load"]
        assert load["failed"] is None and load["tokens"] == n, load
    assert out.usage["prompt_tokens"] == n
    assert_loaded(pair, before, n)
    assert_answer(pair, out, endpoint, body)


# ---- what else the sidecar lets through -------------------------------------------------------
def test_without_a_prefill_header_the_decode_engine_serves_alone(pair):
    """The EPP sends a request without ``x-prefiller-host-port`` when it decides against
    disaggregation (short prompts, a decode-only decider): the sidecar hands the body to the
    decode engine untouched."""
    body = _body(pair, "completions", 38_000, 60, False)
    before = pair.metrics()
    out = via_sidecar(pair, "completions", body, prefill=None)
    assert out.status == 200, out.text
    assert [leg.stage for leg in out.legs] == ["decoder"]
    assert out.legs[0].json() == body and "x-request-id" not in out.legs[0].header_names()
    assert out.payload["kv_transfer_params"] is None  # nothing loaded, nothing to report
    assert_answer(pair, out, "completions", body)
    after = pair.metrics()
    assert metric_sum(after, "turbowire_kv_transfer_failures_total") == metric_sum(
        before, "turbowire_kv_transfer_failures_total")


@pytest.mark.parametrize("endpoint", list(PATHS))
def test_params_smuggled_in_vllm_xargs_are_refused_at_the_prefill_engine(pair, endpoint):
    """The sidecar overwrites top-level kv_transfer_params but passes ``vllm_xargs`` on: the
    prefill engine's guard refuses it (400 naming the field), which the sidecar returns as is,
    and no decode request is made."""
    body = _body(pair, endpoint, 39_000, 40, False)
    body["vllm_xargs"] = {"kv_transfer_params": "x"}
    out = via_sidecar(pair, endpoint, body)
    assert out.status == 400, out.text
    assert "vllm_xargs.kv_transfer_params" in out.text
    assert [leg.stage for leg in out.legs] == ["prefill"]


class FakePrefill:
    """An HTTP server posing as a prefill engine: every POST gets a completion whose
    kv_transfer_params are ``params`` (a client that names its own prefill host)."""

    def __init__(self, params: dict[str, Any]) -> None:
        answer = json.dumps({
            "id": "cmpl-fake", "object": "text_completion", "model": MODEL_NAME,
            "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            "kv_transfer_params": params}).encode()

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                """Quiet."""

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.hostport = f"127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def test_a_prefill_host_named_by_the_client_cannot_redirect_the_decode_engine(pair):
    """Without the sidecar's SSRF allowlist (off by default, and in llm-d's guides) a client
    names the prefill host itself. Its fake prefill engine returns well-formed params for the
    very prompt, naming a decoy and signed with another token: the decode engine refuses them
    before dialing anything (``unauthenticated_params``) and computes the prompt itself."""
    from turbowire.connector.compat import FORMAT_VERSION
    from turbowire.connector.geometry import blocks_for_tokens
    from turbowire.connector.params import (
        new_lease_token,
        params_mac_key,
        prefill_result,
        prompt_digest,
    )

    body = _body(pair, "completions", 40_000, 70, False)
    n = len(body["prompt"])
    decoy = BlackHole()
    forged = prefill_result(
        engine_id="forged-engine", request_id="forged-request", host="127.0.0.1",
        port=decoy.port, slots=range(blocks_for_tokens(n, BLOCK_SIZE)), num_tokens=n,
        tp_size=1, preset=pair.preset, format_version=FORMAT_VERSION,
        prompt_hash=prompt_digest(body["prompt"], n), lease_seconds=10.0, dense_bytes=0,
        wire_bytes=0, lease_token=new_lease_token(), mac_key=params_mac_key("not-the-token"))
    fake = FakePrefill(forged)
    try:
        before = pair.metrics()
        out = via_sidecar(pair, "completions", body, prefill=fake.hostport)
        assert out.status == 200, out.text
        assert [leg.stage for leg in out.legs] == ["prefill", "decode"]
        assert out.legs[1].json()["kv_transfer_params"]["remote_port"] == decoy.port
        load = out.payload["kv_transfer_params"]
        assert load is None or load["turbowire_load"]["tokens"] == 0, load
        assert_answer(pair, out, "completions", body)
        deadline = time.monotonic() + 15
        while True:
            after = pair.metrics()
            refused = (metric_sum(after, "turbowire_kv_transfer_failures_total",
                                  reason="unauthenticated_params")
                       - metric_sum(before, "turbowire_kv_transfer_failures_total",
                                    reason="unauthenticated_params"))
            if refused or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert refused == 1
        time.sleep(2.0)  # a handshake would have connected by now
        assert decoy.accepted == [], "the decode engine dialed the host the params named"
    finally:
        fake.close()
        decoy.close()


def test_no_lease_is_left_on_the_prefill_engine(pair):
    """Runs last: every lease the sidecar's requests took was released by its decode load."""
    from turbowire.connector.sidechannel.client import SideChannelClient

    spec = pair.prefill.spec
    assert spec is not None and spec.side_channel_port is not None
    client = SideChannelClient("127.0.0.1", spec.side_channel_port, TOKEN, timeout=10)
    try:
        deadline = time.monotonic() + 15
        while True:
            status = client.pool_status()
            if (status.used_slots == 0 and status.leases == 0) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        client.close()
    assert status.used_slots == 0 and status.leases == 0, status
