"""``turbowire bench serve``: users' own client, ``vllm bench serve``, through the P/D proxy.

What vLLM's P/D perf sweep does (``run_perf_sweep.sh``: ``vllm bench serve`` pointed at the proxy,
``--max-concurrency`` 1, 2, 4, ..., results saved as JSON, then CSV), here for NixlConnector and
turbowire presets side by side on the e2e benchmark's stack: a prefill engine in the root network
namespace, a decode engine in its own namespace behind a veth pair shaped with ``tc tbf``
(:mod:`turbowire.bench_e2e.engines`, :mod:`turbowire.bench_e2e.link`), turbowire's proxy in front.

For each connector configuration the stack starts once; for each link rate, dataset and
concurrency, both engines' prefix caches are reset (vLLM's ``POST /reset_prefix_cache``, served
because the engines run with ``VLLM_SERVER_DEV_MODE=1``: runs repeat prompts, and a cached prompt
would skip prefill and the KV transfer), then ``vllm bench serve`` runs
(:mod:`turbowire.bench_e2e.vllm_client`, vLLM's own parser and ``main``). Datasets: ``random``
(fixed input and output lengths) and ``sharegpt``, a ShareGPT-format file built offline from the
bundled corpus (:func:`build_sharegpt`). The saved results become one CSV, Markdown tables and a
Pareto plot (output tokens/s per user against output tokens/s in all, as vLLM's ``plot_pareto``).
"""

from __future__ import annotations

import asyncio
import csv
import json
import logging
import math
import os
import random
import selectors
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

from turbowire.bench_e2e.client import SERVED_MODEL, stream_completion
from turbowire.bench_e2e.engines import (
    ConnectorConfig,
    EnginePair,
    EngineSettings,
    EngineStartError,
)
from turbowire.bench_e2e.link import EmulatedLink
from turbowire.bench_e2e.model import BenchModelSpec, ensure_bench_model, make_prompt, vocab_size_of
from turbowire.bench_e2e.results import rate_label
from turbowire.bench_e2e.run import machine_info, scan_logs
from turbowire.errors import TurboWireError
from turbowire.serving.launch import EngineSpec

logger = logging.getLogger(__name__)

DATASETS = ("random", "sharegpt")
SHAREGPT_FILE = "sharegpt_like.json"
#: vLLM's ShareGPT loader drops prompts over 1024 tokens and prompt + output over 2048
SHAREGPT_MAX_PROMPT = 1024
SHAREGPT_MAX_TOTAL = 2048

Progress = Callable[[str], None]


class ServeBenchError(TurboWireError, RuntimeError):
    """The serving benchmark could not run (bad plan, client or engines down)."""


# ---------------------------------------------------------------------------------------------
# the plan


@dataclass(frozen=True)
class ServePlan:
    """What ``turbowire bench serve`` runs: every config x link x dataset x concurrency."""

    configs: tuple[ConnectorConfig, ...]
    links: tuple[float | None, ...] = (None, 1.0)  # Gbit/s; None = unshaped
    datasets: tuple[str, ...] = DATASETS
    concurrencies: tuple[int, ...] = (1, 2, 4, 8)
    num_prompts: int = 0  # per run; 0: 2 * concurrency + 4
    input_len: int = 1024  # random dataset
    output_len: int = 64  # random dataset
    sharegpt_size: int = 200  # conversations in the built ShareGPT-like file
    seed: int = 0
    run_timeout_s: float = 900.0

    def __post_init__(self) -> None:
        if not self.configs:
            raise ValueError("configs must name at least one connector config (e.g. 'nixl')")
        if len({c.label for c in self.configs}) != len(self.configs):
            raise ValueError("configs must not repeat")
        if not self.links:
            raise ValueError("links must name at least one link ('none' = unshaped)")
        if any(r is not None and r <= 0 for r in self.links):
            raise ValueError(f"link rates must be > 0 Gbit/s or None (unshaped), got {self.links}")
        bad = [d for d in self.datasets if d not in DATASETS]
        if bad or not self.datasets:
            raise ValueError(f"datasets must be among {DATASETS}, got {list(self.datasets)}")
        if not self.concurrencies or any(c < 1 for c in self.concurrencies):
            raise ValueError(f"concurrencies must be >= 1, got {list(self.concurrencies)}")
        if self.num_prompts < 0:
            raise ValueError("num_prompts must be >= 0 (0: 2 * concurrency + 4)")
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError("input_len and output_len must be >= 1")
        if self.sharegpt_size < 1:
            raise ValueError("sharegpt_size must be >= 1")

    def prompts_for(self, concurrency: int) -> int:
        """Prompts of one run: enough for a few full waves at that concurrency, and bounded."""
        return self.num_prompts or 2 * concurrency + 4

    def runs(self) -> list[ServeRun]:
        """Every run, in the order they execute (config, then link, dataset, concurrency)."""
        return [ServeRun(c.label, rate, d, n, self.prompts_for(n))
                for c in self.configs for rate in self.links for d in self.datasets
                for n in self.concurrencies]

    def max_model_len(self) -> int:
        longest = max(self.input_len + self.output_len, SHAREGPT_MAX_TOTAL)
        return -(-(longest + 64) // 32) * 32

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["configs"] = [asdict(c) for c in self.configs]
        d["links"] = [rate_label(r) for r in self.links]
        return d


@dataclass(frozen=True)
class ServeRun:
    """One ``vllm bench serve`` run."""

    config: str
    link_gbit: float | None
    dataset: str
    concurrency: int
    num_prompts: int

    @property
    def link(self) -> str:
        return rate_label(self.link_gbit)

    @property
    def name(self) -> str:
        """File stem of its result JSON and log."""
        return f"{self.config}_{self.link}_{self.dataset}_c{self.concurrency}"


def bench_serve_args(plan: ServePlan, run: ServeRun, *, base_url: str, tokenizer: Path,
                     result_dir: Path, dataset_path: Path | None) -> list[str]:
    """The ``vllm bench serve`` argument list of one run (also what a user would type)."""
    args = [
        "--backend", "openai", "--base-url", base_url, "--endpoint", "/v1/completions",
        "--model", SERVED_MODEL, "--tokenizer", str(tokenizer),
        "--dataset-name", run.dataset,
        "--num-prompts", str(run.num_prompts), "--max-concurrency", str(run.concurrency),
        "--request-rate", "inf", "--seed", str(plan.seed),
        # greedy, and every request generates its full length (a random-weight model may say EOS)
        "--temperature", "0", "--ignore-eos",
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
        "--save-result", "--result-dir", str(result_dir),
        "--result-filename", f"{run.name}.json",
        "--metadata", f"tw_config={run.config}", f"tw_link={run.link}",
        f"tw_dataset={run.dataset}",
        "--disable-tqdm", "--ready-check-timeout-sec", "300",
    ]  # fmt: skip
    if run.dataset == "random":
        args += ["--random-input-len", str(plan.input_len),
                 "--random-output-len", str(plan.output_len), "--random-range-ratio", "0"]
    elif run.dataset == "sharegpt":
        if dataset_path is None:
            raise ValueError("the sharegpt dataset needs its file (dataset_path)")
        args += ["--dataset-path", str(dataset_path)]
    else:
        raise ValueError(f"unknown dataset {run.dataset!r}")
    return args


# ---------------------------------------------------------------------------------------------
# the ShareGPT-like dataset

INSTRUCTIONS = (
    "Summarize the following text in a few sentences.",
    "Explain this passage to someone new to Python.",
    "What are the key points of the text below?",
    "Rewrite the following in plain English.",
    "List the rules this text describes.",
    "Answer questions about the following documentation.",
)


def word_count(text: str) -> int:
    """A tokenizer-free length (words), for tests and previews."""
    return len(text.split())


def _log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    return int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))


def _fit(words: Sequence[str], prefix: str, target: int, count: Callable[[str], int]) -> str:
    """The longest ``prefix + words[:k]`` of at most ``target`` tokens (binary search on k)."""
    lo, hi = 1, min(len(words), max(1, target * 2))
    best = prefix + words[0]
    while lo <= hi:
        mid = (lo + hi) // 2
        text = prefix + " ".join(words[:mid])
        if count(text) <= target:
            best, lo = text, mid + 1
        else:
            hi = mid - 1
    return best


def build_sharegpt(corpus: str, size: int, *, seed: int = 0,
                   count_tokens: Callable[[str], int] = word_count,
                   prompt_tokens: tuple[int, int] = (32, 960),
                   output_tokens: tuple[int, int] = (16, 160)) -> list[dict[str, Any]]:
    """``size`` ShareGPT-format conversations (a human turn, a gpt turn) cut from ``corpus``.

    Why: users benchmark P/D with ShareGPT (varied prompt and answer lengths); the machines here
    are offline, so a file in the same format is built from the bundled corpus, deterministically
    for a ``seed``. Prompt and answer lengths (in ``count_tokens`` tokens, the served model's
    tokenizer in the benchmark) are log-uniform within the ranges, which stay inside what vLLM's
    ShareGPT loader keeps (prompt <= 1024, prompt + answer <= 2048, each >= 4).
    """
    lo_p, hi_p = prompt_tokens
    lo_o, hi_o = output_tokens
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}")
    if not (8 <= lo_p <= hi_p <= SHAREGPT_MAX_PROMPT and 4 <= lo_o <= hi_o
            and hi_p + hi_o <= SHAREGPT_MAX_TOTAL):
        raise ValueError(
            f"prompt_tokens {prompt_tokens} and output_tokens {output_tokens} must lie within "
            f"what vLLM's ShareGPT loader keeps (prompt 8..{SHAREGPT_MAX_PROMPT}, answer >= 4, "
            f"sum <= {SHAREGPT_MAX_TOTAL})")
    words = corpus.split()
    if len(words) < 4 * (hi_p + hi_o):
        raise ValueError("corpus too short for these lengths")
    rng = random.Random(seed)
    out: list[dict[str, Any]] = []
    for i in range(size):
        n_in, n_out = _log_uniform(rng, lo_p, hi_p), _log_uniform(rng, lo_o, hi_o)
        instruction = rng.choice(INSTRUCTIONS)
        a = rng.randrange(0, len(words) - 2 * hi_p)
        b = rng.randrange(0, len(words) - 2 * hi_o)
        prompt = _fit(words[a:a + 2 * hi_p], instruction + "\n\n", n_in, count_tokens)
        answer = _fit(words[b:b + 2 * hi_o], "", n_out, count_tokens)
        out.append({"id": f"tw-sharegpt-{seed}-{i:05d}",
                    "conversations": [{"from": "human", "value": prompt},
                                      {"from": "gpt", "value": answer}]})
    return out


def write_sharegpt(path: Path, entries: Sequence[Mapping[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(list(entries), indent=1, ensure_ascii=False) + "\n")
    return path


def tokenizer_counter(model_dir: Path) -> Callable[[str], int]:
    """Token count as vLLM's ShareGPT loader counts it (``tokenizer(text).input_ids``)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    return lambda text: len(tok(text).input_ids)


# ---------------------------------------------------------------------------------------------
# results


@dataclass
class ServeRow:
    """One run's result (one CSV row); times in ms, throughputs in tokens or requests per s."""

    config: str
    link: str
    dataset: str
    concurrency: int
    num_prompts: int
    completed: int
    failed: int
    duration_s: float
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    tok_s_user: float  # output_throughput / concurrency (vLLM plot_pareto's tokens/s/user)
    mean_ttft_ms: float | None = None
    median_ttft_ms: float | None = None
    p99_ttft_ms: float | None = None
    mean_tpot_ms: float | None = None
    median_tpot_ms: float | None = None
    p99_tpot_ms: float | None = None
    mean_itl_ms: float | None = None
    median_itl_ms: float | None = None
    p99_itl_ms: float | None = None
    median_e2el_ms: float | None = None
    measured_gbit: float | None = None  # the link's TCP goodput measured before the runs
    load1: float | None = None  # the machine's 1-minute load average when the run started
    result_file: str = ""


CSV_COLUMNS = tuple(f.name for f in fields(ServeRow))
_REQUIRED = ("max_concurrency", "completed", "duration", "request_throughput",
             "output_throughput", "total_token_throughput")


def _opt(data: Mapping[str, Any], key: str) -> float | None:
    v = data.get(key)
    return None if v is None else float(v)


def parse_result(data: Mapping[str, Any], *, result_file: str = "",
                 measured_gbit: float | None = None, load1: float | None = None) -> ServeRow:
    """A ``vllm bench serve --save-result`` JSON as one row.

    Config, link and dataset come from the ``--metadata`` keys the sweep passes (``tw_config``,
    ``tw_link``, ``tw_dataset``); a result saved without them reads as ``?``.
    """
    missing = [k for k in _REQUIRED if data.get(k) is None]
    if missing:
        raise ValueError(f"not a vllm bench serve result: {', '.join(missing)} missing")
    conc = int(data["max_concurrency"])
    if conc < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {conc}")
    out_tps = float(data["output_throughput"])
    num = int(data.get("num_prompts") or data["completed"])
    completed = int(data["completed"])
    failed = int(data["failed"]) if data.get("failed") is not None else num - completed
    return ServeRow(
        config=str(data.get("tw_config", "?")), link=str(data.get("tw_link", "?")),
        dataset=str(data.get("tw_dataset", "?")), concurrency=conc, num_prompts=num,
        completed=completed, failed=failed, duration_s=float(data["duration"]),
        request_throughput=float(data["request_throughput"]), output_throughput=out_tps,
        total_token_throughput=float(data["total_token_throughput"]),
        tok_s_user=out_tps / conc,
        **{k: _opt(data, k) for k in (
            "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms",
            "p99_tpot_ms", "mean_itl_ms", "median_itl_ms", "p99_itl_ms", "median_e2el_ms")},
        measured_gbit=measured_gbit, load1=load1, result_file=result_file)


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both axes (both maximized), by x."""
    front = []
    for i, (x, y) in enumerate(points):
        dominated = any((x2 >= x and y2 >= y) and (x2 > x or y2 > y)
                        for j, (x2, y2) in enumerate(points) if j != i)
        if not dominated:
            front.append(i)
    return sorted(front, key=lambda i: points[i])


def write_csv(rows: Iterable[ServeRow], path: Path) -> Path:
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=CSV_COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if v is None else round(v, 3) if isinstance(v, float) else v)
                        for k, v in asdict(r).items()})
    return path


def read_csv(path: Path) -> list[ServeRow]:
    """Rows written by :func:`write_csv` (to re-plot or re-tabulate a run)."""
    kinds = {f.name: f.type for f in fields(ServeRow)}
    out = []
    with open(path, newline="") as fh:
        for rec in csv.DictReader(fh):
            kw: dict[str, Any] = {}
            for k, v in rec.items():
                t = str(kinds[k])
                if v == "":
                    kw[k] = None if "None" in t else v
                elif t.startswith("int"):
                    kw[k] = int(v)
                elif t.startswith("float"):
                    kw[k] = float(v)
                else:
                    kw[k] = v
            out.append(ServeRow(**kw))
    return out


def _num(v: float | None, digits: int = 1) -> str:
    """A table cell: whole numbers from 100 up, ``digits`` decimals below."""
    if v is None:
        return "-"
    return f"{v:.0f}" if abs(v) >= 100 else f"{v:.{digits}f}"


def text_table(header: Sequence[str], rows: Sequence[Sequence[str]], left: int = 2) -> str:
    """A Markdown table padded so it also reads as plain text: the first ``left`` columns
    left-aligned, the rest (numbers) right-aligned."""
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(header)]
    align = ["---" if i < left else "--:" for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        parts = [c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(cells,
                                                                                   widths))]
        return "| " + " | ".join(parts) + " |"

    sep = "|" + "|".join("-" * (w + 1) + (":" if a.endswith(":") else "-")
                         for w, a in zip(widths, align)) + "|"
    return "\n".join([line(header), sep, *(line(r) for r in rows)])


SERVE_HEADER = ("C", "config", "tok/s", "tok/s/user", "TTFT p50", "TTFT p99", "TPOT p50",
                "ITL p99")
TABLE_LEGEND = ("C: concurrency; tok/s: output tokens/s of all users; tok/s/user: tok/s / C; "
                "TTFT, TPOT, ITL in ms (p50 = median).")


def _group_key(r: ServeRow) -> tuple[str, str]:
    return (r.link, r.dataset)


def markdown_tables(rows: Sequence[ServeRow], *, dataset_notes: Mapping[str, str] | None = None,
                    ) -> str:
    """One table per (link, dataset), rows by concurrency then config (:data:`TABLE_LEGEND`);
    lines fit 80 columns for config labels up to 10 characters."""
    notes = dataset_notes or {}
    order: list[tuple[str, str]] = []
    for r in rows:
        if _group_key(r) not in order:
            order.append(_group_key(r))
    out: list[str] = []
    for link, dataset in order:
        group = sorted((r for r in rows if _group_key(r) == (link, dataset)),
                       key=lambda r: r.concurrency)
        title = f"link {link}, dataset {dataset}"
        if dataset in notes:
            title += f" ({notes[dataset]})"
        body = [[str(r.concurrency), r.config, f"{r.output_throughput:.1f}",
                 f"{r.tok_s_user:.1f}", _num(r.median_ttft_ms), _num(r.p99_ttft_ms),
                 _num(r.median_tpot_ms), _num(r.p99_itl_ms)] for r in group]
        out += [f"**{title}**", "", text_table(SERVE_HEADER, body), ""]
        failed = [f"{r.config} C={r.concurrency}: {r.failed} of {r.num_prompts}"
                  for r in group if r.failed]
        if failed:
            out += [textwrap.fill("failed requests: " + "; ".join(failed), 80), ""]
    return "\n".join(out).rstrip() + "\n"


def plot_pareto(rows: Sequence[ServeRow], path: Path) -> Path:
    """Output tokens/s per user (x) against output tokens/s (y), one line per config through its
    concurrencies, one panel per (link, dataset); ringed points are the panel's Pareto front."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datasets = list(dict.fromkeys(r.dataset for r in rows))
    links = list(dict.fromkeys(r.link for r in rows))
    fig, axes = plt.subplots(len(datasets), len(links), figsize=(5.2 * len(links),
                                                                  4.2 * len(datasets)),
                             squeeze=False)
    configs = list(dict.fromkeys(r.config for r in rows))
    colors = {c: f"C{i}" for i, c in enumerate(configs)}
    for i, ds in enumerate(datasets):
        for j, link in enumerate(links):
            ax = axes[i][j]
            panel = [r for r in rows if r.dataset == ds and r.link == link and r.completed]
            for conf in configs:
                pts = sorted((r for r in panel if r.config == conf), key=lambda r: r.concurrency)
                if not pts:
                    continue
                ax.plot([r.tok_s_user for r in pts], [r.output_throughput for r in pts],
                        marker="o", color=colors[conf], label=conf)
                for r in pts:
                    ax.annotate(f"c{r.concurrency}", (r.tok_s_user, r.output_throughput),
                                textcoords="offset points", xytext=(4, 4), fontsize=7,
                                color=colors[conf])
            front = pareto_front([(r.tok_s_user, r.output_throughput) for r in panel])
            if front:
                ax.scatter([panel[k].tok_s_user for k in front],
                           [panel[k].output_throughput for k in front], s=140,
                           facecolors="none", edgecolors="black", linewidths=1.2,
                           label="Pareto front")
            ax.set_title(f"link {link}, {ds}")
            ax.set_xlabel("output tokens/s per user")
            ax.set_ylabel("output tokens/s")
            ax.grid(True, alpha=0.3)
            if panel:
                ax.legend(fontsize=8)
    fig.suptitle("vllm bench serve through the P/D proxy (up and to the right is better)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------
# running: engines, cache resets, the client


class ServePair(EnginePair):
    """The e2e benchmark's engine pair with vLLM's dev endpoints on (``/reset_prefix_cache``)."""

    def engine_spec(self, role: str) -> EngineSpec:
        spec = super().engine_spec(role)
        spec.env = {**spec.env, "VLLM_SERVER_DEV_MODE": "1"}
        return spec


def reset_prefix_caches(urls: Sequence[str], timeout_s: float = 60.0) -> list[str]:
    """Reset each engine's prefix cache; the URLs that did not confirm within ``timeout_s``.

    vLLM answers ``success: false`` while blocks are still held (a transfer finishing, a lease),
    so each engine is retried until it confirms.
    """
    pending = list(urls)
    deadline = time.monotonic() + timeout_s
    while pending:
        still = []
        for url in pending:
            try:
                r = httpx.post(f"{url}/reset_prefix_cache", timeout=30.0)
                ok = r.status_code == 200 and bool(r.json().get("success"))
            except (httpx.HTTPError, ValueError):
                ok = False
            if not ok:
                still.append(url)
        pending = still
        if not pending or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    return pending


def warm_up(proxy_url: str, vocab: int, concurrency: int, timeout_s: float = 300.0) -> float:
    """Requests that pay NIXL/UCX connection setup before anything is measured: two one at a
    time, then a wave at ``concurrency`` (UCX wires up a worker's endpoints on first use; the
    e2e benchmark saw first concurrent transfers stall without it). Returns seconds."""
    t0 = time.monotonic()

    async def go() -> None:
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=32)) as client:
            seed = 900
            for size in (1, 1, concurrency):
                batch = [make_prompt(1000, vocab, seed=(seed := seed + 1)) for _ in range(size)]
                res = await asyncio.gather(*(stream_completion(client, proxy_url, p, 4,
                                                               timeout_s=timeout_s)
                                             for p in batch))
                errors = [r["error"] for r in res if r["error"]]
                if errors:
                    raise ServeBenchError(f"warm-up request failed: {errors[0]}")

    asyncio.run(go())
    return time.monotonic() - t0


def load1() -> float | None:
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


class ClientWorker:
    """One ``python -m turbowire.bench_e2e.vllm_client --worker`` process: vLLM imported once,
    then one ``vllm bench serve`` per :meth:`run`. A run past its timeout kills the worker; the
    next run starts a fresh one."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.proc: subprocess.Popen[str] | None = None

    def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_dir / "client-worker.log", "ab") as log:
            # cwd: the log folder, not the repository root, whose kernels/ and codec/ folders
            # would shadow PyPI packages of those names
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "turbowire.bench_e2e.vllm_client", "--worker"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                cwd=str(self.log_dir), process_group=0,  # the engines' session (serving/launch.py)
                env={**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.stdin:
            proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)

    def run(self, argv: Sequence[str], log: Path, timeout_s: float) -> dict[str, Any]:
        """Run ``vllm bench serve ARGV`` (its output to ``log``); the worker's reply."""
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        proc = self.proc
        assert proc is not None and proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write(json.dumps({"argv": list(argv), "log": str(log.resolve())}) + "\n")
            proc.stdin.flush()
        except OSError as exc:
            self.stop()
            return {"ok": False, "error": f"client worker gone: {exc}", "seconds": 0.0}
        t0 = time.monotonic()
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            ready = sel.select(timeout=timeout_s)
        line = proc.stdout.readline() if ready else ""
        if not line:
            proc.kill()
            self.stop()
            why = f"timed out after {timeout_s:.0f} s" if not ready else "client worker exited"
            return {"ok": False, "error": f"vllm bench serve {why} (see {log})",
                    "seconds": time.monotonic() - t0}
        reply: dict[str, Any] = json.loads(line)
        return reply

    def __enter__(self) -> ClientWorker:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


@dataclass
class ServeOutput:
    """Everything a sweep produced (``results.json``)."""

    plan: dict[str, Any]
    machine: dict[str, Any]
    model: dict[str, Any]
    command: str = ""  # the turbowire command line that ran the sweep
    commands: list[str] = field(default_factory=list)
    rows: list[ServeRow] = field(default_factory=list)
    link_measured_gbit: dict[str, dict[str, float]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    log_findings: dict[str, dict[str, int]] = field(default_factory=dict)
    load1_start: float | None = None
    load1_end: float | None = None
    wall_s: float = 0.0

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)


def para(text: str) -> list[str]:
    """A paragraph wrapped at 80 columns, then a blank line."""
    return [textwrap.fill(text, 80, break_on_hyphens=False), ""]


def bullets(title: str, items: Sequence[str]) -> list[str]:
    """``title:`` and a wrapped bullet per item (nothing when there are no items)."""
    if not items:
        return []
    return [f"{title}:", "", *(textwrap.fill(i, 80, initial_indent="- ", subsequent_indent="  ",
                                             break_on_hyphens=False) for i in items), ""]


def dataset_notes(plan: ServePlan) -> dict[str, str]:
    return {"random": f"{plan.input_len} in / {plan.output_len} out",
            "sharegpt": f"ShareGPT-like, {SHAREGPT_FILE}"}


def render_markdown(out: ServeOutput, plan: ServePlan) -> str:
    m = out.machine
    lines = ["## vllm bench serve through the P/D proxy", ""]
    if out.command:
        lines += ["```", out.command, "```", ""]
    lines += para(f"machine: {m.get('cpu')}, {m.get('cores')} cores, git {m.get('git')}, "
                  f"vllm {m.get('vllm')}; 1-min load average {out.load1_start} at start, "
                  f"{out.load1_end} at end; wall {out.wall_s:.0f} s")
    lines += para(f"model: {out.model.get('path')} (KV {out.model.get('kv_bytes_per_token')} "
                  "B/token)")
    lines += para(TABLE_LEGEND)
    if out.link_measured_gbit:
        lines += para("link goodput measured (Gbit/s, TCP, root -> decode namespace): "
                      + json.dumps(out.link_measured_gbit))
    lines.append(markdown_tables(out.rows, dataset_notes=dataset_notes(plan)) if out.rows
                 else "(no results)\n")
    if any(out.log_findings.values()):
        lines += para("Engine log findings (counts): " + json.dumps(out.log_findings))
    lines += bullets("Warnings", out.warnings) + bullets("Errors", out.errors)
    return "\n".join(lines)


def write_outputs(out: ServeOutput, plan: ServePlan, out_dir: Path) -> None:
    (out_dir / "results.json").write_text(out.to_json())
    write_csv(out.rows, out_dir / "serve.csv")
    (out_dir / "results.md").write_text(render_markdown(out, plan))
    (out_dir / "commands.txt").write_text("\n".join(out.commands) + "\n")
    if out.rows:
        try:
            plot_pareto(out.rows, out_dir / "pareto.png")
        except Exception:  # a plot must not lose the numbers
            logger.exception("pareto plot failed")


def shell_line(argv: Sequence[str]) -> str:
    import shlex

    return "vllm bench serve " + " ".join(shlex.quote(a) for a in argv)


def run_serve(plan: ServePlan, out_dir: Path, *, on_progress: Progress = lambda m: None,
              spec: BenchModelSpec | None = None, command: str = "") -> ServeOutput:
    """Run the whole sweep (the caller holds the engine lock and is root); writes
    ``serve.csv``, ``results.md``, ``results.json``, ``pareto.png`` and ``commands.txt``."""
    spec = spec or BenchModelSpec()
    out_dir = out_dir.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    model = ensure_bench_model(spec)
    vocab = vocab_size_of(model)
    dataset_path: Path | None = None
    if "sharegpt" in plan.datasets:
        from turbowire.quality.corpus import load_corpus

        entries = build_sharegpt(load_corpus(), plan.sharegpt_size, seed=plan.seed,
                                 count_tokens=tokenizer_counter(model))
        dataset_path = write_sharegpt(out_dir / SHAREGPT_FILE, entries)
        on_progress(f"built {dataset_path.name}: {len(entries)} conversations")
    settings = EngineSettings(model, max_model_len=plan.max_model_len())
    out = ServeOutput(plan=plan.to_dict(), machine=machine_info(),
                      model={"path": str(model), **asdict(spec),
                             "kv_bytes_per_token": spec.kv_bytes_per_token},
                      command=command, load1_start=load1())
    runs = plan.runs()
    done = 0
    t0 = time.monotonic()
    with EmulatedLink() as link, ClientWorker(out_dir / "logs") as client:
        for conn in plan.configs:
            mine = [r for r in runs if r.config == conn.label]
            try:
                link.set_rate(None)
                events = out_dir / "logs" / f"{conn.label}-events.jsonl"
                events.unlink(missing_ok=True)
                on_progress(f"[{conn.label}] starting prefill + decode engines and the proxy")
                t_up = time.monotonic()
                with ServePair(link, conn, settings, out_dir / "logs", events) as pair:
                    on_progress(f"[{conn.label}] up in {time.monotonic() - t_up:.0f} s; "
                                f"warming up")
                    warm_up(pair.proxy_url, vocab, max(plan.concurrencies))
                    for rate in plan.links:
                        link.set_rate(rate)
                        measured = link.measure_gbit(8 << 20 if (rate or 100) < 1 else 64 << 20)
                        out.link_measured_gbit.setdefault(conn.label, {})[
                            rate_label(rate)] = round(measured, 3)
                        on_progress(f"[{conn.label}] link {rate_label(rate)}: measured "
                                    f"{measured:.2f} Gbit/s")
                        for run in (r for r in mine if r.link_gbit == rate):
                            done += 1
                            row = _one_run(plan, run, pair, client, model, out_dir,
                                           dataset_path, measured, out)
                            summary = "failed (see results.md)" if row is None else (
                                f"out {row.output_throughput:.1f} tok/s, TTFT p50 "
                                f"{_num(row.median_ttft_ms)} ms, TPOT p50 "
                                f"{_num(row.median_tpot_ms)} ms")
                            on_progress(f"[{done}/{len(runs)}] {run.name}: {summary} "
                                        f"({time.monotonic() - t0:.0f} s so far)")
                            write_outputs(out, plan, out_dir)
            except EngineStartError as exc:  # the cause is in the engine's log
                out.errors.append(f"{conn.label}: {exc.summary()}")
                on_progress(f"[{conn.label}] {exc.summary()}")
            except Exception as exc:  # one broken config must not lose the others' results
                logger.exception("config %s failed", conn.label)
                out.errors.append(f"{conn.label}: {type(exc).__name__}: {str(exc)[:1000]}")
                on_progress(f"[{conn.label}] failed: {type(exc).__name__}: {exc}")
            out.log_findings[conn.label] = scan_logs(out_dir / "logs", conn.label)
            write_outputs(out, plan, out_dir)
    out.wall_s = time.monotonic() - t0
    out.load1_end = load1()
    write_outputs(out, plan, out_dir)
    return out


def _one_run(plan: ServePlan, run: ServeRun, pair: EnginePair, client: ClientWorker,
             model: Path, out_dir: Path, dataset_path: Path | None, measured: float,
             out: ServeOutput) -> ServeRow | None:
    """Reset both prefix caches, run the client, parse its result; None when it failed."""
    unreset = reset_prefix_caches([pair.prefill_url, pair.decode_url])
    if unreset:
        out.warnings.append(f"{run.name}: prefix cache not reset on {', '.join(unreset)}")
    result_dir = out_dir / "runs"
    result_dir.mkdir(parents=True, exist_ok=True)
    argv = bench_serve_args(plan, run, base_url=pair.proxy_url, tokenizer=model,
                            result_dir=result_dir, dataset_path=dataset_path)
    out.commands.append(shell_line(argv))
    result_path = result_dir / f"{run.name}.json"
    result_path.unlink(missing_ok=True)
    load = load1()
    reply = client.run(argv, result_dir / f"{run.name}.log", plan.run_timeout_s)
    if not reply.get("ok") or not result_path.exists():
        out.errors.append(f"{run.name}: {reply.get('error') or 'no result file'}")
        return None
    row = parse_result(json.loads(result_path.read_text()),
                       result_file=str(result_path.relative_to(out_dir)),
                       measured_gbit=round(measured, 3), load1=load)
    if row.failed:
        out.warnings.append(f"{run.name}: {row.failed} of {row.num_prompts} requests failed")
    out.rows.append(row)
    return row
