"""CI slice of ``turbowire soak``: 100 seeded requests at concurrency 8 through the real proxy to
a prefill + decode pair (tiny model, preset tq4, 5-second leases), 10 of them closed by the client
before the first token or mid-stream; the bounds of the full run must hold (no failed request,
staging and KV usage back to baseline, no fd/thread/RSS growth beyond the bounds, sampled greedy
outputs equal to a replay up to near-tie flips)."""

from __future__ import annotations

import json
import time

import pytest

from turbowire.serving.soak import SoakConfig, run_soak

pytestmark = pytest.mark.e2e


def test_soak_100_requests(tiny_model, engine_slot, tmp_path, monkeypatch):
    # the session already holds the machine-wide engine lock (engine_slot): run_soak must not
    # take it a second time (flock from a second open file of the same process would block)
    monkeypatch.setenv("TW_ENGINE_LOCK_HELD", "1")
    # 50 warm-up requests: the prefill worker's RSS rises until the seeded mix's prompt shapes
    # have all passed through oneDNN's (bounded) primitive cache and glibc's arenas, then stays
    # flat. With 30, one CI run measured +52.9 MiB over requests 31-100 against a bound of 49.5,
    # all of it by request 72 and +3.4 MiB over the 28 after it: warm-up, not a per-request leak
    # (a leak keeps growing; `make soak`'s 1000 requests hold the same bounds).
    cfg = SoakConfig(requests=100, concurrency=8, abort_fraction=0.1, seed=2, preset="tq4",
                     warmup_requests=50)
    t0 = time.monotonic()
    report = run_soak(cfg, model=tiny_model, log_dir=tmp_path / "logs")
    result = report.to_dict() | {"wall_s": time.monotonic() - t0}
    (tmp_path / "soak.json").write_text(json.dumps(result, indent=2))
    assert len(report.outcomes) == 100
    assert report.count("ok") + report.aborted == 100, result["failures"]
    # the client really went away in both places (seeded plan: 5 early and 5 mid-stream aborts)
    assert report.count("aborted_before_first_token") >= 1, result
    assert report.count("aborted_mid_stream") >= 1, result
    assert report.greedy_checked >= 8
    # the engines ran with oneDNN's per-shape GEMM cache bounded (the soak's default engine env):
    # at oneDNN's default capacity a CPU prefill worker grows with every new prompt length
    # whatever the connector does (bench/prefill_rss.py), which would hide a leak of ours
    assert cfg.engine_env.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY"), cfg.engine_env
    violated = [c for c in report.checks if not c.ok]
    assert not violated, (violated, result["failures"], f"logs: {tmp_path / 'logs'}")
    rss = {c.name: c.value for c in report.checks if "RSS" in c.name}
    assert set(rss) == {"prefill tree RSS growth (bytes)", "decode tree RSS growth (bytes)"}, rss
