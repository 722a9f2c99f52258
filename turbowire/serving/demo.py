"""``turbowire demo``: one prefill engine, one decode engine and the proxy on localhost.

Starts both vLLM CPU engines (SmolLM2-135M-Instruct, each pinned to its own core) with
TurboWireConnector, starts the P/D proxy, warms the NIXL connection up, sends a few chat prompts
through the proxy (streaming, to measure TTFT as a client sees it), prints the completions and a
table per request, and shuts everything down (process groups) even on Ctrl-C.

Per request: prompt tokens (prefill engine), dense and wire bytes and transfer time (deltas of
the decode engine's own ``turbowire_kv_*`` Prometheus series), TTFT (client side, through the
proxy: prefill + KV transfer + first decode step).
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


@dataclass
class DemoRun:
    preset: str
    results: list[DemoResult] = field(default_factory=list)
    startup_seconds: float = 0.0
    warmup_ms: float = 0.0


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
    proxy_url: str, prompt: str, max_tokens: int, request_id: str
) -> tuple[str, float, float]:
    """(completion, ttft seconds, total seconds) of one streamed chat request via the proxy."""
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
) -> DemoRun:
    """Start engines + proxy, run the prompts, stop everything; returns the measurements."""
    run = DemoRun(preset)
    p_port, d_port, x_port = free_port(), free_port(), free_port()
    side_p, side_d = free_port(), free_port()
    common = dict(
        kvcache_gib=1, block_size=32, max_model_len=4096, max_num_seqs=4,
        max_num_batched_tokens=2048, served_model_name="demo",
    )
    p_spec = EngineSpec(
        "prefill", model, p_port, cpu=0,
        kv_transfer_config=turbowire_kv_config(
            "kv_both", preset=preset, side_channel_port=side_p, staging_bytes="64MiB"
        ),
        **common,
    )
    d_spec = EngineSpec(
        "decode", model, d_port, cpu=1,
        kv_transfer_config=turbowire_kv_config(
            "kv_both", preset=preset, side_channel_port=side_d, staging_bytes="64MiB"
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
        x = group.add(start_proxy([p.url], [d.url], x_port, log_dir))
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
        on_progress("shutting down engines and proxy")
    return run
