"""Unit tests of the end-to-end benchmark's logic: results, ratios, tables, plan, prompts, tbf."""

from __future__ import annotations

import pytest

from turbowire.bench_e2e.engines import (
    ConnectorConfig,
    EnginePair,
    EngineSettings,
    kv_transfer_config,
)
from turbowire.bench_e2e.link import EmulatedLink, LinkConfig, tbf_params
from turbowire.bench_e2e.model import BenchModelSpec, make_prompt
from turbowire.bench_e2e.results import (
    CellResult,
    RequestResult,
    add_ratios,
    breakdown_table,
    handoff_times,
    markdown_table,
    match_events,
    median,
    prom_sum,
    rate_label,
    summarize,
)
from turbowire.bench_e2e.run import BenchPlan, PromptFactory


def _req(config: str, handoff: float | None, ok: bool = True, **kw: float) -> RequestResult:
    return RequestResult(config=config, rate_gbit=1.0, length=2000, concurrency=1,
                         request_id="x", ok=ok, handoff_s=handoff, **kw)


def test_model_spec_matches_llama3_8b_kv_geometry_per_layer() -> None:
    spec = BenchModelSpec()
    assert (spec.num_kv_heads, spec.head_dim) == (8, 128)
    assert spec.kv_bytes_per_token == 8 * 2 * 8 * 128 * 2 == 32 * 1024
    with pytest.raises(ValueError, match="multiple of"):
        BenchModelSpec(num_attention_heads=12)


def test_prompts_have_exact_length_avoid_specials_and_depend_on_seed() -> None:
    a = make_prompt(2000, 4096, seed=1)
    assert len(a) == 2000 and min(a) >= 3 and max(a) < 4096
    assert a == make_prompt(2000, 4096, seed=1)
    assert a != make_prompt(2000, 4096, seed=2)
    with pytest.raises(ValueError):
        make_prompt(0, 4096, seed=1)


def test_primed_prompts_share_the_base_and_differ_in_the_tail() -> None:
    plan = BenchPlan(configs=(ConnectorConfig.parse("nixl"),), lengths=(1000,), tail_tokens=64)
    f = PromptFactory(plan, 4096)
    p1, p2 = f.next(1000), f.next(1000)
    assert len(p1) == len(p2) == 1000
    assert p1[:936] == p2[:936] == f.bases[1000][:936]
    assert p1[936:] != p2[936:]
    # the same sequence for every connector config (fair comparison)
    g = PromptFactory(plan, 4096)
    assert g.next(1000) == p1


def test_fresh_prompts_are_all_distinct() -> None:
    plan = BenchPlan(configs=(ConnectorConfig.parse("nixl"),), lengths=(1000,), mode="fresh")
    f = PromptFactory(plan, 4096)
    p1, p2 = f.next(1000), f.next(1000)
    assert p1[:64] != p2[:64]


def test_plan_validation_messages() -> None:
    nixl = (ConnectorConfig.parse("nixl"),)
    with pytest.raises(ValueError, match="mode"):
        BenchPlan(configs=nixl, mode="warm")
    with pytest.raises(ValueError, match="rates"):
        BenchPlan(configs=nixl, rates=(0.0,))
    with pytest.raises(ValueError, match="tail_tokens"):
        BenchPlan(configs=nixl, lengths=(100,), tail_tokens=64)
    with pytest.raises(ValueError, match="at least one"):
        BenchPlan(configs=())
    full = BenchPlan.full(nixl)
    assert full.lengths == (1000, 2000, 4000, 8000)
    assert full.cell_count() == 1 * 4 * 4 * 2


def test_connector_spec_parsing_and_kv_transfer_config() -> None:
    assert ConnectorConfig.parse("tw:tq4") == ConnectorConfig("tw-tq4", "turbowire", "tq4")
    with pytest.raises(ValueError, match="tw:<preset>"):
        ConnectorConfig.parse("lmcache")
    with pytest.raises(ValueError, match="preset"):
        ConnectorConfig("tw", "turbowire")
    p = kv_transfer_config(ConnectorConfig.parse("nixl"), "prefill", "10.0.0.1", 5610, "veth0")
    d = kv_transfer_config(ConnectorConfig.parse("nixl"), "decode", "10.0.0.2", 5611, "veth1")
    assert (p["kv_role"], d["kv_role"]) == ("kv_producer", "kv_consumer")
    assert p["kv_connector"] == "TimedNixlConnector"
    t = kv_transfer_config(ConnectorConfig.parse("tw:k4v3"), "decode", "10.0.0.2", 5611, "veth1")
    extra = t["kv_connector_extra_config"]
    assert (extra["preset"], extra["side_channel_host"], extra["side_channel_port"]) == (
        "k4v3", "10.0.0.2", 5611)


def test_engine_pair_specs_put_each_side_on_its_link_address_and_core(tmp_path) -> None:
    link = EmulatedLink()  # not created: only its names and addresses are read
    pair = EnginePair(link, ConnectorConfig.parse("tw:tq4"), EngineSettings(tmp_path / "m"),
                      tmp_path, tmp_path / "events.jsonl")
    c = link.config
    p, d = pair.engine_spec("prefill"), pair.engine_spec("decode")
    assert (p.url, d.url) == (pair.prefill_url, pair.decode_url)
    assert (p.host, d.host, p.cpu, d.cpu) == (c.root_addr, c.ns_addr, 0, 1)
    assert "--enable-prefix-caching" in p.command()
    assert "--no-enable-prefix-caching" in d.command()
    cmd = d.command()
    assert cmd[cmd.index("--served-model-name") + 1] == "bench"
    assert cmd[cmd.index("--block-size") + 1] == "128"
    env = d.environment()
    assert (env["UCX_NET_DEVICES"], env["VLLM_NIXL_SIDE_CHANNEL_HOST"]) == (c.ns_if, c.ns_addr)
    assert (env["VLLM_CPU_OMP_THREADS_BIND"], env["VLLM_CPU_KVCACHE_SPACE"]) == ("1", "3")
    assert env["TW_BENCH_ROLE"] == "D" and env["TW_BENCH_EVENTS"] == str(tmp_path / "events.jsonl")


def test_engine_settings_reject_cpu_unfriendly_block_size(tmp_path) -> None:
    with pytest.raises(ValueError, match="block_size"):
        EngineSettings(tmp_path, block_size=48)


def test_tbf_bucket_holds_a_tick_and_queue_holds_50ms() -> None:
    burst, limit = tbf_params(10.0)
    assert burst >= 10e9 / 8 * 0.010 and limit >= 10e9 / 8 * 0.050
    burst, limit = tbf_params(0.2)
    assert burst == 256 * 1024 and limit > burst
    with pytest.raises(ValueError):
        tbf_params(0)


def test_link_names_are_unique_per_pid_and_fit_ifnamsiz() -> None:
    a, b = LinkConfig(owner_pid=1234567), LinkConfig(owner_pid=1234568)
    assert a.netns != b.netns and a.root_if != b.root_if
    assert len(a.root_if) <= 15 and a.root_addr != a.ns_addr
    with pytest.raises(ValueError):
        LinkConfig(owner_pid=0)


def test_match_events_by_substring_first_occurrence_wins() -> None:
    events = [
        {"ev": "prefill_done", "req": "cmpl-abc-0-11", "t": 10.0},
        {"ev": "load_queued", "req": "cmpl-abc-0-22", "t": 10.2},
        {"ev": "load_done", "req": "cmpl-abc-0-22", "t": 11.5},
        {"ev": "load_done", "req": "cmpl-abc-0-22", "t": 12.0},
        {"ev": "load_done", "req": "cmpl-zzz-0-22", "t": 99.0},
    ]
    marks = match_events(events, "abc")
    assert marks == {"prefill_done": 10.0, "load_queued": 10.2, "load_done": 11.5}
    handoff, pull = handoff_times(marks)
    assert handoff == pytest.approx(1.5) and pull == pytest.approx(1.3)
    assert handoff_times({"prefill_done": 1.0}) == (None, None)


def test_summarize_uses_medians_and_per_request_bytes() -> None:
    reqs = [_req("nixl", 1.0), _req("nixl", 3.0), _req("nixl", 2.0), _req("nixl", None, ok=False)]
    cell = summarize("nixl", 1.0, 2000, 1, reqs, link_bytes=300, connector_bytes=270.0,
                     dense_bytes_per_token=32768, breakdown_totals={"D decode s": 3.0})
    assert (cell.n_ok, cell.n_failed) == (3, 1)
    assert cell.handoff_s == 2.0
    assert cell.wire_bytes == 100 and cell.connector_bytes == 90
    assert cell.dense_bytes == 2000 * 32768
    assert cell.breakdown == {"D decode s": 1.0}
    empty = summarize("nixl", 1.0, 2000, 1, [_req("nixl", None, ok=False)], link_bytes=5)
    assert empty.n_ok == 0 and empty.wire_bytes is None and empty.handoff_s is None


def test_ratios_are_relative_to_the_same_nixl_cell() -> None:
    base = CellResult("nixl", 1.0, 2000, 1, 2, 0, handoff_s=2.0, decode_request_s=4.0,
                      decode_ttft_s=3.0, ttft_s=5.0, wire_bytes=100.0)
    tw = CellResult("tw-tq4", 1.0, 2000, 1, 2, 0, handoff_s=0.5, decode_request_s=1.0,
                    decode_ttft_s=1.5, ttft_s=2.5, wire_bytes=25.0)
    other = CellResult("tw-tq4", 0.2, 2000, 1, 2, 0, handoff_s=0.5)
    add_ratios([base, tw, other])
    assert tw.ratios == {"handoff_s": 0.25, "decode_ttft_s": 0.5, "decode_request_s": 0.25,
                         "ttft_s": 0.5, "wire_bytes": 0.25}
    assert base.ratios["handoff_s"] == 1.0
    assert other.ratios == {}  # no baseline cell at 0.2G
    table = markdown_table([tw, base, other])
    lines = table.splitlines()
    assert len(lines) == 5 and all(line.count("|") == 18 for line in lines)
    # ordered by rate, then the baseline first within a cell
    assert "| 0.2G |" in lines[2] and "| nixl |" in lines[3] and "0.25" in lines[4]


def test_breakdown_table_lists_phases_only_for_cells_that_have_them() -> None:
    a = CellResult("tw-tq4", 10.0, 2000, 1, 1, 0, handoff_s=1.0,
                   breakdown={"P encode s": 2.0, "D decode s": 0.5})
    b = CellResult("nixl", 10.0, 2000, 1, 1, 0)
    t = breakdown_table([a, b])
    assert "P encode s" in t and "tw-tq4" in t and "nixl" not in t
    assert breakdown_table([b]) == ""


def test_prom_sum_adds_all_label_sets_and_ignores_comments() -> None:
    text = (
        "# HELP x y\n"
        'vllm:nixl_bytes_transferred_sum{engine="0",model_name="m"} 1.5e6\n'
        'vllm:nixl_bytes_transferred_sum{engine="1"} 5e5\n'
        "vllm:nixl_bytes_transferred_count 2\n"
        "turbowire_kv_wire_bytes_total 7\n"
    )
    assert prom_sum(text, "vllm:nixl_bytes_transferred_sum") == 2e6
    assert prom_sum(text, "turbowire_kv_wire_bytes_total") == 7
    assert prom_sum(text, "missing") == 0


def test_median_and_labels() -> None:
    assert median([None, 3.0, 1.0, float("nan")]) == 2.0
    assert median([None]) is None
    assert [rate_label(r) for r in (0.2, 1.0, 10.0, None)] == ["0.2G", "1G", "10G", "unshaped"]


def test_scan_logs_counts_findings_before_shutdown_only(tmp_path) -> None:
    from turbowire.bench_e2e.run import scan_logs

    (tmp_path / "nixl-prefill.log").write_text(
        "WARNING Releasing expired KV blocks for request a\n"
        "ERROR Potentially invalid KV blocks for unrecognized request a\n"
        "INFO KV Transfer metrics: Num successful transfers=2, Num failed transfers=0\n"
        "INFO [shutdown] API server: shutdown triggered\n"
        "Traceback (most recent call last):\n")
    (tmp_path / "nixl-decode.log").write_text(
        "INFO KV Transfer metrics: Num failed transfers=3\n")
    found = scan_logs(tmp_path, "nixl")
    assert found == {"prefill:lease_expired": 1, "prefill:invalid_blocks_read": 1,
                     "decode:nixl_failed_transfers": 1}
    assert scan_logs(tmp_path, "missing") == {}
