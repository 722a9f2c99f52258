"""``turbowire bench multiround``: LMCache's multi-round QA workload, for the store path.

Users share one long system prompt; each has a conversation of ``rounds`` rounds, and each round's
prompt is the whole history so far plus a new question (the answer is appended to the history
for the next round). Per round all users ask at once; TTFT is measured client side (streaming,
through the proxy). It runs on the e2e benchmark's stack (:mod:`turbowire.bench_e2e.engines`)
once per configuration, e.g. turbowire P/D alone (``tw:tq4``) and turbowire with the store
(``tw:tq4+store``: ``transport: both``, a redis-server on the link's root-side address so the
decode engine in its namespace reaches it, and a proxy with ``--directory`` that sends a prompt
whose every full chunk is stored straight to the decode engine).

Cache modes: ``evict`` resets both engines' prefix caches before every round, as a busy engine
whose cache turned over between a user's turns (the case the store is for: LMCache's benchmark
gets there with many users on a GPU); ``keep`` resets them only at the start, so the prefill
engine's own prefix cache serves what it can. Each mode uses its own system prompt and
questions, so modes never hit each other's stored chunks.

Prompts and answers are token ids (``return_token_ids``), so a history is exactly the tokens the
engines saw and stored, with no re-tokenization at the seams.
"""

from __future__ import annotations

import asyncio
import csv
import json
import logging
import random
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import httpx

from turbowire.bench_e2e.client import stream_completion
from turbowire.bench_e2e.engines import ConnectorConfig, EngineSettings, EngineStartError
from turbowire.bench_e2e.link import EmulatedLink
from turbowire.bench_e2e.model import BenchModelSpec, ensure_bench_model, vocab_size_of
from turbowire.bench_e2e.results import rate_label
from turbowire.bench_e2e.run import machine_info, scan_logs
from turbowire.bench_e2e.serve import (
    Progress,
    ServePair,
    bullets,
    load1,
    para,
    reset_prefix_caches,
    text_table,
    warm_up,
)
from turbowire.serving.launch import free_port, start_proxy

logger = logging.getLogger(__name__)

CACHE_MODES = ("evict", "keep")
STORE_NAMESPACE = "bench-mr"
SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
PROMPT_SOURCES = "vllm:prompt_tokens_by_source_total"


@dataclass(frozen=True)
class StackConfig:
    """A connector config, with or without the store (``tw:<preset>+store``)."""

    conn: ConnectorConfig
    store: bool = False

    def __post_init__(self) -> None:
        if self.store and self.conn.kind != "turbowire":
            raise ValueError("the store is turbowire's: '+store' needs 'tw:<preset>'")

    @property
    def label(self) -> str:
        return self.conn.label + ("+store" if self.store else "")

    @classmethod
    def parse(cls, spec: str) -> StackConfig:
        """``nixl``, ``tw:<preset>`` or ``tw:<preset>+store``."""
        base, plus, rest = spec.partition("+")
        if plus and rest != "store":
            raise ValueError(f"config {spec!r}: the only suffix is '+store'")
        return cls(ConnectorConfig.parse(base), store=bool(plus))

    def connector(self, store_url: str | None) -> ConnectorConfig:
        """The engines' connector config (the store keys added when ``store``)."""
        if not self.store:
            return self.conn
        if not store_url:
            raise ValueError("a store config needs the store's URL")
        extra = {**self.conn.extra, "transport": "both", "store_url": store_url,
                 "store_namespace": STORE_NAMESPACE, "store_local_cpu_bytes": "512MiB"}
        return ConnectorConfig(self.label, "turbowire", preset=self.conn.preset, extra=extra)


@dataclass(frozen=True)
class MultiroundPlan:
    """What ``turbowire bench multiround`` runs."""

    configs: tuple[StackConfig, ...]
    link: float | None = None  # Gbit/s; None = unshaped
    users: int = 4
    rounds: int = 6
    system_tokens: int = 1536
    question_tokens: int = 96
    answer_tokens: int = 64
    cache_modes: tuple[str, ...] = ("evict",)
    seed: int = 0
    request_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if not self.configs:
            raise ValueError("configs must name at least one config (e.g. 'tw:tq4+store')")
        if len({c.label for c in self.configs}) != len(self.configs):
            raise ValueError("configs must not repeat")
        if self.link is not None and self.link <= 0:
            raise ValueError(f"the link rate must be > 0 Gbit/s or None, got {self.link}")
        if min(self.users, self.rounds, self.question_tokens, self.answer_tokens) < 1:
            raise ValueError("users, rounds, question_tokens and answer_tokens must be >= 1")
        if self.system_tokens < 0:
            raise ValueError("system_tokens must be >= 0")
        bad = [m for m in self.cache_modes if m not in CACHE_MODES]
        if bad or not self.cache_modes or len(set(self.cache_modes)) != len(self.cache_modes):
            raise ValueError(f"cache modes must be among {CACHE_MODES}, got "
                             f"{list(self.cache_modes)}")

    def prompt_tokens(self, round_: int) -> int:
        """Prompt length of round ``round_`` (0-based): system + earlier rounds + question."""
        return (self.system_tokens + round_ * (self.question_tokens + self.answer_tokens)
                + self.question_tokens)

    def max_model_len(self) -> int:
        longest = self.prompt_tokens(self.rounds - 1) + self.answer_tokens + 64
        return max(2048, -(-longest // 32) * 32)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["configs"] = [c.label for c in self.configs]
        d["link"] = rate_label(self.link)
        return d


@dataclass(frozen=True)
class Workload:
    """Token ids of one cache mode's conversations: the shared system prompt and
    ``questions[user][round]``."""

    system: tuple[int, ...]
    questions: tuple[tuple[tuple[int, ...], ...], ...]


def build_workload(corpus_ids: Sequence[int], plan: MultiroundPlan, seed: int) -> Workload:
    """Cut the system prompt and every question from ``corpus_ids`` (the corpus, tokenized),
    deterministically for ``seed``; different seeds give different system prompts."""
    need = max(plan.system_tokens, plan.question_tokens)
    if len(corpus_ids) < 2 * need:
        raise ValueError(f"corpus of {len(corpus_ids)} tokens is too short for {need}-token cuts")
    rng = random.Random(seed)

    def cut(n: int) -> tuple[int, ...]:
        a = rng.randrange(0, len(corpus_ids) - n)
        return tuple(corpus_ids[a:a + n])

    system = cut(plan.system_tokens) if plan.system_tokens else ()
    questions = tuple(tuple(cut(plan.question_tokens) for _ in range(plan.rounds))
                      for _ in range(plan.users))
    return Workload(system, questions)


@dataclass
class RoundRecord:
    """One user's request of one round (one CSV row)."""

    config: str
    cache: str
    round: int  # 1-based
    user: int
    prompt_tokens: int
    ok: bool
    ttft_s: float | None = None
    total_s: float | None = None
    route: str | None = None  # the proxy's: "pd" or "store_hit" (prefill skipped)
    stored_tokens: int | None = None  # leading tokens the directory listed as stored
    error: str | None = None


@dataclass
class RoundSources:
    """Where a round's prompt tokens came from on each engine (vLLM's counters, all users)."""

    config: str
    cache: str
    round: int
    prefill: dict[str, float] = field(default_factory=dict)  # source -> tokens
    decode: dict[str, float] = field(default_factory=dict)


RECORD_COLUMNS = tuple(f.name for f in fields(RoundRecord))


def prompt_sources(metrics_text: str) -> dict[str, float]:
    """``vllm:prompt_tokens_by_source_total`` by source, summed over engines' label sets."""
    from prometheus_client.parser import text_string_to_metric_families

    out = dict.fromkeys(SOURCES, 0.0)
    for fam in text_string_to_metric_families(metrics_text):
        for s in fam.samples:
            if s.name == PROMPT_SOURCES and s.labels.get("source") in out:
                out[s.labels["source"]] += float(s.value)
    return out


def _delta(after: Mapping[str, float], before: Mapping[str, float]) -> dict[str, float]:
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in SOURCES}


def median(values: Sequence[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def ttft_table(records: Sequence[RoundRecord], cache: str, configs: Sequence[str]) -> str:
    """TTFT p50 (ms, over users) per round, one column per config, and the ratio of the last
    config to the first when there are two."""
    rounds = sorted({r.round for r in records if r.cache == cache})
    header = ["round", "prompt tok", *configs]
    two = len(configs) == 2
    if two:
        header.append("ratio")
    body = []
    for rnd in rounds:
        rs = [r for r in records if r.cache == cache and r.round == rnd]
        row = [str(rnd), str(max(r.prompt_tokens for r in rs))]
        meds = [median([r.ttft_s for r in rs if r.config == c and r.ok]) for c in configs]
        row += ["-" if m is None else f"{m * 1e3:.0f}" for m in meds]
        if two:
            a, b = meds
            row.append(f"{b / a:.2f}" if a and b is not None else "-")
        body.append(row)
    return text_table(header, body, left=1)


def sources_table(sources: Sequence[RoundSources], records: Sequence[RoundRecord],
                  cache: str) -> str:
    """Per round and config: the prefill engine's prompt tokens computed, served by its own
    prefix cache and loaded by the connector (the store), and requests sent straight to the
    decode engine (route store_hit), all users together."""
    header = ["round", "config", "P computed", "P cached", "P loaded", "D loaded", "direct"]
    body = []
    for s in sorted((s for s in sources if s.cache == cache), key=lambda s: s.round):
        direct = sum(1 for r in records if r.cache == cache and r.round == s.round
                     and r.config == s.config and r.route == "store_hit")
        body.append([str(s.round), s.config,
                     f"{s.prefill.get('local_compute', 0):.0f}",
                     f"{s.prefill.get('local_cache_hit', 0):.0f}",
                     f"{s.prefill.get('external_kv_transfer', 0):.0f}",
                     f"{s.decode.get('external_kv_transfer', 0):.0f}", str(direct)])
    return text_table(header, body)


SOURCES_LEGEND = (
    "P computed, P cached, P loaded: the prefill engine's prompt tokens computed, served by its "
    "prefix cache, loaded by its connector (from the store); D loaded: the decode engine's "
    "prompt tokens loaded by its connector (from the prefill engine over NIXL, or from the "
    "store); direct: requests the proxy sent straight to the decode engine (every full chunk "
    "stored), skipping prefill.")

MODE_TEXT = {
    "evict": "prefix caches reset before every round",
    "keep": "prefix caches reset only before round 1",
}


@dataclass
class MultiroundOutput:
    plan: dict[str, Any]
    machine: dict[str, Any]
    model: dict[str, Any]
    command: str = ""  # the turbowire command line that ran it
    records: list[RoundRecord] = field(default_factory=list)
    sources: list[RoundSources] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    log_findings: dict[str, dict[str, int]] = field(default_factory=dict)
    load1_start: float | None = None
    load1_end: float | None = None
    wall_s: float = 0.0

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)


def render_markdown(out: MultiroundOutput, plan: MultiroundPlan) -> str:
    m = out.machine
    configs = [c.label for c in plan.configs]
    lines = ["## Multi-round QA through the P/D proxy", ""]
    if out.command:
        lines += ["```", out.command, "```", ""]
    lines += para(f"{plan.users} users, {plan.rounds} rounds, system prompt "
                  f"{plan.system_tokens} tokens (shared), question {plan.question_tokens}, "
                  f"answer {plan.answer_tokens} tokens; link {rate_label(plan.link)}. "
                  f"machine: {m.get('cpu')}, {m.get('cores')} cores, git {m.get('git')}; "
                  f"1-min load average {out.load1_start} at start, {out.load1_end} at end; "
                  f"wall {out.wall_s:.0f} s")
    for cache in plan.cache_modes:
        if not any(r.cache == cache for r in out.records):
            continue
        lines += [f"**TTFT p50 per round, ms, cache {cache} ({MODE_TEXT[cache]})**", ""]
        lines += [ttft_table(out.records, cache, configs), ""]
        if len(configs) == 2:
            lines += para(f"ratio: {configs[1]} / {configs[0]}")
        if any(s.cache == cache for s in out.sources):
            lines += [f"Prompt tokens by source, all users (cache {cache}):", ""]
            lines += [sources_table(out.sources, out.records, cache), ""]
            lines += para(SOURCES_LEGEND)
    failed = [r for r in out.records if not r.ok]
    if failed:
        lines += para(f"{len(failed)} requests failed; first: {failed[0].error}")
    if any(out.log_findings.values()):
        lines += para("Engine log findings (counts): " + json.dumps(out.log_findings))
    lines += bullets("Warnings", out.warnings) + bullets("Errors", out.errors)
    return "\n".join(lines)


def write_records_csv(records: Sequence[RoundRecord], path: Path) -> Path:
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=RECORD_COLUMNS)
        w.writeheader()
        for r in records:
            w.writerow({k: ("" if v is None else round(v, 4) if isinstance(v, float) else v)
                        for k, v in asdict(r).items()})
    return path


def write_outputs(out: MultiroundOutput, plan: MultiroundPlan, out_dir: Path) -> None:
    (out_dir / "results.json").write_text(out.to_json())
    write_records_csv(out.records, out_dir / "multiround.csv")
    (out_dir / "results.md").write_text(render_markdown(out, plan))


# ---------------------------------------------------------------------------------------------
# running


def _scrape(url: str) -> dict[str, float]:
    try:
        return prompt_sources(httpx.get(f"{url}/metrics", timeout=10.0).text)
    except httpx.HTTPError as exc:
        logger.warning("could not scrape %s: %s", url, exc)
        return {}


def _record_of(proxy_url: str, rid: str) -> dict[str, Any]:
    try:
        r = httpx.get(f"{proxy_url}/turbowire/requests/{rid}", timeout=10.0)
        return r.json() if r.status_code == 200 else {}
    except (httpx.HTTPError, ValueError):
        return {}


async def _round(proxy_url: str, prompts: Sequence[list[int]], answer_tokens: int,
                 timeout_s: float) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=64)) as client:
        return list(await asyncio.gather(*(
            stream_completion(client, proxy_url, p, answer_tokens, timeout_s=timeout_s)
            for p in prompts)))


def run_conversations(plan: MultiroundPlan, label: str, cache: str, workload: Workload,
                      proxy_url: str, engine_urls: tuple[str, str], out: MultiroundOutput,
                      on_progress: Progress) -> None:
    """All rounds of one cache mode on a running stack; appends records and sources."""
    histories = [list(workload.system) for _ in range(plan.users)]
    for rnd in range(plan.rounds):
        if rnd == 0 or cache == "evict":
            unreset = reset_prefix_caches(engine_urls)
            if unreset:
                out.warnings.append(f"{label} {cache} round {rnd + 1}: prefix cache not reset "
                                    f"on {', '.join(unreset)}")
        prompts = [h + list(workload.questions[u][rnd]) for u, h in enumerate(histories)]
        before = [_scrape(u) for u in engine_urls]
        res = asyncio.run(_round(proxy_url, prompts, plan.answer_tokens, plan.request_timeout_s))
        time.sleep(1.5)  # vLLM's API server publishes engine stats on an interval
        after = [_scrape(u) for u in engine_urls]
        out.sources.append(RoundSources(label, cache, rnd + 1, _delta(after[0], before[0]),
                                        _delta(after[1], before[1])))
        for u, (prompt, item) in enumerate(zip(prompts, res)):
            rec = _record_of(proxy_url, item["rid"])
            error = item["error"]
            if error is None and len(item["token_ids"]) != plan.answer_tokens:
                error = (f"answer has {len(item['token_ids'])} token ids, expected "
                         f"{plan.answer_tokens} (return_token_ids)")
            out.records.append(RoundRecord(
                config=label, cache=cache, round=rnd + 1, user=u, prompt_tokens=len(prompt),
                ok=error is None, ttft_s=item["ttft"], total_s=item["total"],
                route=rec.get("route"), stored_tokens=rec.get("stored_tokens"), error=error))
            # after a failure the conversation goes on with a stand-in answer (the question's
            # tokens, repeated), so later rounds keep their planned lengths
            q = workload.questions[u][rnd]
            answer = (item["token_ids"] if error is None
                      else [q[i % len(q)] for i in range(plan.answer_tokens)])
            histories[u] = prompt + list(answer)
        ttfts = [r.ttft_s for r in out.records[-plan.users:] if r.ok]
        med = median(ttfts)
        direct = sum(1 for r in out.records[-plan.users:] if r.route == "store_hit")
        on_progress(f"[{label}] cache {cache} round {rnd + 1}/{plan.rounds}: prompt "
                    f"{len(prompts[0])} tokens, TTFT p50 "
                    f"{'-' if med is None else f'{med * 1e3:.0f} ms'}, {direct} direct to D, "
                    f"{sum(1 for r in out.records[-plan.users:] if not r.ok)} failed")


def run_multiround(plan: MultiroundPlan, out_dir: Path, *,
                   on_progress: Progress = lambda m: None,
                   spec: BenchModelSpec | None = None, command: str = "") -> MultiroundOutput:
    """Run every config (the caller holds the engine lock and is root); writes
    ``multiround.csv``, ``results.md`` and ``results.json``."""
    from transformers import AutoTokenizer

    from turbowire.quality.corpus import load_corpus
    from turbowire.serving.redis_server import RedisServer

    spec = spec or BenchModelSpec()
    out_dir = out_dir.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    model = ensure_bench_model(spec)
    vocab = vocab_size_of(model)
    tok = AutoTokenizer.from_pretrained(str(model))
    corpus_ids = tok(load_corpus()).input_ids
    workloads = {mode: build_workload(corpus_ids, plan, seed=plan.seed * 1000 + i)
                 for i, mode in enumerate(plan.cache_modes)}
    settings = EngineSettings(model, max_model_len=plan.max_model_len())
    out = MultiroundOutput(plan=plan.to_dict(), machine=machine_info(),
                           model={"path": str(model), **asdict(spec),
                                  "kv_bytes_per_token": spec.kv_bytes_per_token},
                           command=command, load1_start=load1())
    t0 = time.monotonic()
    log_dir = out_dir / "logs"
    with EmulatedLink() as link:
        for sc in plan.configs:
            redis: RedisServer | None = None
            try:
                link.set_rate(None)
                store_url = None
                if sc.store:
                    # on the link's root-side address too: the decode engine in its namespace
                    # reaches the store over the link, as a remote store
                    addr = link.config.root_addr
                    redis = RedisServer(extra_args=("--bind", "127.0.0.1", addr,
                                                    "--protected-mode", "no")).start()
                    store_url = f"redis://{addr}:{redis.port}"
                    on_progress(f"[{sc.label}] redis-server on {store_url}")
                conn = sc.connector(store_url)
                events = log_dir / f"{conn.label}-events.jsonl"
                events.unlink(missing_ok=True)
                on_progress(f"[{sc.label}] starting prefill + decode engines and the proxy")
                t_up = time.monotonic()
                with ServePair(link, conn, settings, log_dir, events) as pair:
                    proxy_url = pair.proxy_url
                    if store_url:
                        # a second proxy in front of the same engines, cache-aware
                        proxy = pair.group.add(start_proxy(
                            [pair.prefill_url], [pair.decode_url], free_port(), log_dir,
                            ["--expose-internals", "--directory", store_url,
                             "--store-namespace", STORE_NAMESPACE]))
                        proxy.wait_healthy(60.0)
                        proxy_url = proxy.url
                    on_progress(f"[{sc.label}] up in {time.monotonic() - t_up:.0f} s; "
                                "warming up")
                    warm_up(proxy_url, vocab, plan.users)
                    link.set_rate(plan.link)
                    for cache in plan.cache_modes:
                        run_conversations(plan, sc.label, cache, workloads[cache], proxy_url,
                                          (pair.prefill_url, pair.decode_url), out, on_progress)
                        write_outputs(out, plan, out_dir)
            except EngineStartError as exc:
                out.errors.append(f"{sc.label}: {exc.summary()}")
                on_progress(f"[{sc.label}] {exc.summary()}")
            except Exception as exc:  # one broken config must not lose the others' results
                logger.exception("config %s failed", sc.label)
                out.errors.append(f"{sc.label}: {type(exc).__name__}: {str(exc)[:1000]}")
                on_progress(f"[{sc.label}] failed: {type(exc).__name__}: {exc}")
            finally:
                if redis is not None:
                    redis.cleanup()
            out.log_findings[sc.label] = scan_logs(log_dir, sc.label)
            write_outputs(out, plan, out_dir)
        link.set_rate(None)
    out.wall_s = time.monotonic() - t0
    out.load1_end = load1()
    write_outputs(out, plan, out_dir)
    return out
