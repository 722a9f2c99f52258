"""``turbowire demo``: one prefill engine, one decode engine and the proxy on localhost.

Starts both vLLM CPU engines (SmolLM2-135M-Instruct, each pinned to its own core) with
TurboWireConnector, starts the P/D proxy, warms the NIXL connection up, sends a few chat prompts
through the proxy (streaming, to measure TTFT as a client sees it), prints the completions and a
table per request, and shuts everything down (process groups) even on Ctrl-C.

Per request: prompt tokens (prefill engine), dense and wire bytes and transfer time (deltas of
the decode engine's own ``turbowire_kv_*`` Prometheus series), TTFT (client side, through the
proxy: prefill + KV transfer + first decode step).

Second act (the store path; engines run ``transport: both`` with a loopback redis-server): one
long document is asked on engine A, which computes it and stores its compressed chunks in Redis;
the same request on engine B (another process) loads them instead of computing; the proxy,
asking the Redis directory, then sends the same request straight to a decode engine, skipping
prefill. It reports both TTFTs, the tokens loaded and the bytes Redis holds.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from turbowire.serving.launch import (
    EngineSpec,
    ProcessGroup,
    engine_lock,
    free_port,
    start_engine,
    start_proxy,
    turbowire_kv_config,
)

logger = logging.getLogger(__name__)

LONG_TEXT = (
    "Disaggregated serving splits inference into two phases that run on different machines. "
    "The prefill phase reads the whole prompt at once and is limited by compute; the decode "
    "phase produces one token at a time and is limited by memory bandwidth. Running them on "
    "separate engines lets each be sized and batched for its own bottleneck, but the key-value "
    "cache built by the prefill engine must travel to the decode engine before the first token "
    "can be produced, and that cache is large: every layer stores a key and a value vector for "
    "every token and every attention head. Compressing it on the wire trades a little compute "
    "for a lot less network traffic. "
)

DEFAULT_PROMPTS: tuple[str, ...] = (
    "What is the capital of France?",
    "Write two sentences about why the sky is blue.",
    "Summarize the following text in one sentence.\n\n" + LONG_TEXT,
    "Read the text and list three facts from it.\n\n" + LONG_TEXT * 4,
)


@dataclass
class DemoResult:
    prompt: str
    completion: str
    prompt_tokens: int
    dense_bytes: float
    wire_bytes: float
    transfer_ms: float | None
    ttft_ms: float
    prefill_ms: float | None
    total_ms: float

    @property
    def ratio(self) -> float | None:
        return self.dense_bytes / self.wire_bytes if self.wire_bytes else None


STORE_DOCUMENT = (
    "Answer from the document below.\n\n" + LONG_TEXT * 14
    + "\n\nQuestion: what limits the decode phase?"
)
STORE_NAMESPACE = "demo"


@dataclass
class StoreAct:
    """The second act: one document, computed on engine A, loaded from the store on engine B."""

    prompt_tokens: int
    cold_ttft_ms: float  # engine A computes the prompt
    hit_ttft_ms: float  # engine B loads the stored chunks
    loaded_tokens: int
    loaded_dense_bytes: float
    loaded_store_bytes: float
    redis_chunks: int
    redis_bytes: int
    proxy_route: str
    proxy_ttft_ms: float
    completion_a: str
    completion_b: str

    @property
    def saved_ms(self) -> float:
        return self.cold_ttft_ms - self.hit_ttft_ms


@dataclass
class DemoRun:
    preset: str
    results: list[DemoResult] = field(default_factory=list)
    startup_seconds: float = 0.0
    warmup_ms: float = 0.0
    store: StoreAct | None = None


_SAMPLE_RE = re.compile(r'^(turbowire_kv_[a-z_]+)\{([^}]*)\} ([0-9.eE+-]+)$')


def scrape_turbowire(url: str) -> dict[str, float]:
    """Sum the decode engine's receive-side turbowire series by name."""
    text = httpx.get(url + "/metrics", timeout=10).text
    totals: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE_RE.match(line)
        if not m:
            continue
        name, labels, value = m.groups()
        if 'direction="send"' in labels:
            continue
        totals[name] = totals.get(name, 0.0) + float(value)
    return totals


def stream_chat(
    proxy_url: str, prompt: str, max_tokens: int, request_id: str,
    headers_out: dict[str, str] | None = None,
) -> tuple[str, float, float]:
    """(completion, ttft seconds, total seconds) of one streamed chat request (via the proxy or
    straight to an engine); the response headers go to ``headers_out``."""
    import json

    body = {
        "model": "demo",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    t0 = time.perf_counter()
    ttft: float | None = None
    parts: list[str] = []
    with httpx.stream(
        "POST", proxy_url + "/v1/chat/completions", json=body, timeout=600,
        headers={"X-Request-Id": request_id},
    ) as resp:
        resp.raise_for_status()
        if headers_out is not None:
            headers_out.update(resp.headers)
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            payload = json.loads(line[6:])
            if "error" in payload:
                raise RuntimeError(f"request {request_id} failed: {payload['error']}")
            delta = (payload.get("choices") or [{}])[0].get("delta", {}).get("content")
            if delta:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                parts.append(delta)
    total = time.perf_counter() - t0
    return "".join(parts), ttft if ttft is not None else total, total


def scrape_store(url: str) -> dict[str, float]:
    """An engine's store-path series (hits, bytes loaded), summed by name and result."""
    text = httpx.get(url + "/metrics", timeout=10).text
    totals: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r'^(turbowire_[a-z_]+)\{([^}]*)\} ([0-9.eE+-]+)$', line)
        if not m:
            continue
        name, labels, value = m.groups()
        if name.startswith("turbowire_store_lookup") and 'result="hit"' in labels:
            totals[name] = totals.get(name, 0.0) + float(value)
        elif name == "turbowire_kv_dense_bytes_total" and 'transport="store"' in labels:
            totals[name] = totals.get(name, 0.0) + float(value)
    return totals


def _wait_stored(directory_url: str, minimum: int, timeout: float = 20.0) -> tuple[int, int]:
    """(chunks, bytes) in the directory once it lists at least ``minimum`` chunks and stops
    growing (engine A's writes run in the background)."""
    from turbowire.store.directory import Directory

    directory = Directory(directory_url, ttl_seconds=3600)
    try:
        deadline = time.monotonic() + timeout
        last = (-1, -1)
        while True:
            usage = directory.usage(STORE_NAMESPACE)
            if (usage[0] >= minimum and usage == last) or time.monotonic() > deadline:
                return usage
            last = usage
            time.sleep(0.3)
    finally:
        directory.close()


def run_store_act(a_url: str, b_url: str, proxy_url: str, directory_url: str,
                  max_tokens: int) -> StoreAct:
    """Ask one long document on A (cold), then on B (store hit), then through the proxy."""
    rid = uuid.uuid4().hex[:8]
    before_chunks, _ = _wait_stored(directory_url, 0, timeout=0.5)
    text_a, cold, _ = stream_chat(a_url, STORE_DOCUMENT, max_tokens, f"store-a-{rid}")
    tokens = httpx.post(a_url + "/tokenize", timeout=30, json={
        "model": "demo", "messages": [{"role": "user", "content": STORE_DOCUMENT}],
        "add_generation_prompt": True}).json().get("count", 0)
    chunks, nbytes = _wait_stored(directory_url, before_chunks + 1)
    before = scrape_store(b_url)
    text_b, hit, _ = stream_chat(b_url, STORE_DOCUMENT, max_tokens, f"store-b-{rid}")
    deadline = time.monotonic() + 5
    after = scrape_store(b_url)
    while after == before and time.monotonic() < deadline:
        time.sleep(0.2)
        after = scrape_store(b_url)
    headers: dict[str, str] = {}
    _, proxy_ttft, _ = stream_chat(proxy_url, STORE_DOCUMENT, max_tokens, f"store-x-{rid}",
                                   headers_out=headers)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    from turbowire.connector.config_keys import DEFAULT_STORE_CHUNK_TOKENS

    return StoreAct(
        prompt_tokens=int(tokens), cold_ttft_ms=cold * 1e3, hit_ttft_ms=hit * 1e3,
        loaded_tokens=int(delta("turbowire_store_lookups_total")) * DEFAULT_STORE_CHUNK_TOKENS,
        loaded_dense_bytes=delta("turbowire_kv_dense_bytes_total"),
        loaded_store_bytes=delta("turbowire_store_lookup_bytes_total"),
        redis_chunks=chunks, redis_bytes=nbytes,
        proxy_route=headers.get("x-turbowire-route", "?"), proxy_ttft_ms=proxy_ttft * 1e3,
        completion_a=text_a, completion_b=text_b,
    )


def _wait_counter(url: str, name: str, before: float, timeout: float = 5.0) -> dict[str, float]:
    """The engine's stats reach /metrics a step later: poll until the transfer shows up."""
    deadline = time.monotonic() + timeout
    while True:
        now = scrape_turbowire(url)
        if now.get(name, 0.0) > before or time.monotonic() > deadline:
            return now
        time.sleep(0.1)


def run_demo(
    *,
    model: Path,
    preset: str,
    prompts: Sequence[str] = DEFAULT_PROMPTS,
    max_tokens: int = 48,
    log_dir: Path,
    on_progress: Callable[[str], None] = lambda msg: None,
    startup_timeout: float = 600.0,
    store: bool = True,
) -> DemoRun:
    """Start Redis (``store``), engines + proxy, run the prompts (and the store act), stop
    everything; returns the measurements."""
    run = DemoRun(preset)
    if store:
        from turbowire.serving.redis_server import RedisServer

        with RedisServer() as redis:
            on_progress(f"redis-server on {redis.url} (store and directory)")
            return _run_demo(run, model, preset, prompts, max_tokens, log_dir, on_progress,
                             startup_timeout, redis.url)
    return _run_demo(run, model, preset, prompts, max_tokens, log_dir, on_progress,
                     startup_timeout, None)


def _run_demo(
    run: DemoRun, model: Path, preset: str, prompts: Sequence[str], max_tokens: int,
    log_dir: Path, on_progress: Callable[[str], None], startup_timeout: float,
    store_url: str | None,
) -> DemoRun:
    p_port, d_port, x_port = free_port(), free_port(), free_port()
    side_p, side_d = free_port(), free_port()
    store_cfg: dict[str, object] = {}
    # the demo shows each request's route and load report: the proxy hides them by default
    proxy_args: list[str] = ["--expose-internals"]
    if store_url:
        store_cfg = dict(transport="both", store_url=store_url, store_namespace=STORE_NAMESPACE,
                         store_local_cpu_bytes="256MiB")
        proxy_args += ["--directory", store_url, "--store-namespace", STORE_NAMESPACE]
    common = dict(
        kvcache_gib=1, block_size=32, max_model_len=4096, max_num_seqs=4,
        max_num_batched_tokens=2048, served_model_name="demo",
    )
    p_spec = EngineSpec(
        "prefill", model, p_port, cpu=0,
        kv_transfer_config=turbowire_kv_config(
            "kv_producer", preset=preset, side_channel_port=side_p, staging_bytes="64MiB",
            **store_cfg,
        ),
        **common,
    )
    d_spec = EngineSpec(
        "decode", model, d_port, cpu=1,
        kv_transfer_config=turbowire_kv_config(
            "kv_consumer", preset=preset, side_channel_port=side_d, staging_bytes="64MiB",
            **store_cfg,
        ),
        **common,
    )
    with engine_lock(), ProcessGroup() as group:
        t0 = time.monotonic()
        on_progress(f"starting prefill engine (core 0) and decode engine (core 1), preset {preset}")
        p = group.add(start_engine(p_spec, log_dir))
        d = group.add(start_engine(d_spec, log_dir))
        p.wait_healthy(startup_timeout)
        d.wait_healthy(startup_timeout)
        x = group.add(start_proxy([p.url], [d.url], x_port, log_dir, proxy_args))
        x.wait_healthy(60)
        run.startup_seconds = time.monotonic() - t0
        on_progress(f"engines and proxy up in {run.startup_seconds:.0f} s; warming up NIXL")
        _, _, warm = stream_chat(x.url, "Hello!", 4, f"warmup-{uuid.uuid4().hex[:8]}")
        run.warmup_ms = warm * 1e3
        for i, prompt in enumerate(prompts):
            rid = f"demo-{i}-{uuid.uuid4().hex[:8]}"
            before = scrape_turbowire(d.url)
            text, ttft, total = stream_chat(x.url, prompt, max_tokens, rid)
            after = _wait_counter(
                d.url,
                "turbowire_kv_transfers_total",
                before.get("turbowire_kv_transfers_total", 0.0),
            )
            rec = httpx.get(f"{x.url}/turbowire/requests/{rid}", timeout=10).json()

            def delta(
                name: str, after: dict[str, float] = after, before: dict[str, float] = before
            ) -> float:
                return after.get(name, 0.0) - before.get(name, 0.0)

            n_xfer = delta("turbowire_kv_transfers_total")
            transfer_s = delta("turbowire_kv_transfer_duration_seconds_sum")
            result = DemoResult(
                prompt=prompt,
                completion=text,
                prompt_tokens=int(rec.get("prompt_tokens") or 0),
                dense_bytes=delta("turbowire_kv_dense_bytes_total"),
                wire_bytes=delta("turbowire_kv_wire_bytes_total"),
                transfer_ms=transfer_s * 1e3 if n_xfer >= 1 else None,
                ttft_ms=ttft * 1e3,
                prefill_ms=(rec.get("prefill_seconds") or 0) * 1e3 or None,
                total_ms=total * 1e3,
            )
            run.results.append(result)
            on_progress(
                f"request {i + 1}/{len(prompts)} done ({result.prompt_tokens} prompt tokens)"
            )
        if store_url:
            on_progress("second act: one long document on engine A, then on engine B (store)")
            run.store = run_store_act(p.url, d.url, x.url, store_url, max_tokens)
        on_progress("shutting down engines and proxy")
    return run
