"""A short real P/D run scraped by a real Prometheus, plotted like the Grafana dashboard.

Grafana is not installable here, so this draws the dashboard's key series from the Prometheus API
with matplotlib: compression ratio (the recording rule), wire vs dense throughput, transfer /
encode / decode latency quantiles, the TTFT breakdown, staging usage and transfers/failures.
It also checks the recording rule against the ratio the connector logged (vLLM's "KV Transfer
metrics:" lines) and prints both.

Run (holds the machine-wide engine lock while engines run)::

    python bench/metrics_run.py --preset tq4 --requests 24 --out bench/results/metrics_dashboard.png
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

from turbowire.connector.launch import (
    EngineSpec,
    ProcessGroup,
    engine_lock,
    free_port,
    start_engine,
    start_proxy,
    turbowire_kv_config,
)
from turbowire.metrics_summary import logged_ratio, logged_transfer_totals
from turbowire.prometheus_local import LocalPrometheus

logger = logging.getLogger("metrics_run")

WORDS = (
    "the compressed key value cache moves from the prefill engine to the decode engine over the "
    "wire and is decoded into paged blocks while the scheduler keeps leases on staging slots "
    "until the reader confirms it has every chunk of every layer"
).split()


def prompt(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def send_load(proxy_url: str, model: str, n: int, concurrency: int, seed: int,
              max_tokens: int) -> list[float]:
    """Streaming completions through the proxy; returns client-side TTFTs (s)."""
    rng = random.Random(seed)
    sizes = [rng.randint(150, 900) for _ in range(n)]

    def one(i: int) -> float:
        body = {"model": model, "prompt": prompt(rng, sizes[i]), "max_tokens": max_tokens,
                "temperature": 0, "stream": True}
        t0 = time.perf_counter()
        ttft = -1.0
        with httpx.stream("POST", proxy_url + "/v1/completions", json=body, timeout=300) as r:
            r.raise_for_status()
            for chunk in r.iter_bytes():
                if ttft < 0 and chunk.strip():
                    ttft = time.perf_counter() - t0
        return ttft

    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, range(n)))


def plot(prom: LocalPrometheus, start: float, end: float, out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    step = 2.0
    rng_q = "30s"

    def series(expr: str) -> list[tuple[dict[str, str], list[tuple[float, float]]]]:
        return prom.query_range(expr, start, end, step)

    def draw(ax, expr: str, label_fmt, scale: float = 1.0, **kw) -> None:
        for labels, values in series(expr):
            xs = [t - start for t, _ in values]
            ys = [v * scale for _, v in values]
            ax.plot(xs, ys, label=label_fmt(labels), **kw)

    fig, axes = plt.subplots(2, 3, figsize=(16, 8.5))
    ax = axes[0][0]
    draw(ax, "turbowire:kv_compression_ratio:rate1m",
         lambda lb: f"{lb.get('role')} {lb.get('preset')}")
    ax.set_title("Compression ratio (recording rule, 1m)")
    ax.set_ylabel("dense / wire")
    ax = axes[0][1]
    draw(ax, "sum by (role) (turbowire:kv_dense_bytes:rate1m)",
         lambda lb: f"dense {lb.get('role')}", scale=1 / 2**20)
    draw(ax, "sum by (role) (turbowire:kv_wire_bytes:rate1m)",
         lambda lb: f"wire {lb.get('role')}", scale=1 / 2**20, linestyle="--")
    ax.set_title("Wire vs dense throughput (1m rate)")
    ax.set_ylabel("MiB/s")
    ax = axes[0][2]
    for q in (0.5, 0.9):
        draw(ax, f"histogram_quantile({q}, sum by (le) (rate("
                 f"turbowire_kv_transfer_duration_seconds_bucket{{role='consumer'}}[{rng_q}])))",
             lambda lb, q=q: f"transfer p{int(q * 100)}", scale=1e3)
    draw(ax, "histogram_quantile(0.9, sum by (le) (rate("
             f"turbowire_kv_encode_duration_seconds_bucket[{rng_q}])))",
         lambda lb: "encode p90 (prefill)", scale=1e3, linestyle="--")
    draw(ax, "histogram_quantile(0.9, sum by (le) (rate("
             f"turbowire_kv_decode_duration_seconds_bucket[{rng_q}])))",
         lambda lb: "decode p90 (decode)", scale=1e3, linestyle=":")
    ax.set_title(f"Latency quantiles ({rng_q} window)")
    ax.set_ylabel("ms")
    ax = axes[1][0]

    def avg(metric: str, sel: str = "") -> str:
        return (f"sum(rate({metric}_sum{{{sel}}}[{rng_q}])) / "
                f"sum(rate({metric}_count{{{sel}}}[{rng_q}]))")

    d_xfer = avg("turbowire_kv_transfer_duration_seconds", "role='consumer'")
    parts = [
        ("prefill", avg("turbowire_proxy_prefill_duration_seconds")),
        ("kv transfer", d_xfer),
        ("first decode", f"clamp_min({avg('turbowire_proxy_decode_ttft_seconds')} - ({d_xfer}), 0)"),
    ]
    grid = None
    stack = []
    for name, expr in parts:
        res = series(expr)
        if not res:
            continue
        values = dict(res[0][1])
        grid = sorted(values) if grid is None else grid
        stack.append((name, [values.get(t, 0.0) * 1e3 for t in grid]))
    if grid and stack:
        ax.stackplot([t - start for t in grid], *[v for _, v in stack],
                     labels=[n for n, _ in stack], alpha=0.8)
    ax.set_title(f"TTFT breakdown, mean ({rng_q} window)")
    ax.set_ylabel("ms")
    ax = axes[1][1]
    draw(ax, "sum by (role) (turbowire_staging_in_use_bytes)",
         lambda lb: f"in use {lb.get('role')}", scale=1 / 2**20)
    draw(ax, "sum by (role) (turbowire_staging_capacity_bytes) > 0",
         lambda lb: f"capacity {lb.get('role')}", scale=1 / 2**20, linestyle="--")
    ax2 = ax.twinx()
    for labels, values in series("sum by (role) (turbowire_leases_outstanding)"):
        ax2.step([t - start for t, _ in values], [v for _, v in values], where="post",
                 color="gray", alpha=0.6, label=f"leases {labels.get('role')}")
    ax2.set_ylabel("leases")
    ax.set_title("Staging pool")
    ax.set_ylabel("MiB")
    ax = axes[1][2]
    draw(ax, f"sum by (role, direction) (rate(turbowire_kv_transfers_total[{rng_q}]))",
         lambda lb: f"transfers {lb.get('role')} {lb.get('direction')}")
    draw(ax, f"sum by (reason) (rate(turbowire_kv_transfer_failures_total[{rng_q}]))",
         lambda lb: f"failures {lb.get('reason')}", linestyle="--")
    ax.set_title(f"Transfers and failures per second ({rng_q} window)")
    for row in axes:
        for a in row:
            a.set_xlabel("seconds since start of load")
            a.grid(alpha=0.3)
            if a.get_legend_handles_labels()[0]:
                a.legend(fontsize=8, loc="best")
    fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="smollm2 (real) or tiny (random, fast)")
    ap.add_argument("--preset", default="tq4")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("bench/results/metrics_dashboard.png"))
    ap.add_argument("--logs", type=Path, default=Path("/tmp/tw-metrics-run"))
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)

    if args.model == "tiny":
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "e2e"))
        from connector_tiny_model import ensure_tiny_llama

        model_path = ensure_tiny_llama()
    else:
        from turbowire.models import ensure_smollm2

        model_path = ensure_smollm2()
    served = "m"
    p_spec = EngineSpec(
        "prefill", model_path, free_port(), cpu=0, served_model_name=served,
        kv_transfer_config=turbowire_kv_config(
            "kv_producer", preset=args.preset, side_channel_port=free_port()),
    )
    d_spec = EngineSpec(
        "decode", model_path, free_port(), cpu=1, served_model_name=served,
        kv_transfer_config=turbowire_kv_config(
            "kv_consumer", preset=args.preset, side_channel_port=free_port()),
    )
    with engine_lock(), ProcessGroup() as group:
        p = group.add(start_engine(p_spec, args.logs))
        d = group.add(start_engine(d_spec, args.logs))
        p.wait_healthy(300)
        d.wait_healthy(300)
        proxy_port = free_port()
        px = group.add(start_proxy([p.url], [d.url], proxy_port, args.logs))
        px.wait_healthy(60)
        targets = {"vllm": [p.url[len("http://"):], d.url[len("http://"):]],
                   "proxy": [px.url[len("http://"):]]}
        with LocalPrometheus(targets, scrape_interval_s=1.0, evaluation_interval_s=1.0) as prom:
            prom.wait_for_targets_up(60)
            start = time.time()
            ttfts = send_load(px.url, served, args.requests, args.concurrency, args.seed,
                              args.max_tokens)
            time.sleep(12)  # vLLM logs stats every 10 s; let Prometheus scrape the last values
            end = time.time()
            rule = {s.labels["role"]: s.value
                    for s in prom.query("turbowire:kv_compression_ratio:rate1m")}
            failures = prom.query_scalar("sum(turbowire_kv_transfer_failures_total)") or 0.0
            plot(prom, start - 2, end, args.out,
                 f"turbowire P/D run: {args.requests} requests, preset {args.preset}, "
                 f"model {args.model} (Prometheus {prom.url.split(':')[-1]} scrape 1 s)")
        p_log, d_log = p.log_text(), d.log_text()
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
