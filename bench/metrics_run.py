"""A short real P/D run scraped by a real Prometheus, plotted like the Grafana dashboard.

Grafana is not installable here, so this draws the dashboard's key series from the Prometheus API
with matplotlib: compression ratio (the recording rule), wire vs dense throughput, transfer /
encode / decode latency quantiles, the TTFT breakdown, staging usage and transfers/failures.
It also checks the recording rule against the ratio the connector logged (vLLM's "KV Transfer
metrics:" lines) and prints both.

Run (holds the machine-wide engine lock while engines run)::

    python -m bench.metrics_run --preset tq4 --requests 12 --out bench/results/metrics_dashboard.png
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import logging
import random
import sys
import time
from pathlib import Path

import httpx

# the local Prometheus is a test helper (tests/support/), not part of the installed package. It
# is imported as ``support``, as the tests import it: a package of vLLM's dependency tree
# installs a top-level ``tests`` package, which shadows the repository's ``tests`` folder
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support.prometheus_local import LocalPrometheus  # noqa: E402

from turbowire.metrics_summary import logged_ratio, logged_transfer_totals  # noqa: E402
from turbowire.serving.launch import (  # noqa: E402
    EngineSpec,
    ProcessGroup,
    engine_lock,
    free_port,
    start_engine,
    start_proxy,
    turbowire_kv_config,
)

logger = logging.getLogger("metrics_run")

WORDS = (
    "the compressed key value cache moves from the prefill engine to the decode engine over the "
    "wire and is decoded into paged blocks while the scheduler keeps leases on staging slots "
    "until the reader confirms it has every chunk of every layer"
).split()


def prompt(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def send_load(
    proxy_url: str,
    model: str,
    n: int,
    concurrency: int,
    seed: int,
    max_tokens: int,
    words: tuple[int, int],
) -> list[float]:
    """Streaming completions through the proxy; returns client-side TTFTs (s)."""
    rng = random.Random(seed)
    sizes = [rng.randint(*words) for _ in range(n)]

    def one(i: int) -> float:
        body = {
            "model": model,
            "prompt": prompt(rng, sizes[i]),
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
        }
        t0 = time.perf_counter()
        ttft = -1.0
        with httpx.stream("POST", proxy_url + "/v1/completions", json=body, timeout=300) as r:
            r.raise_for_status()
            for chunk in r.iter_bytes():
                if ttft < 0 and chunk.strip():
                    ttft = time.perf_counter() - t0
        return ttft

    pool = concurrent.futures.ThreadPoolExecutor(concurrency)
    try:
        return list(pool.map(one, range(n)))
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # Ctrl-C: drop queued requests


W = "30s"  # rate window of the latency / TTFT panels


def _avg(metric: str, sel: str = "") -> str:
    return f"sum(rate({metric}_sum{{{sel}}}[{W}])) / sum(rate({metric}_count{{{sel}}}[{W}]))"


_D_XFER = _avg("turbowire_kv_transfer_duration_seconds", "role='consumer'")

#: name -> PromQL of every series the plot draws (the dashboard's key panels)
QUERIES: dict[str, str] = {
    "ratio": "turbowire:kv_compression_ratio:rate1m",
    "dense": "sum by (role) (turbowire:kv_dense_bytes:rate1m)",
    "wire": "sum by (role) (turbowire:kv_wire_bytes:rate1m)",
    "transfer_p50": "histogram_quantile(0.5, sum by (le) (rate("
    f"turbowire_kv_transfer_duration_seconds_bucket{{role='consumer'}}[{W}])))",
    "transfer_p90": "histogram_quantile(0.9, sum by (le) (rate("
    f"turbowire_kv_transfer_duration_seconds_bucket{{role='consumer'}}[{W}])))",
    "encode_p90": "histogram_quantile(0.9, sum by (le) (rate("
    f"turbowire_kv_encode_duration_seconds_bucket[{W}])))",
    "decode_p90": "histogram_quantile(0.9, sum by (le) (rate("
    f"turbowire_kv_decode_duration_seconds_bucket[{W}])))",
    "ttft_prefill": _avg("turbowire_proxy_prefill_duration_seconds"),
    "ttft_transfer": _D_XFER,
    "ttft_first_decode": (
        f"clamp_min({_avg('turbowire_proxy_decode_ttft_seconds')} - ({_D_XFER}), 0)"
    ),
    "staging_used": "sum(turbowire_staging_in_use_bytes{role='producer'})",
    "staging_util": "sum(turbowire:staging_utilization:ratio{role='producer'})",
    "leases": "sum(turbowire_leases_outstanding{role='producer'})",
    "transfers": f"sum by (role, direction) (rate(turbowire_kv_transfers_total[{W}]))",
    "failures": f"sum by (reason) (rate(turbowire_kv_transfer_failures_total[{W}]))",
}


def collect(
    prom: LocalPrometheus, start: float, end: float, step_s: float = 2.0
) -> dict[str, list[tuple[dict[str, str], list[tuple[float, float]]]]]:
    """Every plotted series from the Prometheus API (kept as JSON so the plot can be redrawn)."""
    data = {name: prom.query_range(expr, start, end, step_s) for name, expr in QUERIES.items()}
    return {"start": start, "end": end, "queries": QUERIES, "series": data}  # type: ignore[dict-item]


def plot(collected: dict, out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    start = collected["start"]
    series = collected["series"]

    def draw(ax, name: str, label_fmt, scale: float = 1.0, **kw) -> None:
        for labels, values in series[name]:
            ax.plot(
                [t - start for t, _ in values],
                [v * scale for _, v in values],
                label=label_fmt(labels),
                **kw,
            )

    fig, axes = plt.subplots(2, 3, figsize=(16, 8.5))
    ax = axes[0][0]
    draw(ax, "ratio", lambda lb: f"{lb.get('role')} {lb.get('preset')}")
    ax.set_title("Compression ratio (recording rule, 1m)")
    ax.set_ylabel("dense / wire")
    ax = axes[0][1]
    draw(ax, "dense", lambda lb: f"dense {lb.get('role')}", scale=1 / 2**20)
    draw(ax, "wire", lambda lb: f"wire {lb.get('role')}", scale=1 / 2**20, linestyle="--")
    ax.set_title("Wire vs dense throughput (1m rate)")
    ax.set_ylabel("MiB/s")
    ax = axes[0][2]
    draw(ax, "transfer_p50", lambda lb: "transfer p50 (decode side)", scale=1e3)
    draw(ax, "transfer_p90", lambda lb: "transfer p90 (decode side)", scale=1e3)
    draw(ax, "encode_p90", lambda lb: "encode p90 (prefill)", scale=1e3, linestyle="--")
    draw(ax, "decode_p90", lambda lb: "decode p90 (decode)", scale=1e3, linestyle=":")
    ax.set_yscale("log")
    ax.set_title(f"Latency quantiles ({W} window, from histograms)")
    ax.set_ylabel("ms (log)")
    ax = axes[1][0]
    grid: list[float] | None = None
    stack = []
    for name, label in (
        ("ttft_prefill", "prefill (proxy)"),
        ("ttft_transfer", "kv transfer"),
        ("ttft_first_decode", "first decode"),
    ):
        if not series[name]:
            continue
        values = dict(series[name][0][1])
        grid = sorted(values) if grid is None else grid
        stack.append((label, [values.get(t, 0.0) * 1e3 for t in grid]))
    if grid and stack:
        ax.stackplot(
            [t - start for t in grid],
            *[v for _, v in stack],
            labels=[n for n, _ in stack],
            alpha=0.8,
        )
    ax.set_title(f"TTFT breakdown, mean ({W} window)")
    ax.set_ylabel("ms")
    ax = axes[1][1]
    draw(ax, "staging_used", lambda lb: "in use (prefill)", scale=1 / 2**20)
    ax.set_ylabel("MiB")
    ax2 = ax.twinx()
    for _labels, values in series["leases"]:
        ax2.step(
            [t - start for t, _ in values],
            [v for _, v in values],
            where="post",
            color="gray",
            alpha=0.7,
            label="leases outstanding",
        )
    ax2.set_ylabel("leases")
    ax2.legend(fontsize=8, loc="upper right")
    util = [v for _lb, vals in series["staging_util"] for _t, v in vals]
    ax.set_title(f"Staging pool (peak utilization {max(util, default=0):.2%})")
    ax = axes[1][2]
    draw(ax, "transfers", lambda lb: f"transfers {lb.get('role')} {lb.get('direction')}")
    draw(ax, "failures", lambda lb: f"failures {lb.get('reason')}", linestyle="--")
    ax.set_title(f"Transfers and failures per second ({W} window)")
    for row in axes:
        for a in row:
            a.set_xlabel("seconds since start of load")
            a.grid(alpha=0.3)
            if a.get_legend_handles_labels()[0]:
                a.legend(fontsize=8, loc="upper left")
    fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="smollm2 (real) or tiny (random, fast)")
    ap.add_argument("--preset", default="tq4")
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--min-words", type=int, default=60)
    ap.add_argument("--max-words", type=int, default=300)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("bench/results/metrics_dashboard.png"))
    ap.add_argument("--logs", type=Path, default=Path("/tmp/tw-metrics-run"))
    ap.add_argument(
        "--replot",
        type=Path,
        default=None,
        help="redraw --out from a saved <out>.series.json without running engines",
    )
    args = ap.parse_args(argv)
    if args.replot is not None:
        collected = json.loads(args.replot.read_text())
        plot(collected, args.out, collected.get("title", "turbowire P/D run"))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)

    if args.model == "tiny":
        from turbowire.models import ensure_tiny_llama

        model_path = ensure_tiny_llama()
    else:
        from turbowire.models import ensure_smollm2

        model_path = ensure_smollm2()
    served = "m"
    p_spec = EngineSpec(
        "prefill",
        model_path,
        free_port(),
        cpu=0,
        served_model_name=served,
        kv_transfer_config=turbowire_kv_config(
            "kv_producer", preset=args.preset, side_channel_port=free_port()
        ),
    )
    d_spec = EngineSpec(
        "decode",
        model_path,
        free_port(),
        cpu=1,
        served_model_name=served,
        kv_transfer_config=turbowire_kv_config(
            "kv_consumer", preset=args.preset, side_channel_port=free_port()
        ),
    )
    with engine_lock(), ProcessGroup() as group:
        p = group.add(start_engine(p_spec, args.logs))
        d = group.add(start_engine(d_spec, args.logs))
        p.wait_healthy(300)
        d.wait_healthy(300)
        proxy_port = free_port()
        px = group.add(start_proxy([p.url], [d.url], proxy_port, args.logs,
                                   ["--expose-internals"]))  # a measurement: show the records
        px.wait_healthy(60)
        targets = {
            "vllm": [p.url[len("http://") :], d.url[len("http://") :]],
            "proxy": [px.url[len("http://") :]],
        }
        with LocalPrometheus(targets, scrape_interval_s=1.0, evaluation_interval_s=1.0) as prom:
            prom.wait_for_targets_up(60)
            start = time.time()
            ttfts = send_load(
                px.url,
                served,
                args.requests,
                args.concurrency,
                args.seed,
                args.max_tokens,
                (args.min_words, args.max_words),
            )
            time.sleep(12)  # vLLM logs stats every 10 s; let Prometheus scrape the last values
            end = time.time()
            rule = {
                s.labels["role"]: s.value
                for s in prom.query("turbowire:kv_compression_ratio:rate1m")
            }
            failures = prom.query_scalar("sum(turbowire_kv_transfer_failures_total)") or 0.0
            collected = collect(prom, start - 2, end)
        p_log, d_log = p.log_text(), d.log_text()
    title = (
        f"turbowire P/D run through Prometheus: {args.requests} requests, preset "
        f"{args.preset}, model {args.model}, scrape 1 s"
    )
    collected["title"] = title
    args.out.with_suffix(".series.json").write_text(json.dumps(collected) + "\n")
    plot(collected, args.out, title)
    summary = {
        "requests": args.requests,
        "preset": args.preset,
        "model": args.model,
        "client_ttft_mean_s": sum(ttfts) / len(ttfts),
        "rule_ratio": rule,
        "logged_ratio_sent": logged_ratio(p_log, "sent"),
        "logged_ratio_received": logged_ratio(d_log, "received"),
        "logged_totals_prefill": logged_transfer_totals(p_log),
        "logged_totals_decode": logged_transfer_totals(d_log),
        "failures": failures,
        "duration_s": end - start,
        "plot": str(args.out),
    }
    args.out.with_suffix(".json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
