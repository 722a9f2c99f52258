"""Soak run: many requests with random shapes and client aborts through the proxy to a prefill +
decode engine pair on loopback, then checks that nothing leaked.

One run is a bounded loop (``requests`` requests, each with a timeout) at a fixed concurrency:

* prompts are random token ids (seeded) of log-uniform length, from a few tokens to
  ``max_model_len`` minus the largest ``max_tokens`` (long ones exceed ``max_num_batched_tokens``,
  so they are prefilled in chunks); a fraction starts with one of a few shared prefixes (the
  decode engine's prefix cache then loads only the new blocks);
* ``max_tokens`` is random, ``ignore_eos`` is set, so every completed request has exactly
  ``max_tokens`` tokens; half the requests stream, half are greedy (the rest sample);
* a seeded fraction is aborted by the client (``stream=true``): half of them are closed after a
  random delay from sending (before the first token, while the prefill or the KV load runs,
  unless the request is already streaming by then), half after a random number of streamed
  tokens (mid-stream).

After a warm-up (the first ``warmup_requests``, so one-time allocations are excluded) the engines'
process trees are sampled (RSS, open fds, threads: vLLM runs EngineCore in a child process); after
the last request, once the prefill engine's staging pool is empty (up to ``lease_seconds`` for
unread leases of aborted requests to expire) they are sampled again. The report says whether every
non-aborted request succeeded with the expected token count, whether the staging-bytes gauge and
vLLM's KV usage are back to their baselines and whether fds, threads and RSS grew beyond the
bounds (:class:`SoakBounds`); a sample of greedy requests is compared with the prefill engine
answering alone (binding for the lossless ``raw`` preset only) and with the same request sent
again through the proxy alone (binding for every preset: the codec is deterministic). A greedy
difference is forgiven only as a near-tie flip (:func:`divergence`): CPU kernels are not batch
invariant, so a request batched with others may swap two tokens whose logprobs are within
``TIE_MARGIN_NATS``; anything else (another distribution) counts.

The staging gauges are read after one probe request per engine: vLLM publishes engine and
connector gauges only when the engine steps, so an idle engine's /metrics still shows the staging
of its last step (the report keeps the unprobed values too).

Library only (no printing): ``turbowire soak`` prints the tables and writes the JSON.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import math
import random
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from turbowire.connector.config import MAX_LEASE_SECONDS, MIN_LEASE_SECONDS
from turbowire.serving.launch import (
    EngineSpec,
    ManagedProcess,
    ProcessGroup,
    engine_lock,
    free_port,
    start_engine,
    start_proxy,
    turbowire_kv_config,
)

logger = logging.getLogger(__name__)

MiB = 1 << 20
#: Presets whose decoded KV equals the engine's own (greedy P/D output == one engine's).
LOSSLESS_PRESETS = frozenset({"raw"})
STAGING_GAUGE = "turbowire_staging_in_use_bytes"
LEASES_GAUGE = "turbowire_leases_outstanding"
KV_USAGE_GAUGE = "vllm:kv_cache_usage_perc"
PROXY_IN_FLIGHT = "turbowire_proxy_in_flight_requests"


#: oneDNN (vLLM's CPU GEMMs, ``onednn_mm``) caches a JIT-compiled primitive per GEMM shape, up
#: to ``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` (1024 by default); a prefill engine sees a new M for
#: every distinct prompt or chunk length, so its RSS climbs by hundreds of MiB until the cache
#: is full, whatever the connector does (bench/prefill_rss.py; docs/operations.md). The soak
#: bounds that cache so that what is left of the RSS growth is the serving path's own.
DEFAULT_ENGINE_ENV: dict[str, str] = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64"}


@dataclass(frozen=True)
class SoakBounds:
    """What counts as a leak, per engine process tree, between the warm-up and the end.

    Why these numbers: a leak tied to requests grows with them (hundreds of requests after the
    warm-up, tens of them aborted), while a healthy engine only varies by what its thread pools
    and sockets do at the moment of sampling. ``max_fd_growth``: a few keep-alive sockets (the
    proxy's pool, gRPC side-channel channels) may be open at one sample and not the other.
    ``max_thread_growth``: thread pools (gRPC server, tokenizer, NIXL progress) start threads
    lazily up to a fixed maximum. RSS: ``max_rss_growth_bytes`` for what glibc arenas and the
    Python heap keep of a peak batch, plus ``max_rss_growth_per_request`` for every request
    after the warm-up. Those hold only with oneDNN's primitive cache bounded
    (:data:`DEFAULT_ENGINE_ENV`): at its default capacity a CPU prefill worker grows by a
    primitive per new GEMM shape, linearly in distinct prompt lengths, with or without a
    connector. With it bounded, a per-request leak of the transfer path (staging views,
    registrations, transfer handles of a few hundred KiB) still exceeds 256 KiB per request.
    The decode tree is held to the same bound. KV usage and staging bytes must return exactly to
    their baselines.
    """

    max_fd_growth: int = 8
    max_thread_growth: int = 4
    max_rss_growth_bytes: int = 32 * MiB
    max_rss_growth_per_request: int = 256 * 1024
    max_kv_usage_delta: float = 0.0
    max_staging_bytes_end: int = 0


@dataclass
class SoakConfig:
    requests: int = 1000
    concurrency: int = 8
    abort_fraction: float = 0.05
    seed: int = 0
    preset: str = "tq4"
    warmup_requests: int = 50
    stream_fraction: float = 0.5
    greedy_fraction: float = 0.5
    shared_prefix_fraction: float = 0.2
    min_prompt_tokens: int = 3
    max_tokens_min: int = 1
    max_tokens_max: int = 32
    #: mid-stream aborts need tokens to abort in: their max_tokens is drawn from this range
    abort_max_tokens_max: int = 64
    #: an early abort closes the request after a random fraction of the median TTFT seen so
    #: far (this many seconds before any TTFT is known), so most of them close before the first
    #: token whatever the model's speed and the machine's load
    early_abort_default_s: float = 0.2
    lease_seconds: float = 5.0
    staging_slots: int = 160
    block_size: int = 32
    max_model_len: int = 2048
    max_num_batched_tokens: int = 1024
    max_num_seqs: int = 8
    kvcache_gib: int = 1
    request_timeout_s: float = 180.0
    startup_timeout_s: float = 900.0
    greedy_check_samples: int = 16
    served_model_name: str = "soak"
    #: extra environment of both engines; see :data:`DEFAULT_ENGINE_ENV` for why the default
    engine_env: dict[str, str] = field(default_factory=lambda: dict(DEFAULT_ENGINE_ENV))
    bounds: SoakBounds = field(default_factory=SoakBounds)

    def __post_init__(self) -> None:
        if self.requests < 1:
            raise ValueError("requests must be >= 1")
        if self.concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        if not 0.0 <= self.abort_fraction < 1.0:
            raise ValueError("abort_fraction must be in [0, 1)")
        if not MIN_LEASE_SECONDS <= self.lease_seconds <= MAX_LEASE_SECONDS:
            raise ValueError(
                f"lease_seconds must be >= {MIN_LEASE_SECONDS:g} and <= {MAX_LEASE_SECONDS:g} "
                "(the connector's bounds)"
            )
        if self.max_prompt_tokens < self.min_prompt_tokens:
            raise ValueError("max_model_len leaves no room for prompts")

    @property
    def warmup(self) -> int:
        """Warm-up requests actually used: at most half the run."""
        return max(0, min(self.warmup_requests, self.requests // 2))

    @property
    def max_prompt_tokens(self) -> int:
        return self.max_model_len - max(self.max_tokens_max, self.abort_max_tokens_max)


# ------------------------------------------------------------------------------ request plan
@dataclass(frozen=True)
class RequestPlan:
    index: int
    prompt: list[int]
    max_tokens: int
    stream: bool
    greedy: bool
    abort: str | None = None  # "early" (delay from sending) | "mid" (after some tokens)
    abort_delay_frac: float = 0.0  # early aborts: fraction of the TTFT scale
    abort_after_tokens: int = 0
    shared_prefix: int | None = None

    def body(self, model: str) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": model, "prompt": self.prompt, "max_tokens": self.max_tokens,
            "ignore_eos": True, "stream": self.stream,
            "temperature": 0.0 if self.greedy else 1.0,
        }
        if self.greedy:
            # the top tokens per position: tells a near-tie flip from corruption
            body["logprobs"] = TOP_LOGPROBS
        else:
            # no per-request "seed": vLLM 0.32's CPU runner crashes the engine when a seeded
            # request is prefilled in chunks (torch's CPU generator has no offset to rewind)
            body["top_p"] = 0.9
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        return body


def token_id_range(model: Path) -> tuple[int, int]:
    """Ids to draw prompts from: past the tokenizer's special tokens, below the vocabulary."""
    vocab = int(json.loads((model / "config.json").read_text()).get("vocab_size") or 0)
    low = 3
    tok = model / "tokenizer.json"
    if tok.is_file():
        added = json.loads(tok.read_text()).get("added_tokens") or []
        if added:
            low = max(low, max(int(a["id"]) for a in added) + 1)
    if vocab <= low + 1:
        raise ValueError(f"{model}: vocab_size {vocab} leaves no ordinary token ids")
    return low, vocab


def make_plans(cfg: SoakConfig, token_ids: tuple[int, int]) -> list[RequestPlan]:
    """The whole run, decided up front from ``cfg.seed`` (same seed, same requests)."""
    rng = random.Random(cfg.seed)
    low, high = token_ids

    def tokens(n: int) -> list[int]:
        return [rng.randrange(low, high) for _ in range(n)]

    prefixes = [tokens(cfg.block_size * k) for k in (2, 3, 4, 5)]
    lo, hi = math.log(cfg.min_prompt_tokens), math.log(cfg.max_prompt_tokens)
    plans = []
    for i in range(cfg.requests):
        n = int(round(math.exp(rng.uniform(lo, hi))))
        n = max(cfg.min_prompt_tokens, min(cfg.max_prompt_tokens, n))
        if i == 0 and cfg.warmup:
            n = cfg.max_prompt_tokens  # the warm-up sees the largest prefill shape
        shared = None
        if rng.random() < cfg.shared_prefix_fraction:
            shared = rng.randrange(len(prefixes))
            prefix = prefixes[shared]
            n = max(n, len(prefix) + 1)
            prompt = prefix + tokens(n - len(prefix))
        else:
            prompt = tokens(n)
        greedy = rng.random() < cfg.greedy_fraction
        if rng.random() < cfg.abort_fraction:
            kind = "early" if rng.random() < 0.5 else "mid"
            max_tokens = rng.randint(max(8, cfg.max_tokens_min), cfg.abort_max_tokens_max)
            plans.append(RequestPlan(
                i, prompt, max_tokens, stream=True, greedy=greedy, abort=kind,
                abort_delay_frac=rng.random(),
                abort_after_tokens=rng.randint(1, max_tokens - 1), shared_prefix=shared,
            ))
        else:
            plans.append(RequestPlan(
                i, prompt, rng.randint(cfg.max_tokens_min, cfg.max_tokens_max),
                stream=rng.random() < cfg.stream_fraction, greedy=greedy, shared_prefix=shared,
            ))
    return plans


# ------------------------------------------------------------------------------ outcomes
@dataclass
class RequestOutcome:
    index: int
    prompt_tokens: int
    max_tokens: int
    stream: bool
    greedy: bool
    planned_abort: str | None
    #: ok | failed | aborted_before_first_token | aborted_mid_stream
    status: str = "failed"
    http_status: int | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None
    latency_s: float | None = None
    ttft_s: float | None = None
    error: str | None = None
    abort_delay_s: float | None = None  # early aborts: the delay the client closed after
    text: str = ""
    #: greedy requests: the chosen token and the top {token: logprob} of every position
    tokens: list[str] = field(default_factory=list)
    top: list[dict[str, float]] = field(default_factory=list)

    @property
    def aborted(self) -> bool:
        return self.status.startswith("aborted")


class _Seen:
    """What a streaming request has received so far (read when an early abort fires)."""

    def __init__(self) -> None:
        self.first_token_at: float | None = None
        self.tokens = 0


async def _request(
    client: httpx.AsyncClient, url: str, model: str, plan: RequestPlan, seen: _Seen,
) -> RequestOutcome:
    out = RequestOutcome(plan.index, len(plan.prompt), plan.max_tokens, plan.stream, plan.greedy,
                         plan.abort)
    t0 = time.perf_counter()
    headers = {"X-Request-Id": f"soak-{plan.index}"}
    try:
        if not plan.stream:
            r = await client.post(url + "/v1/completions", json=plan.body(model), headers=headers)
            out.http_status = r.status_code
            out.latency_s = time.perf_counter() - t0
            if r.status_code != 200:
                out.error = f"HTTP {r.status_code}: {r.text[:300]}"
                return out
            data = r.json()
            choice = (data.get("choices") or [{}])[0]
            out.text = choice.get("text") or ""
            _take_logprobs(out, choice)
            out.finish_reason = choice.get("finish_reason")
            out.completion_tokens = (data.get("usage") or {}).get("completion_tokens")
            return _judge(out)
        async with client.stream(
            "POST", url + "/v1/completions", json=plan.body(model), headers=headers
        ) as r:
            out.http_status = r.status_code
            if r.status_code != 200:
                out.error = f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"
                out.latency_s = time.perf_counter() - t0
                return out
            parts: list[str] = []
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line[6:].strip()
                if payload == "[DONE]":
                    break
                chunk = json.loads(payload)
                if "error" in chunk:
                    out.error = f"stream error: {str(chunk['error'])[:300]}"
                    out.latency_s = time.perf_counter() - t0
                    return out
                usage = chunk.get("usage")
                if usage:
                    out.completion_tokens = usage.get("completion_tokens")
                for choice in chunk.get("choices") or ():
                    if seen.first_token_at is None:
                        seen.first_token_at = time.perf_counter()
                        out.ttft_s = seen.first_token_at - t0
                    seen.tokens += 1
                    parts.append(choice.get("text") or "")
                    _take_logprobs(out, choice)
                    if choice.get("finish_reason"):
                        out.finish_reason = choice["finish_reason"]
                if plan.abort == "mid" and seen.tokens >= plan.abort_after_tokens:
                    out.status = "aborted_mid_stream"  # leaving the block closes the connection
                    out.latency_s = time.perf_counter() - t0
                    return out
            out.text = "".join(parts)
            out.latency_s = time.perf_counter() - t0
            return _judge(out)
    except (httpx.HTTPError, ValueError) as exc:  # ValueError: a body that is not JSON
        out.error = f"{type(exc).__name__}: {exc}"[:300]
        out.latency_s = time.perf_counter() - t0
        return out


def _take_logprobs(out: RequestOutcome, choice: dict[str, Any]) -> None:
    lp = choice.get("logprobs") or {}
    out.tokens += list(lp.get("tokens") or ())
    out.top += [dict(t or {}) for t in lp.get("top_logprobs") or ()]


def _judge(out: RequestOutcome) -> RequestOutcome:
    """A completed request is ok only with exactly max_tokens tokens (ignore_eos is set)."""
    if out.completion_tokens != out.max_tokens:
        out.error = f"{out.completion_tokens} completion tokens, expected {out.max_tokens}"
    elif out.finish_reason != "length":
        out.error = f"finish_reason {out.finish_reason!r}, expected 'length'"
    else:
        out.status = "ok"
    return out


class TtftScale:
    """The median TTFT of the last completed streamed requests: early aborts are timed by it."""

    def __init__(self, default_s: float, window: int = 64) -> None:
        self.default_s = default_s
        self._recent: collections.deque[float] = collections.deque(maxlen=window)

    def add(self, out: RequestOutcome) -> None:
        if out.status == "ok" and out.ttft_s is not None:
            self._recent.append(out.ttft_s)

    def seconds(self) -> float:
        return statistics.median(self._recent) if self._recent else self.default_s


async def run_one(
    client: httpx.AsyncClient, url: str, model: str, plan: RequestPlan, scale: TtftScale,
) -> RequestOutcome:
    """One request; an early abort cancels it (httpx closes the connection) after its delay."""
    seen = _Seen()
    t0 = time.perf_counter()
    task = asyncio.ensure_future(_request(client, url, model, plan, seen))
    if plan.abort != "early":
        out = await task
        scale.add(out)
        return out
    delay = plan.abort_delay_frac * scale.seconds()
    done, _ = await asyncio.wait({task}, timeout=delay)
    if task in done:
        out = task.result()  # it finished before the abort: judged like any other request
        out.abort_delay_s = delay
        return out
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    out = RequestOutcome(plan.index, len(plan.prompt), plan.max_tokens, True, plan.greedy,
                         plan.abort, latency_s=time.perf_counter() - t0, abort_delay_s=delay)
    if seen.first_token_at is None:
        out.status = "aborted_before_first_token"
    else:
        out.status = "aborted_mid_stream"
        out.ttft_s = seen.first_token_at - t0
    return out


async def run_batch(
    url: str, model: str, plans: list[RequestPlan], concurrency: int, timeout: float,
    scale: TtftScale, on_done: Callable[[RequestOutcome], None] = lambda o: None,
) -> list[RequestOutcome]:
    """Every plan at ``concurrency`` requests in flight; returns when all are done."""
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency)
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=10.0),
                                 limits=limits) as client:

        async def guarded(plan: RequestPlan) -> RequestOutcome:
            async with sem:
                out = await run_one(client, url, model, plan, scale)
            on_done(out)
            return out

        return list(await asyncio.gather(*(guarded(p) for p in plans)))


# ------------------------------------------------------------------------------ measurements
def scrape_metrics(url: str) -> dict[str, float]:
    """Every sample of a /metrics page by its ``name{labels}`` key."""
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        key, _, value = line.rpartition(" ")
        with contextlib.suppress(ValueError):
            out[key] = float(value)
    return out


_KEY_RE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?$")


def metric_sum(samples: dict[str, float], name: str, **labels: str) -> float:
    total = 0.0
    for key, value in samples.items():
        m = _KEY_RE.match(key)
        if m and m.group(1) == name and all(f'{k}="{v}"' in (m.group(2) or "")
                                             for k, v in labels.items()):
            total += value
    return total


def metric_by_label(samples: dict[str, float], name: str, label: str) -> dict[str, float]:
    """``name`` summed per value of ``label`` (counters: ``{reason: count}``)."""
    out: dict[str, float] = {}
    for key, value in samples.items():
        m = _KEY_RE.match(key)
        if not m or m.group(1) != name:
            continue
        lm = re.search(rf'{label}="([^"]*)"', m.group(2) or "")
        if lm:
            out[lm.group(1)] = out.get(lm.group(1), 0.0) + value
    return out


@dataclass
class TreeSample:
    """One process and its descendants, summed."""

    processes: int
    rss_bytes: int
    fds: int
    threads: int
    #: per process: name, pid, rss_bytes, fds, threads (which member grew)
    members: list[dict[str, Any]] = field(default_factory=list)


def sample_tree(pid: int) -> TreeSample:
    import psutil

    root = psutil.Process(pid)
    procs = [root] + root.children(recursive=True)
    total = TreeSample(0, 0, 0, 0)
    for p in procs:
        try:
            with p.oneshot():
                member = {"name": p.name(), "pid": p.pid, "rss_bytes": p.memory_info().rss,
                          "fds": p.num_fds(), "threads": p.num_threads()}
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
        total.processes += 1
        total.rss_bytes += member["rss_bytes"]
        total.fds += member["fds"]
        total.threads += member["threads"]
        total.members.append(member)
    return total


@dataclass
class EngineReading:
    staging_bytes: float
    leases: float
    kv_usage: float
    pool_used_slots: int | None = None  # the side channel's answer (prefill engine)
    pool_leases: int | None = None


@dataclass
class Check:
    name: str
    value: float
    bound: float
    ok: bool
    note: str = ""


@dataclass
class SoakReport:
    config: dict[str, Any]
    model: str
    outcomes: list[RequestOutcome] = field(default_factory=list)
    startup_s: float = 0.0
    run_s: float = 0.0
    settle_s: float = 0.0
    baseline: dict[str, EngineReading] = field(default_factory=dict)
    end: dict[str, EngineReading] = field(default_factory=dict)
    #: the end gauges as /metrics showed them before a probe request made the engines step
    end_unprobed: dict[str, EngineReading] = field(default_factory=dict)
    trees_before: dict[str, TreeSample] = field(default_factory=dict)
    trees_after: dict[str, TreeSample] = field(default_factory=dict)
    #: engine trees sampled while the soak runs (under load): requests done, RSS, fds, threads
    timeline: list[dict[str, Any]] = field(default_factory=list)
    failures_by_reason: dict[str, dict[str, float]] = field(default_factory=dict)
    fallbacks_by_reason: dict[str, dict[str, float]] = field(default_factory=dict)
    proxy_in_flight_end: float | None = None
    greedy_checked: int = 0
    #: sampled greedy requests whose output differs: where, and whether it is a near-tie flip
    greedy_single_mismatches: list[Divergence] = field(default_factory=list)
    greedy_replay_mismatches: list[Divergence] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    #: the proxy's records (prefill / decode TTFT / KV transfer split) of the slowest requests
    slowest: list[dict[str, Any]] = field(default_factory=list)
    log_dir: str = ""

    # ---- summaries
    def count(self, status: str) -> int:
        return sum(1 for o in self.outcomes if o.status == status)

    @property
    def aborted(self) -> int:
        return sum(1 for o in self.outcomes if o.aborted)

    @property
    def failed(self) -> list[RequestOutcome]:
        return [o for o in self.outcomes if o.status == "failed"]

    @property
    def abort_missed(self) -> int:
        """Planned early aborts whose request finished before the delay ran out."""
        return sum(1 for o in self.outcomes if o.planned_abort and not o.aborted)

    def latency(self, which: str) -> dict[str, float | None]:
        values = sorted(getattr(o, which) for o in self.outcomes
                        if o.status == "ok" and getattr(o, which) is not None)
        return {"n": len(values), "p50": percentile(values, 50), "p99": percentile(values, 99)}

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "model": self.model,
            "config": self.config,
            "requests": len(self.outcomes),
            "completed_ok": self.count("ok"),
            "aborted": self.aborted,
            "aborted_before_first_token": self.count("aborted_before_first_token"),
            "aborted_mid_stream": self.count("aborted_mid_stream"),
            "planned_aborts_that_finished_first": self.abort_missed,
            "failed": len(self.failed),
            "failures": [asdict(o) | {"text": None, "tokens": None, "top": None}
                         for o in self.failed[:20]],
            "latency_s": self.latency("latency_s"),
            "ttft_s": self.latency("ttft_s"),
            "startup_s": self.startup_s,
            "run_s": self.run_s,
            "settle_s": self.settle_s,
            "baseline": {k: asdict(v) for k, v in self.baseline.items()},
            "end": {k: asdict(v) for k, v in self.end.items()},
            "end_unprobed": {k: asdict(v) for k, v in self.end_unprobed.items()},
            "trees_before": {k: asdict(v) for k, v in self.trees_before.items()},
            "trees_after": {k: asdict(v) for k, v in self.trees_after.items()},
            "timeline": self.timeline,
            "transfer_failures_by_reason": self.failures_by_reason,
            "fallbacks_by_reason": self.fallbacks_by_reason,
            "proxy_in_flight_end": self.proxy_in_flight_end,
            "greedy_checked": self.greedy_checked,
            "greedy_single_engine_mismatches": [asdict(d) for d in self.greedy_single_mismatches],
            "greedy_replay_mismatches": [asdict(d) for d in self.greedy_replay_mismatches],
            "checks": [asdict(c) for c in self.checks],
            "slowest": self.slowest,
            "per_request": [
                {k: getattr(o, k) for k in ("index", "status", "prompt_tokens", "max_tokens",
                                            "stream", "greedy", "planned_abort", "latency_s",
                                            "ttft_s", "abort_delay_s", "error")}
                for o in self.outcomes],
            "log_dir": self.log_dir,
        }


def _mib(n: float) -> str:
    return f"{n / MiB:g} MiB"


def percentile(sorted_values: list[float], q: float) -> float | None:
    """Nearest-rank percentile of an ascending list (None when empty)."""
    if not sorted_values:
        return None
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return sorted_values[min(rank, len(sorted_values)) - 1]


# ------------------------------------------------------------------------------ the stack
@dataclass
class SoakStack:
    prefill: ManagedProcess
    decode: ManagedProcess
    proxy: ManagedProcess
    prefill_side_port: int

    def engines(self) -> dict[str, ManagedProcess]:
        return {"prefill": self.prefill, "decode": self.decode}

    def pool_status(self) -> Any:
        from turbowire.connector.sidechannel.client import SideChannelClient

        client = SideChannelClient("127.0.0.1", self.prefill_side_port, None, timeout=10)
        try:
            return client.pool_status()
        finally:
            client.close()


def staging_bytes_for(model: Path, preset: str, block_size: int, slots: int) -> int:
    """A staging pool of exactly ``slots`` slots for this model (all layers, one block each)."""
    from turbowire.codec import Codec
    from turbowire.connector.geometry import KVGeometry, LayerSpec, StagingLayout

    cfg = json.loads((model / "config.json").read_text())
    layers = int(cfg["num_hidden_layers"])
    kv_heads = int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    geo = KVGeometry(tuple(LayerSpec(f"l.{i}", kv_heads, head_dim) for i in range(layers)),
                     block_size, "bfloat16")
    one = StagingLayout.build(geo, Codec(preset, head_dim, layers).encoded_nbytes, 1 << 30)
    return one.slot_bytes * slots


def start_soak_stack(model: Path, cfg: SoakConfig, log_dir: Path,
                     group: ProcessGroup) -> SoakStack:
    common = dict(kvcache_gib=cfg.kvcache_gib, block_size=cfg.block_size,
                  max_model_len=cfg.max_model_len, max_num_seqs=cfg.max_num_seqs,
                  max_num_batched_tokens=cfg.max_num_batched_tokens,
                  served_model_name=cfg.served_model_name)
    extra = dict(preset=cfg.preset, lease_seconds=cfg.lease_seconds,
                 staging_bytes=staging_bytes_for(model, cfg.preset, cfg.block_size,
                                                 cfg.staging_slots))
    p = group.add(start_engine(EngineSpec(
        "prefill", model, free_port(), cpu=0,
        kv_transfer_config=turbowire_kv_config(side_channel_port=free_port(), **extra),
        env=dict(cfg.engine_env), **common), log_dir))
    d = group.add(start_engine(EngineSpec(
        "decode", model, free_port(), cpu=1,
        kv_transfer_config=turbowire_kv_config(side_channel_port=free_port(), **extra),
        env=dict(cfg.engine_env), **common), log_dir))
    p.wait_healthy(cfg.startup_timeout_s)
    d.wait_healthy(cfg.startup_timeout_s)
    # the soak reads records and load reports, which the proxy hides by default
    x = group.add(start_proxy([p.url], [d.url], free_port(), log_dir, ["--expose-internals"]))
    x.wait_healthy(120)
    assert p.spec is not None and p.spec.side_channel_port is not None  # moved on a port clash
    return SoakStack(p, d, x, p.spec.side_channel_port)


def _complete(url: str, model: str, prompt: list[int], max_tokens: int,
              timeout: float = 300) -> str:
    return _greedy(url, model, prompt, max_tokens, timeout, logprobs=False).text


def _greedy(url: str, model: str, prompt: list[int], max_tokens: int, timeout: float = 300,
            logprobs: bool = True) -> RequestOutcome:
    """One greedy non-streamed completion (with the top logprobs of every position)."""
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                            "temperature": 0.0, "ignore_eos": True}
    if logprobs:
        body["logprobs"] = TOP_LOGPROBS
    r = httpx.post(url + "/v1/completions", timeout=timeout, json=body)
    r.raise_for_status()
    choice = r.json()["choices"][0]
    out = RequestOutcome(-1, len(prompt), max_tokens, False, True, None, status="ok",
                         text=choice.get("text") or "")
    _take_logprobs(out, choice)
    return out


#: A greedy divergence is a near-tie flip when, at the first differing position, each run's
#: choice is among the other run's top tokens and neither run prefers its own choice over the
#: other's by more than this many nats: the size of the logit noise that a different batch
#: composition (another GEMM blocking, another reduction order in bf16) causes. Corrupted KV
#: (a slot read while another request's chunks sit in it) changes the distribution, not just
#: the order of a near tie.
TIE_MARGIN_NATS = 0.5
#: Logprobs asked per position (vLLM's default cap is 20). Two are not enough: where three or
#: more tokens tie within a hundredth of a nat (a random tiny model's near-flat distributions
#: do), the token one run chose can be third in the other's list, and a flip of a near tie
#: looked like corruption (seen: 'subject' -6.708 vs 'example' -6.728, the other run
#: 'example' -6.721, '__mul__' -6.725).
TOP_LOGPROBS = 20


@dataclass
class Divergence:
    index: int
    position: int | None  # first differing token (None: same tokens, different text)
    tie_flip: bool
    margin_load: float | None = None
    margin_other: float | None = None
    load_token: str | None = None
    other_token: str | None = None
    top_load: dict[str, float] | None = None  # each run's top logprobs at ``position``
    top_other: dict[str, float] | None = None


def divergence(index: int, load: RequestOutcome, other: RequestOutcome) -> Divergence | None:
    """How two greedy outputs of the same request differ (None: they do not)."""
    if load.text == other.text and load.tokens == other.tokens:
        return None
    pos = next((i for i, (a, b) in enumerate(zip(load.tokens, other.tokens, strict=False))
                if a != b), None)
    if pos is None:
        return Divergence(index, None, False)
    a, b = load.tokens[pos], other.tokens[pos]
    top_a = load.top[pos] if pos < len(load.top) else {}
    top_b = other.top[pos] if pos < len(other.top) else {}
    flip = a in top_a and b in top_a and a in top_b and b in top_b
    m_a = top_a[a] - top_a[b] if flip else None
    m_b = top_b[b] - top_b[a] if flip else None
    flip = flip and max(m_a, m_b) <= TIE_MARGIN_NATS  # type: ignore[type-var]
    return Divergence(index, pos, flip, m_a, m_b, a, b, dict(top_a), dict(top_b))


def read_engines(stack: SoakStack, with_pool: bool = True) -> dict[str, EngineReading]:
    out = {}
    for name, proc in stack.engines().items():
        m = scrape_metrics(proc.url)
        out[name] = EngineReading(metric_sum(m, STAGING_GAUGE), metric_sum(m, LEASES_GAUGE),
                                  metric_sum(m, KV_USAGE_GAUGE))
    if with_pool:
        status = stack.pool_status()
        out["prefill"].pool_used_slots = int(status.used_slots)
        out["prefill"].pool_leases = int(status.leases)
    return out


def probe_engines(stack: SoakStack, model: str, token: int) -> None:
    """One 1-token request straight to each engine (no KV transfer): vLLM publishes gauges
    (its own and the connector's) only from engine steps, so an idle engine shows the values of
    its last step; this makes each engine step once."""
    for proc in stack.engines().values():
        _complete(proc.url, model, [token] * 3, 1)


def read_probed(stack: SoakStack, model: str, token: int, timeout: float = 15.0,
                ) -> dict[str, EngineReading]:
    """Readings after a probe step of each engine, probed again (up to ``timeout``) while the
    prefill engine's exported gauges still differ from its pool's own answer: the probe's HTTP
    answer can leave before the frontend has recorded that step's stats, so one scrape may
    still show the step before. A gauge that never catches up stays visible in the result."""
    deadline = time.monotonic() + timeout
    while True:
        probe_engines(stack, model, token)
        readings = read_engines(stack)
        p = readings["prefill"]
        caught_up = (p.leases == p.pool_leases
                     and (p.staging_bytes == 0) == (p.pool_used_slots == 0))
        if caught_up or time.monotonic() > deadline:
            return readings
        time.sleep(0.5)


def settle(stack: SoakStack, lease_seconds: float) -> float:
    """Wait (up to ``lease_seconds`` + margin) for the prefill engine's staging pool to empty:
    aborted requests whose KV the decode engine never read hold leases until they expire."""
    t0 = time.monotonic()
    deadline = t0 + lease_seconds + 5.0
    while True:
        status = stack.pool_status()
        if (status.used_slots == 0 and status.leases == 0) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    time.sleep(1.0)  # in-flight frees (aborts, finished steps) and the stats interval
    return time.monotonic() - t0


def sample_trees(stack: SoakStack) -> dict[str, TreeSample]:
    return {name: sample_tree(proc.popen.pid)
            for name, proc in (("prefill", stack.prefill), ("decode", stack.decode),
                               ("proxy", stack.proxy))}


# ------------------------------------------------------------------------------ the run
ProgressFn = Callable[[str, int, int], None]


def run_soak(
    cfg: SoakConfig, *, model: Path, log_dir: Path,
    on_progress: ProgressFn = lambda phase, done, total: None,
    on_message: Callable[[str], None] = lambda msg: None,
) -> SoakReport:
    """Start the engines and the proxy (under the engine lock), run the soak, stop everything."""
    low, high = token_id_range(model)
    plans = make_plans(cfg, (low, high))
    report = SoakReport(config=asdict(cfg), model=str(model), log_dir=str(log_dir))
    report.config["max_prompt_tokens"] = cfg.max_prompt_tokens
    name = cfg.served_model_name
    with engine_lock(), ProcessGroup() as group:
        t0 = time.monotonic()
        on_message(f"starting prefill (core 0) and decode (core 1) engines, preset {cfg.preset}, "
                   f"lease {cfg.lease_seconds:g} s, staging {cfg.staging_slots} slots")
        stack = start_soak_stack(model, cfg, log_dir, group)
        _complete(stack.proxy.url, name, [low + 1] * 7, 2)  # handshake + NIXL connection
        report.startup_s = time.monotonic() - t0
        on_message(f"engines and proxy up in {report.startup_s:.0f} s")
        time.sleep(1.0)
        report.baseline = read_probed(stack, name, low)
        done = [0]

        every = max(1, (cfg.requests - cfg.warmup) // 10)

        def tick(_out: RequestOutcome) -> None:
            done[0] += 1
            on_progress("requests", done[0], cfg.requests)
            if done[0] > cfg.warmup and (done[0] - cfg.warmup) % every == 0:
                with contextlib.suppress(Exception):  # a sample is only a diagnostic
                    trees = sample_trees(stack)
                    report.timeline.append({"done": done[0], **{
                        k: {"rss_bytes": t.rss_bytes, "fds": t.fds, "threads": t.threads}
                        for k, t in trees.items()}})

        scale = TtftScale(cfg.early_abort_default_s)
        t_run = time.monotonic()
        warm, rest = plans[: cfg.warmup], plans[cfg.warmup:]
        if warm:
            on_message(f"warm-up: {len(warm)} requests")
            report.outcomes += asyncio.run(run_batch(
                stack.proxy.url, name, warm, cfg.concurrency, cfg.request_timeout_s, scale, tick))
            settle(stack, cfg.lease_seconds)
        report.trees_before = sample_trees(stack)
        on_message(f"soak: {len(rest)} requests at concurrency {cfg.concurrency}")
        report.outcomes += asyncio.run(run_batch(
            stack.proxy.url, name, rest, cfg.concurrency, cfg.request_timeout_s, scale, tick))
        report.run_s = time.monotonic() - t_run
        on_message("waiting for the staging pool to empty (unread leases expire)")
        report.settle_s = settle(stack, cfg.lease_seconds)
        report.end_unprobed = read_engines(stack)
        report.trees_after = sample_trees(stack)
        report.end = read_probed(stack, name, low)
        px = scrape_metrics(stack.proxy.url)
        report.proxy_in_flight_end = metric_sum(px, PROXY_IN_FLIGHT)
        for eng, proc in stack.engines().items():
            m = scrape_metrics(proc.url)
            report.failures_by_reason[eng] = metric_by_label(
                m, "turbowire_kv_transfer_failures_total", "reason")
            report.fallbacks_by_reason[eng] = metric_by_label(
                m, "turbowire_kv_fallbacks_total", "reason")
        report.slowest = _slowest_records(stack, report.outcomes)
        _greedy_checks(report, plans, stack, cfg, on_message)
    evaluate(report, cfg)
    return report


def _slowest_records(stack: SoakStack, outcomes: list[RequestOutcome],
                     n: int = 5) -> list[dict[str, Any]]:
    done = sorted((o for o in outcomes if o.status == "ok" and o.latency_s is not None),
                  key=lambda o: -(o.latency_s or 0.0))[:n]
    out = []
    for o in done:
        rec: dict[str, Any] = {"index": o.index, "latency_s": o.latency_s,
                               "prompt_tokens": o.prompt_tokens, "max_tokens": o.max_tokens}
        with contextlib.suppress(httpx.HTTPError, ValueError):
            r = httpx.get(f"{stack.proxy.url}/turbowire/requests/soak-{o.index}", timeout=10)
            if r.status_code == 200:
                full = r.json()
                rec.update({k: full.get(k) for k in (
                    "prefill_seconds", "decode_ttft_seconds", "ttft_seconds", "total_seconds",
                    "decode_report", "outcome")})
        out.append(rec)
    return out


def _greedy_checks(report: SoakReport, plans: list[RequestPlan], stack: SoakStack,
                   cfg: SoakConfig, on_message: Callable[[str], None]) -> None:
    ok = [o for o in report.outcomes if o.status == "ok" and o.greedy]
    rng = random.Random(cfg.seed + 1)
    sample = sorted(rng.sample(ok, min(cfg.greedy_check_samples, len(ok))), key=lambda o: o.index)
    if not sample:
        return
    on_message(f"greedy check: {len(sample)} requests vs the prefill engine alone and a replay")
    by_index = {p.index: p for p in plans}
    for o in sample:
        plan = by_index[o.index]
        single = _greedy(stack.prefill.url, cfg.served_model_name, plan.prompt, plan.max_tokens)
        replay = _greedy(stack.proxy.url, cfg.served_model_name, plan.prompt, plan.max_tokens)
        if (d := divergence(o.index, o, single)) is not None:
            report.greedy_single_mismatches.append(d)
        if (d := divergence(o.index, o, replay)) is not None:
            report.greedy_replay_mismatches.append(d)
    report.greedy_checked = len(sample)


def evaluate(report: SoakReport, cfg: SoakConfig) -> list[Check]:
    """Fill ``report.checks`` from the measurements and the bounds."""
    b = cfg.bounds
    checks = [Check("failed requests (non-aborted)", len(report.failed), 0,
                    not report.failed)]
    p_end = report.end.get("prefill")
    if p_end is not None:
        checks.append(Check(
            "prefill staging bytes at end (gauge)", p_end.staging_bytes,
            b.max_staging_bytes_end, p_end.staging_bytes <= b.max_staging_bytes_end))
        checks.append(Check("prefill leases outstanding at end (gauge)", p_end.leases, 0,
                            p_end.leases == 0))
        raw = report.end_unprobed.get("prefill")
        if raw is not None:
            checks.append(Check(
                "prefill staging bytes gauge while idle, before a probe step", raw.staging_bytes,
                0, True,
                "informational: gauges reach /metrics only when the engine steps"))
        if p_end.pool_used_slots is not None:
            checks.append(Check("prefill staging slots used at end (side channel)",
                                p_end.pool_used_slots, 0, p_end.pool_used_slots == 0))
    for eng in ("prefill", "decode"):
        if eng in report.end and eng in report.baseline:
            delta = report.end[eng].kv_usage - report.baseline[eng].kv_usage
            checks.append(Check(f"{eng} KV usage minus baseline", delta, b.max_kv_usage_delta,
                                abs(delta) <= b.max_kv_usage_delta + 1e-12))
    measured = max(0, len(report.outcomes) - cfg.warmup)
    rss_bound = b.max_rss_growth_bytes + b.max_rss_growth_per_request * measured
    for eng in ("prefill", "decode"):
        before, after = report.trees_before.get(eng), report.trees_after.get(eng)
        if before is None or after is None:
            continue
        checks += [
            Check(f"{eng} tree open fds growth", after.fds - before.fds, b.max_fd_growth,
                  after.fds - before.fds <= b.max_fd_growth),
            Check(f"{eng} tree threads growth", after.threads - before.threads,
                  b.max_thread_growth, after.threads - before.threads <= b.max_thread_growth),
            Check(f"{eng} tree RSS growth (bytes)", after.rss_bytes - before.rss_bytes,
                  rss_bound, after.rss_bytes - before.rss_bytes <= rss_bound,
                  f"{_mib(b.max_rss_growth_bytes)} + {b.max_rss_growth_per_request // 1024} KiB"
                  f" x {measured} requests"),
            Check(f"{eng} tree processes growth", after.processes - before.processes, 0,
                  after.processes <= before.processes),
        ]
    if report.greedy_checked:
        lossless = cfg.preset in LOSSLESS_PRESETS
        for what, found in (("prefill engine alone", report.greedy_single_mismatches),
                            ("same request replayed alone", report.greedy_replay_mismatches)):
            flips = sum(1 for d in found if d.tie_flip)
            other = len(found) - flips
            binding = lossless or what.startswith("same")
            shown = "; ".join(
                f"request {d.index} at token {d.position}: {d.load_token!r} vs {d.other_token!r}"
                f" (top {d.top_load} vs {d.top_other})" for d in found if not d.tie_flip)
            checks.append(Check(
                f"greedy outputs != {what}, not a near-tie flip", other, 0,
                other == 0 or not binding,
                ("" if binding else f"informational: preset {cfg.preset} is lossy; ") + shown))
            checks.append(Check(
                f"greedy outputs != {what}, near-tie flips", flips, len(found), True,
                f"informational: near ties swapped, margin <= {TIE_MARGIN_NATS} nats"))
    report.checks = checks
    return checks
