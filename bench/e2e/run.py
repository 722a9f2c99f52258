"""The end-to-end benchmark driver: engines per connector config, link-rate sweep, tables, plot.

For each connector configuration one prefill/decode engine pair and turbowire's proxy are started
once (an engine takes ~40 s to start on 2 cores); the link rate is then changed under the running
engines with ``tc qdisc replace``. Per (rate, prompt length, concurrency) cell, requests go through
the proxy (streaming); the driver records client TTFT, the proxy's per-request record, the
connectors' timestamps (:mod:`turbowire.bench_e2e.timed`), veth byte counters and the engines'
``/metrics`` deltas.

Prefill modes:

- ``primed`` (default): each prompt length has a base prompt that is prefilled once on the prefill
  engine (prefix caching on P only); each measured prompt is the base prompt with a unique tail of
  ``tail_tokens`` tokens, so P computes only the tail, while the decode engine (no prefix caching)
  still receives the KV of the whole prompt. Handoff and decode-request times are those of a cold
  prompt (the KV is complete and handed over the same way); TTFT excludes the prefill compute of
  the shared part, which is reported separately (``prefill_cold_s``). This keeps a matrix with 8k
  prompts affordable on 2 CPU cores (a cold 8k prefill of this model takes about a minute). For
  turbowire it also means the prefill engine encodes all blocks in one step (no overlap with
  prefill compute): the pessimistic case for it.
- ``fresh``: every prompt is unique and fully prefilled (TTFT = real cold TTFT; turbowire's encode
  overlaps the prefill layer by layer).
"""

from __future__ import annotations

import asyncio
import json
import logging
import platform
import re
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from turbowire.bench_e2e.client import stream_completion
from turbowire.bench_e2e.engines import (
    ConnectorConfig,
    EnginePair,
    EngineSettings,
    EngineStartError,
)
from turbowire.bench_e2e.events import read_events
from turbowire.bench_e2e.link import EmulatedLink
from turbowire.bench_e2e.model import BenchModelSpec, ensure_bench_model, make_prompt, vocab_size_of
from turbowire.bench_e2e.results import (
    CellResult,
    RequestResult,
    add_ratios,
    breakdown_table,
    handoff_times,
    markdown_table,
    match_events,
    prom_sum,
    rate_label,
    summarize,
)
from turbowire.errors import TurboWireError

logger = logging.getLogger(__name__)

MODES = ("primed", "fresh")

# Connector metrics whose per-cell deltas explain where the time goes (name -> breakdown key).
# Histograms contribute their _sum (seconds) and counters their value.
PREFILL_METRICS = {
    "turbowire_kv_encode_duration_seconds_sum": "P encode s",
}
DECODE_METRICS = {
    "vllm:nixl_xfer_time_seconds_sum": "D nixl xfer s",
    "turbowire_kv_transfer_duration_seconds_sum": "D transfer s",
    "turbowire_kv_decode_duration_seconds_sum": "D decode s",
    "turbowire_kv_handshake_duration_seconds_sum": "D handshake s",
}
CONNECTOR_BYTES = ("vllm:nixl_bytes_transferred_sum", "turbowire_kv_wire_bytes_total")


class BenchError(TurboWireError, RuntimeError):
    """The benchmark could not run (bad plan, engines down)."""


@dataclass(frozen=True)
class BenchPlan:
    """What to measure. ``reduced()`` is ``make bench-e2e``'s default, ``full()`` the whole
    matrix."""

    configs: tuple[ConnectorConfig, ...]
    rates: tuple[float | None, ...] = (0.2, 1.0, 10.0, None)
    lengths: tuple[int, ...] = (2000,)
    concurrencies: tuple[int, ...] = (1, 4)
    sequential_requests: int = 3  # requests per cell at concurrency 1 (one after the other)
    waves: int = 1  # at concurrency c > 1: waves of c simultaneous requests
    max_tokens: int = 4
    warmup_requests: int = 2
    mode: str = "primed"
    tail_tokens: int = 64
    request_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if not self.configs:
            raise ValueError("configs must name at least one connector config (e.g. 'nixl')")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if any(r is not None and r <= 0 for r in self.rates):
            raise ValueError(f"link rates must be > 0 Gbit/s or None (unshaped), got {self.rates}")
        if any(n < 2 * self.tail_tokens for n in self.lengths):
            raise ValueError(f"prompt lengths must be >= 2 * tail_tokens ({2 * self.tail_tokens})")
        if any(c < 1 for c in self.concurrencies) or self.sequential_requests < 1 or self.waves < 1:
            raise ValueError("concurrencies, sequential_requests and waves must be >= 1")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")

    @staticmethod
    def default_configs(presets: list[str] | None = None) -> tuple[ConnectorConfig, ...]:
        out = [ConnectorConfig.parse("nixl"), ConnectorConfig.parse("tw:raw")]
        out += [ConnectorConfig.parse(f"tw:{p}") for p in (presets or ["tq4"])]
        return tuple(out)

    @classmethod
    def reduced(cls, configs: tuple[ConnectorConfig, ...], **kw: Any) -> "BenchPlan":
        return cls(configs=configs, **kw)

    @classmethod
    def full(cls, configs: tuple[ConnectorConfig, ...], **kw: Any) -> "BenchPlan":
        kw.setdefault("lengths", (1000, 2000, 4000, 8000))
        kw.setdefault("sequential_requests", 2)
        return cls(configs=configs, **kw)

    def cell_count(self) -> int:
        return len(self.configs) * len(self.rates) * len(self.lengths) * len(self.concurrencies)


@dataclass
class BenchOutput:
    plan: dict[str, Any]
    machine: dict[str, Any]
    model: dict[str, Any]
    link_measured_gbit: dict[str, dict[str, float]] = field(default_factory=dict)
    prefill_cold_s: dict[str, dict[str, float]] = field(default_factory=dict)
    cells: list[CellResult] = field(default_factory=list)
    requests: list[RequestResult] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    log_findings: dict[str, dict[str, int]] = field(default_factory=dict)
    started: float = field(default_factory=time.time)
    wall_s: float = 0.0

    def to_json(self) -> str:
        d = {k: v for k, v in asdict(self).items() if k not in ("cells", "requests")}
        d["cells"] = [c.to_dict() for c in self.cells]
        d["requests"] = [asdict(r) for r in self.requests]
        return json.dumps(d, indent=1)


# ---------------------------------------------------------------------------------------------
# client side


async def _run_batch(proxy_url: str, prompts: list[list[int]], concurrent: bool, max_tokens: int,
                     timeout_s: float) -> list[dict[str, Any]]:
    limits = httpx.Limits(max_connections=16)
    async with httpx.AsyncClient(limits=limits, timeout=timeout_s) as client:
        if concurrent:
            return list(await asyncio.gather(*(
                stream_completion(client, proxy_url, p, max_tokens, timeout_s=timeout_s)
                for p in prompts)))
        out = []
        for p in prompts:
            out.append(await stream_completion(client, proxy_url, p, max_tokens,
                                               timeout_s=timeout_s))
        return out


def _proxy_record(proxy_url: str, rid: str) -> dict[str, Any]:
    try:
        r = httpx.get(f"{proxy_url}/turbowire/requests/{rid}", timeout=10.0)
        return r.json() if r.status_code == 200 else {}
    except httpx.HTTPError:
        return {}


def _direct_prefill(url: str, prompt: list[int], timeout_s: float) -> float:
    """One prefill on the prefill engine alone (no transfer): primes its prefix cache."""
    t0 = time.perf_counter()
    r = httpx.post(f"{url}/v1/completions", json={"model": "bench", "prompt": prompt,
                                                   "max_tokens": 1, "temperature": 0.0},
                   timeout=timeout_s)
    if r.status_code != 200:
        raise BenchError(f"priming prefill failed: http {r.status_code}: {r.text[:300]}")
    return time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------
# the sweep


class PromptFactory:
    """Deterministic prompts: the same sequence for every connector config (fair comparison)."""

    def __init__(self, plan: BenchPlan, vocab: int) -> None:
        self.plan = plan
        self.vocab = vocab
        self.counter = 0
        self.bases = {n: make_prompt(n, vocab, seed=n) for n in plan.lengths}

    def reset(self) -> None:
        self.counter = 0

    def next(self, length: int) -> list[int]:
        self.counter += 1
        seed = 1_000_000 + self.counter
        if self.plan.mode == "fresh":
            return make_prompt(length, self.vocab, seed=seed)
        tail = self.plan.tail_tokens
        return self.bases[length][: length - tail] + make_prompt(tail, self.vocab, seed=seed)


def _scrape(pair: EnginePair) -> dict[str, str]:
    out = {}
    for role in ("prefill", "decode"):
        try:
            out[role] = pair.metrics(role)
        except httpx.HTTPError as exc:
            logger.warning("could not scrape %s metrics: %s", role, exc)
            out[role] = ""
    return out


def _deltas(before: dict[str, str], after: dict[str, str]) -> tuple[dict[str, float], float | None]:
    breakdown: dict[str, float] = {}
    for role, names in (("prefill", PREFILL_METRICS), ("decode", DECODE_METRICS)):
        for name, key in names.items():
            d = prom_sum(after[role], name) - prom_sum(before[role], name)
            if d > 0:
                breakdown[key] = d
    conn_bytes = None
    for name in CONNECTOR_BYTES:
        d = prom_sum(after["decode"], name) - prom_sum(before["decode"], name)
        if d > 0:
            conn_bytes = d
            break
    return breakdown, conn_bytes


def run_cell(pair: EnginePair, plan: BenchPlan, prompts: PromptFactory, rate: float | None,
             length: int, conc: int, measured: float | None,
             dense_per_token: int) -> tuple[CellResult, list[RequestResult]]:
    """Measure one cell on running engines; returns the aggregate and the requests."""
    batches = ([[prompts.next(length)] for _ in range(plan.sequential_requests)] if conc == 1
               else [[prompts.next(length) for _ in range(conc)] for _ in range(plan.waves)])
    before = _scrape(pair)
    tx0, rx0 = pair.link.counters()
    raw: list[dict[str, Any]] = []
    for batch in batches:
        raw += asyncio.run(_run_batch(pair.proxy_url, batch, conc > 1, plan.max_tokens,
                                      plan.request_timeout_s))
    time.sleep(1.0)  # let the engines publish their last stats
    tx1, rx1 = pair.link.counters()
    after = _scrape(pair)
    events = read_events(pair.events_path)
    results = []
    for item in raw:
        rec = _proxy_record(pair.proxy_url, item["rid"])
        marks = match_events(events, item["rid"])
        handoff, pull = handoff_times(marks)
        prefill_s = rec.get("prefill_seconds")
        total_s = rec.get("total_seconds")
        ok = (item["error"] is None and rec.get("outcome", "ok") == "ok"
              and "load_failed" not in marks)
        results.append(RequestResult(
            config=pair.conn.label, rate_gbit=rate, length=length, concurrency=conc,
            request_id=item["rid"], ok=ok, ttft_s=item["ttft"], prefill_s=prefill_s,
            decode_request_s=(total_s - prefill_s) if total_s and prefill_s else None,
            decode_ttft_s=rec.get("decode_ttft_seconds"),
            total_s=item["total"], handoff_s=handoff, pull_s=pull,
            error=item["error"] or ("load_failed" if "load_failed" in marks else None)))
    breakdown, conn_bytes = _deltas(before, after)
    cell = summarize(pair.conn.label, rate, length, conc, results,
                     link_bytes=(tx1 - tx0) + (rx1 - rx0), connector_bytes=conn_bytes,
                     dense_bytes_per_token=dense_per_token, measured_gbit=measured,
                     breakdown_totals=breakdown)
    logger.info("cell %s %s len=%d c=%d: ok %d/%d handoff %s s, decode TTFT %s s, decode req %s s, "
                "TTFT %s s, wire %.1f MB/req", pair.conn.label, rate_label(rate), length, conc,
                cell.n_ok, len(results), _f(cell.handoff_s), _f(cell.decode_ttft_s),
                _f(cell.decode_request_s), _f(cell.ttft_s),
                (cell.wire_bytes or 0) / 1e6)
    return cell, results


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def run_config(link: EmulatedLink, conn: ConnectorConfig, plan: BenchPlan, settings: EngineSettings,
               workdir: Path, out: BenchOutput, vocab: int, dense_per_token: int) -> None:
    events = workdir / f"{conn.label}-events.jsonl"
    events.unlink(missing_ok=True)
    prompts = PromptFactory(plan, vocab)
    link.set_rate(None)
    t0 = time.monotonic()
    with EnginePair(link, conn, settings, workdir, events) as pair:
        logger.info("%s: engines up in %.0f s", conn.label, time.monotonic() - t0)
        # Warm-up: the first transfer to a peer pays NIXL/UCX connection setup and handshakes.
        # A concurrent wave too: NIXL's UCX backend runs several worker threads whose endpoints
        # are wired up on first use; without it the first concurrent transfers stalled ~30 s
        # (until the idle prefill engine's lease housekeeping ran) in a trial run.
        seed = 500
        waves = [(1, False)] * plan.warmup_requests + [(max(plan.concurrencies), True)] * 2
        for size, concurrent in waves:
            warm = [make_prompt(1000, vocab, seed=(seed := seed + 1)) for _ in range(size)]
            t_w = time.monotonic()
            for item in asyncio.run(_run_batch(pair.proxy_url, warm, concurrent, plan.max_tokens,
                                               plan.request_timeout_s)):
                if item["error"]:
                    raise BenchError(f"{conn.label}: warm-up request failed: {item['error']}")
            logger.info("%s: warm-up wave of %d took %.1f s", conn.label, size,
                        time.monotonic() - t_w)
        if plan.mode == "primed":
            out.prefill_cold_s[conn.label] = {
                str(n): _direct_prefill(pair.prefill_url, prompts.bases[n], plan.request_timeout_s)
                for n in plan.lengths}
        for rate in plan.rates:
            link.set_rate(rate)
            measured = link.measure_gbit(8 << 20 if (rate or 100) < 1 else 64 << 20)
            out.link_measured_gbit.setdefault(conn.label, {})[rate_label(rate)] = measured
            logger.info("%s: link %s measured %.3f Gbit/s", conn.label, rate_label(rate), measured)
            for length in plan.lengths:
                for conc in plan.concurrencies:
                    cell, reqs = run_cell(pair, plan, prompts, rate, length, conc, measured,
                                          dense_per_token)
                    out.cells.append(cell)
                    out.requests.extend(reqs)
    link.set_rate(None)
    out.log_findings[conn.label] = scan_logs(workdir, conn.label)


#: Log lines that mean a transfer went wrong or raced a lease (counted per config and engine).
LOG_FINDINGS = {
    "lease_expired": re.compile(r"Releasing expired KV blocks"),
    "invalid_blocks_read": re.compile(r"Potentially invalid KV blocks"),
    "nixl_failed_transfers": re.compile(r"Num failed transfers=[1-9]"),
    "turbowire_load_failed": re.compile(r"KV load of request \S+ from engine \S+ failed"),
    "traceback": re.compile(r"Traceback \(most recent call last\)"),
}


def scan_logs(workdir: Path, label: str) -> dict[str, int]:
    """Count LOG_FINDINGS in the engines' logs of one config (non-zero counts only)."""
    found: dict[str, int] = {}
    for role in ("prefill", "decode"):
        path = workdir / f"{label}-{role}.log"
        if not path.exists():
            continue
        text = path.read_text(errors="replace")
        cut = text.find("[shutdown]")  # engines are killed at the end: ignore what follows
        text = text if cut < 0 else text[:cut]
        for key, pattern in LOG_FINDINGS.items():
            n = len(pattern.findall(text))
            if n:
                found[f"{role}:{key}"] = n
    return found


def machine_info() -> dict[str, Any]:
    import os

    import torch
    import vllm

    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=Path(__file__).resolve().parents[2],
                                  capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return "?"

    return {"git": git("rev-parse", "--short", "HEAD"),
            "git_dirty_files": len(
                git("status", "--porcelain", "--untracked-files=no").splitlines()),
            "cpu": cpu, "cores": os.cpu_count(), "kernel": platform.release(),
            "python": platform.python_version(), "torch": torch.__version__,
            "vllm": getattr(vllm, "__version__", "?"), "host": platform.node()}


def run_bench(plan: BenchPlan, out_dir: Path, spec: BenchModelSpec | None = None) -> BenchOutput:
    """Run the whole plan (caller holds the engine lock); writes results.json/.md and a plot."""
    spec = spec or BenchModelSpec()
    model = ensure_bench_model(spec)
    vocab = vocab_size_of(model)
    max_len = max(plan.lengths) + plan.max_tokens + 64
    settings = EngineSettings(model, max_model_len=max(2048, -(-max_len // 32) * 32),
                              prefill_prefix_caching=plan.mode == "primed")
    out_dir.mkdir(parents=True, exist_ok=True)
    out = BenchOutput(plan=_plan_dict(plan), machine=machine_info(),
                      model={"path": str(model), **asdict(spec),
                             "kv_bytes_per_token": spec.kv_bytes_per_token})
    t0 = time.monotonic()
    with EmulatedLink() as link:
        for conn in plan.configs:
            try:
                run_config(link, conn, plan, settings, out_dir, out, vocab, spec.kv_bytes_per_token)
            except EngineStartError as exc:  # the cause is in the engine's log, not our stack
                logger.error("config %s: %s", conn.label, exc.summary())
                out.errors.append(f"{conn.label}: {exc.summary()}")
            except Exception as exc:  # one broken config must not lose the others' results
                logger.exception("config %s failed", conn.label)
                out.errors.append(f"{conn.label}: {type(exc).__name__}: {str(exc)[:2000]}")
            write_outputs(out, out_dir)
    out.wall_s = time.monotonic() - t0
    add_ratios(out.cells)
    write_outputs(out, out_dir)
    return out


def _plan_dict(plan: BenchPlan) -> dict[str, Any]:
    d = asdict(plan)
    d["configs"] = [asdict(c) for c in plan.configs]
    return d


def render_markdown(out: BenchOutput) -> str:
    lines = ["## End-to-end results", "",
             f"machine: {out.machine}", "",
             f"model: {out.model.get('path')} ({out.model.get('num_layers')} layers, "
             f"{out.model.get('num_kv_heads')} KV heads, head_dim {out.model.get('head_dim')}, "
             f"{out.model.get('kv_bytes_per_token')} B/token bf16)", "",
             f"mode: {out.plan['mode']}, max_tokens {out.plan['max_tokens']}, "
             f"wall {out.wall_s:.0f} s", ""]
    if out.prefill_cold_s:
        lines += ["cold prefill seconds on the prefill engine (priming):", "",
                  json.dumps(out.prefill_cold_s), ""]
    if out.link_measured_gbit:
        lines += ["measured link goodput (Gbit/s, TCP, root->netns):", "",
                  json.dumps(out.link_measured_gbit), ""]
    lines += [markdown_table(out.cells), ""]
    bt = breakdown_table(out.cells)
    if bt:
        lines += ["Where the time goes (per request, from the connectors' metrics):", "", bt, ""]
    if any(out.log_findings.values()):
        lines += ["Engine log findings (counts):", "", json.dumps(out.log_findings), ""]
    if out.errors:
        lines += ["Errors:", ""] + [f"- {e}" for e in out.errors] + [""]
    return "\n".join(lines)


def write_outputs(out: BenchOutput, out_dir: Path) -> None:
    (out_dir / "results.json").write_text(out.to_json())
    (out_dir / "results.md").write_text(render_markdown(out))
    if out.cells:
        try:
            plot_ttft(out.cells, out_dir / "ttft_vs_link.png")
        except Exception:  # a plot must not lose the numbers
            logger.exception("plot failed")


def plot_ttft(cells: list[CellResult], path: Path) -> None:
    """TTFT and decode-request time vs link rate, one line per config, one panel per length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({c.length for c in cells})
    fig, axes = plt.subplots(2, len(lengths), figsize=(4.5 * len(lengths), 7), squeeze=False)
    rates = sorted({c.rate_gbit for c in cells}, key=lambda r: 1e9 if r is None else r)
    xs = {r: i for i, r in enumerate(rates)}
    for j, n in enumerate(lengths):
        for row, (field_, title) in enumerate((("ttft_s", "TTFT"), ("decode_request_s",
                                                                     "decode request"))):
            ax = axes[row][j]
            for conf in sorted({c.config for c in cells}):
                pts = sorted(((xs[c.rate_gbit], getattr(c, field_)) for c in cells
                              if c.config == conf and c.length == n and c.concurrency == 1
                              and getattr(c, field_) is not None))
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=conf)
            ax.set_xticks(range(len(rates)), [rate_label(r) for r in rates])
            ax.set_yscale("log")
            ax.set_title(f"{title}, {n} tokens, conc 1")
            ax.set_xlabel("link")
            ax.set_ylabel("seconds")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

