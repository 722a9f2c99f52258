"""Unit tests of ``turbowire bench serve`` and ``turbowire bench multiround`` without engines:
the ShareGPT-like dataset (checked with vLLM's own loader), the client's argument list (parsed
by vLLM's own ``vllm bench serve`` parser), result parsing (a result JSON saved by a real run),
the Pareto front, the CSV and table writers, the multi-round workload and the CLI's validation.
The client worker runs for real (vLLM imported in a subprocess) on arguments vLLM refuses."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from turbowire.bench_e2e.engines import ConnectorConfig
from turbowire.bench_e2e.multiround import (
    MultiroundPlan,
    RoundRecord,
    RoundSources,
    StackConfig,
    build_workload,
    prompt_sources,
    sources_table,
    ttft_table,
)
from turbowire.bench_e2e.serve import (
    CSV_COLUMNS,
    ClientWorker,
    ServePlan,
    ServeRow,
    bench_serve_args,
    build_sharegpt,
    markdown_tables,
    pareto_front,
    parse_result,
    read_csv,
    word_count,
    write_csv,
    write_sharegpt,
)
from turbowire.cli import app
from turbowire.quality.corpus import load_corpus

DATA = Path(__file__).resolve().parents[1] / "data" / "bench_serve"
#: saved by `vllm bench serve --save-result` in the recorded run
#: (bench/results/serve/runs/tw-tq4_1G_random_c4.json)
RESULT_JSON = DATA / "vllm_bench_serve_result.json"

CONFIGS = tuple(ConnectorConfig.parse(c) for c in ("nixl", "tw:raw", "tw:tq4"))


def _plan(**kw: object) -> ServePlan:
    return ServePlan(configs=kw.pop("configs", CONFIGS), **kw)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# the ShareGPT-like dataset


@pytest.fixture(scope="module")
def corpus() -> str:
    return load_corpus()


def test_sharegpt_is_deterministic_per_seed(corpus: str) -> None:
    a = build_sharegpt(corpus, 20, seed=3)
    assert a == build_sharegpt(corpus, 20, seed=3)
    b = build_sharegpt(corpus, 20, seed=4)
    assert [e["conversations"] for e in a] != [e["conversations"] for e in b]
    assert len({e["id"] for e in a}) == 20


def test_sharegpt_lengths_stay_within_the_ranges(corpus: str) -> None:
    entries = build_sharegpt(corpus, 60, seed=0, prompt_tokens=(32, 500),
                             output_tokens=(16, 100))
    prompts = [word_count(e["conversations"][0]["value"]) for e in entries]
    answers = [word_count(e["conversations"][1]["value"]) for e in entries]
    assert all(p <= 500 for p in prompts) and all(a <= 100 for a in answers)
    # log-uniform lengths: short and long prompts both occur
    assert min(prompts) < 100 < max(prompts)
    assert all(e["conversations"][0]["from"] == "human" for e in entries)
    assert all(e["conversations"][1]["from"] == "gpt" for e in entries)


@pytest.mark.parametrize("kw", [{"prompt_tokens": (32, 2000)}, {"output_tokens": (2, 50)},
                                {"prompt_tokens": (900, 1000), "output_tokens": (100, 1200)}])
def test_sharegpt_refuses_lengths_vllm_would_drop(corpus: str, kw: dict) -> None:
    with pytest.raises(ValueError, match="ShareGPT loader"):
        build_sharegpt(corpus, 4, **kw)


class _WordTokenizer:
    """vLLM's ShareGPT loader calls ``tokenizer(text).input_ids``; words stand in for tokens."""

    def __call__(self, text: str) -> SimpleNamespace:
        return SimpleNamespace(input_ids=text.split())


def test_vllms_own_sharegpt_loader_keeps_every_entry(corpus: str, tmp_path: Path) -> None:
    from vllm.benchmarks.datasets import ShareGPTDataset

    entries = build_sharegpt(corpus, 40, seed=1)
    path = write_sharegpt(tmp_path / "sharegpt_like.json", entries)
    assert json.loads(path.read_text()) == entries
    samples = ShareGPTDataset(dataset_path=str(path), random_seed=0).sample(
        tokenizer=_WordTokenizer(), num_requests=40, no_oversample=True)
    assert len(samples) == 40  # none dropped as too short or too long
    by_prompt = {e["conversations"][0]["value"]: e for e in entries}
    for s in samples:
        e = by_prompt[s.prompt]
        assert s.prompt_len == word_count(s.prompt)
        assert s.expected_output_len == word_count(e["conversations"][1]["value"])


# ---------------------------------------------------------------------------------------------
# the plan and the client's arguments


def test_plan_defaults_and_run_order() -> None:
    plan = _plan()
    runs = plan.runs()
    assert len(runs) == 3 * 2 * 2 * 4
    assert [plan.prompts_for(c) for c in (1, 2, 4, 8)] == [6, 8, 12, 20]
    assert _plan(num_prompts=5).prompts_for(8) == 5
    # a config's runs are contiguous (its stack starts once), links next (one tc change each)
    assert [r.config for r in runs[:16]] == ["nixl"] * 16
    assert [r.link for r in runs[:16]] == ["unshaped"] * 8 + ["1G"] * 8
    assert runs[0].name == "nixl_unshaped_random_c1"
    assert plan.max_model_len() % 32 == 0 and plan.max_model_len() >= 2048


@pytest.mark.parametrize("kw,match", [
    ({"configs": ()}, "at least one"),
    ({"configs": (CONFIGS[0], CONFIGS[0])}, "repeat"),
    ({"links": ()}, "at least one link"),
    ({"links": (0.0,)}, "> 0"),
    ({"datasets": ("sharegpt", "lmsys")}, "datasets"),
    ({"concurrencies": (0, 2)}, "concurrencies"),
    ({"num_prompts": -1}, "num_prompts"),
    ({"input_len": 0}, "input_len"),
])
def test_plan_refuses_bad_values(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _plan(**kw)


@pytest.fixture(scope="module")
def vllm_parser():
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    return parser


@pytest.mark.parametrize("dataset", ["random", "sharegpt"])
def test_client_arguments_parse_with_vllms_own_parser(vllm_parser, dataset: str,
                                                      tmp_path: Path) -> None:
    plan = _plan(input_len=512, output_len=32)
    run = next(r for r in plan.runs() if r.dataset == dataset and r.concurrency == 4)
    argv = bench_serve_args(plan, run, base_url="http://127.0.0.1:9", tokenizer=tmp_path,
                            result_dir=tmp_path / "runs", dataset_path=tmp_path / "d.json")
    args = vllm_parser.parse_args(argv)
    assert args.dataset_name == dataset and args.max_concurrency == 4
    assert args.num_prompts == 12 and args.save_result and args.ignore_eos
    assert args.base_url == "http://127.0.0.1:9" and args.endpoint == "/v1/completions"
    assert args.result_filename == f"{run.name}.json"
    assert {"tw_config=nixl", f"tw_dataset={dataset}"} <= set(args.metadata)
    if dataset == "random":
        assert (args.random_input_len, args.random_output_len) == (512, 32)
        assert args.dataset_path is None  # vLLM refuses a path with the random dataset
    else:
        assert args.dataset_path == str(tmp_path / "d.json")


def test_sharegpt_run_needs_its_file(tmp_path: Path) -> None:
    plan = _plan(datasets=("sharegpt",))
    with pytest.raises(ValueError, match="dataset_path"):
        bench_serve_args(plan, plan.runs()[0], base_url="http://x", tokenizer=tmp_path,
                         result_dir=tmp_path, dataset_path=None)


# ---------------------------------------------------------------------------------------------
# results


def test_parse_a_real_saved_result() -> None:
    data = json.loads(RESULT_JSON.read_text())
    row = parse_result(data, result_file="runs/x.json", measured_gbit=0.9, load1=2.5)
    assert row.config == data["tw_config"] and row.link == data["tw_link"]
    assert row.dataset == data["tw_dataset"]
    assert row.concurrency == data["max_concurrency"]
    assert row.completed == data["completed"] and row.failed == data["failed"]
    assert row.output_throughput == pytest.approx(data["output_throughput"])
    assert row.tok_s_user == pytest.approx(data["output_throughput"] / data["max_concurrency"])
    assert row.median_ttft_ms == pytest.approx(data["median_ttft_ms"])
    assert row.p99_itl_ms == pytest.approx(data["p99_itl_ms"])
    assert (row.measured_gbit, row.load1, row.result_file) == (0.9, 2.5, "runs/x.json")


def test_parse_refuses_what_is_not_a_result() -> None:
    data = json.loads(RESULT_JSON.read_text())
    del data["output_throughput"]
    with pytest.raises(ValueError, match="output_throughput"):
        parse_result(data)
    with pytest.raises(ValueError, match="max_concurrency"):
        parse_result({**json.loads(RESULT_JSON.read_text()), "max_concurrency": 0})


def test_a_result_without_metadata_reads_as_unknown() -> None:
    data = {k: v for k, v in json.loads(RESULT_JSON.read_text()).items()
            if not k.startswith("tw_")}
    row = parse_result(data)
    assert (row.config, row.link, row.dataset) == ("?", "?", "?")


@pytest.mark.parametrize("points,front", [
    ([], []),
    ([(1.0, 1.0)], [0]),
    ([(1.0, 10.0), (2.0, 8.0), (1.5, 7.0), (3.0, 2.0)], [0, 1, 3]),  # (1.5, 7) is beaten by (2, 8)
    ([(1.0, 5.0), (1.0, 5.0)], [0, 1]),  # equal points beat neither
    ([(1.0, 5.0), (1.0, 6.0)], [1]),  # same x, more y wins
])
def test_pareto_front(points: list[tuple[float, float]], front: list[int]) -> None:
    assert sorted(pareto_front(points)) == front


def _row(config: str, conc: int, **kw: object) -> ServeRow:
    base = dict(config=config, link="1G", dataset="random", concurrency=conc,
                num_prompts=2 * conc + 4, completed=2 * conc + 4, failed=0, duration_s=20.0,
                request_throughput=0.5, output_throughput=30.0 * conc ** 0.5,
                total_token_throughput=500.0, tok_s_user=30.0 / conc ** 0.5,
                median_ttft_ms=1234.5, p99_ttft_ms=98765.4, median_tpot_ms=36.2,
                p99_itl_ms=321.0, result_file=f"runs/{config}_{conc}.json")
    base.update(kw)
    return ServeRow(**base)  # type: ignore[arg-type]


def test_csv_round_trip(tmp_path: Path) -> None:
    rows = [_row("nixl", 1), _row("tw-tq4", 8, failed=2, completed=18, mean_itl_ms=None)]
    path = write_csv(rows, tmp_path / "serve.csv")
    assert path.read_text().splitlines()[0].split(",") == list(CSV_COLUMNS)
    back = read_csv(path)
    assert [(r.config, r.concurrency, r.failed, r.mean_itl_ms) for r in back] == [
        ("nixl", 1, 0, None), ("tw-tq4", 8, 2, None)]
    assert back[1].output_throughput == pytest.approx(rows[1].output_throughput, abs=1e-3)


def test_tables_fit_80_columns_and_group_by_link_and_dataset() -> None:
    rows = [_row(c, n, link=link, dataset=ds, failed=1 if (c, n) == ("tw-k4v3", 8) else 0)
            for link in ("unshaped", "0.2G") for ds in ("random", "sharegpt")
            for c in ("nixl", "tw-raw", "tw-tq4", "tw-k4v3") for n in (1, 2, 4, 8, 64)]
    text = markdown_tables(rows, dataset_notes={"random": "1024 in / 64 out"})
    assert max(len(line) for line in text.splitlines()) <= 80
    titles = [line for line in text.splitlines() if line.startswith("**")]
    assert titles == ["**link unshaped, dataset random (1024 in / 64 out)**",
                      "**link unshaped, dataset sharegpt**",
                      "**link 0.2G, dataset random (1024 in / 64 out)**",
                      "**link 0.2G, dataset sharegpt**"]
    assert "98765" in text and "failed requests: tw-k4v3 C=8: 1 of 20" in text
    # rows by concurrency, configs in their order
    first = text.split("**link unshaped, dataset sharegpt**")[0]
    order = [line.split("|")[2].strip() for line in first.splitlines()
             if line.startswith("| ") and "config" not in line]
    assert order[:4] == ["nixl", "tw-raw", "tw-tq4", "tw-k4v3"]


def test_text_table_pads_and_aligns() -> None:
    from turbowire.bench_e2e.serve import text_table

    t = text_table(["round", "config", "TTFT"], [["1", "tw-tq4", "1234"], ["10", "x", "5"]],
                   left=2)
    assert t.splitlines() == ["| round | config | TTFT |",
                              "|-------|--------|-----:|",
                              "| 1     | tw-tq4 | 1234 |",
                              "| 10    | x      |    5 |"]
    assert text_table(["a", "bb"], []).splitlines() == ["| a | bb |", "|---|----|"]


def test_pareto_plot_is_written(tmp_path: Path) -> None:
    from turbowire.bench_e2e.serve import plot_pareto

    rows = [_row(c, n, dataset=ds) for ds in ("random", "sharegpt") for c in ("nixl", "tw-tq4")
            for n in (1, 2, 4, 8)]
    path = plot_pareto(rows, tmp_path / "pareto.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------------------------------
# the client worker (a real subprocess importing vLLM)


def test_client_worker_reports_refused_arguments_and_keeps_serving(tmp_path: Path) -> None:
    with ClientWorker(tmp_path) as worker:
        bad = worker.run(["--backend", "no-such-backend"], tmp_path / "a.log", 300)
        assert bad["ok"] is False and "status 2" in bad["error"]
        assert "invalid choice" in (tmp_path / "a.log").read_text()
        # the same process answers the next run (vLLM stays imported)
        pid = worker.proc.pid if worker.proc else None
        missing = worker.run(["--dataset-name", "sharegpt", "--model", "m", "--tokenizer",
                              str(tmp_path / "no-tokenizer")], tmp_path / "b.log", 300)
        assert missing["ok"] is False and missing["error"]
        assert worker.proc is not None and worker.proc.pid == pid
    assert worker.proc is None


# ---------------------------------------------------------------------------------------------
# multi-round QA


def test_stack_configs() -> None:
    plain = StackConfig.parse("tw:tq4")
    store = StackConfig.parse("tw:tq4+store")
    assert (plain.label, store.label) == ("tw-tq4", "tw-tq4+store")
    assert plain.connector(None) == plain.conn
    conn = store.connector("redis://10.0.0.1:6379")
    assert conn.label == "tw-tq4+store" and conn.preset == "tq4"
    assert conn.extra["transport"] == "both" and conn.extra["store_url"] == "redis://10.0.0.1:6379"
    with pytest.raises(ValueError, match="store's URL"):
        store.connector(None)
    with pytest.raises(ValueError, match="needs 'tw:<preset>'"):
        StackConfig.parse("nixl+store")
    with pytest.raises(ValueError, match="only suffix"):
        StackConfig.parse("tw:tq4+disk")


@pytest.mark.parametrize("kw,match", [
    ({"configs": ()}, "at least one"),
    ({"users": 0}, ">= 1"),
    ({"cache_modes": ("evict", "flush")}, "cache modes"),
    ({"cache_modes": ("keep", "keep")}, "cache modes"),
    ({"link": -1.0}, "> 0"),
])
def test_multiround_plan_refuses_bad_values(kw: dict, match: str) -> None:
    kw.setdefault("configs", (StackConfig.parse("tw:tq4"),))
    with pytest.raises(ValueError, match=match):
        MultiroundPlan(**kw)


def test_workload_is_deterministic_and_sized() -> None:
    plan = MultiroundPlan(configs=(StackConfig.parse("tw:tq4"),), users=3, rounds=4,
                          system_tokens=200, question_tokens=20, answer_tokens=10)
    corpus_ids = list(range(5000))
    w = build_workload(corpus_ids, plan, seed=7)
    assert w == build_workload(corpus_ids, plan, seed=7)
    assert build_workload(corpus_ids, plan, seed=8).system != w.system  # modes never share
    assert len(w.system) == 200 and len(w.questions) == 3
    assert all(len(q) == 20 for user in w.questions for q in user)
    assert all(len(user) == 4 for user in w.questions)
    assert [plan.prompt_tokens(r) for r in range(4)] == [220, 250, 280, 310]
    with pytest.raises(ValueError, match="too short"):
        build_workload(list(range(300)), plan, seed=0)


def test_prompt_sources_from_prometheus_text() -> None:
    text = "\n".join([
        "# TYPE vllm:prompt_tokens_by_source counter",
        'vllm:prompt_tokens_by_source_total{engine="0",model_name="b",source="local_compute"}'
        " 1200.0",
        'vllm:prompt_tokens_by_source_total{engine="0",model_name="b",source="local_cache_hit"}'
        " 512.0",
        'vllm:prompt_tokens_by_source_total{engine="0",model_name="b",'
        'source="external_kv_transfer"} 256.0',
        "# TYPE vllm:other counter",
        'vllm:other_total{source="local_compute"} 9.0',
    ])
    assert prompt_sources(text) == {"local_compute": 1200.0, "local_cache_hit": 512.0,
                                    "external_kv_transfer": 256.0}


def test_multiround_tables() -> None:
    recs = []
    for cfg, base in (("tw-tq4", 2.0), ("tw-tq4+store", 0.5)):
        for rnd in (1, 2):
            for u in range(3):
                recs.append(RoundRecord(cfg, "evict", rnd, u, 1600 + 160 * rnd, ok=u != 2 or
                                        cfg == "tw-tq4", ttft_s=base * rnd + u * 0.1,
                                        route="store_hit" if cfg.endswith("store") and rnd == 2
                                        else "pd"))
    table = ttft_table(recs, "evict", ["tw-tq4", "tw-tq4+store"])
    lines = table.splitlines()
    assert "ratio" in lines[0] and max(len(line) for line in lines) <= 80
    # round 2: medians 4.1 s and 1.05 s (the failed request of user 2 is left out)
    cells = [c.strip() for c in lines[3].strip("|").split("|")]
    assert cells == ["2", "1920", "4100", "1050", "0.26"]
    sources = [RoundSources("tw-tq4+store", "evict", 2,
                            {"local_compute": 300.0, "external_kv_transfer": 4800.0},
                            {"external_kv_transfer": 5100.0})]
    st = sources_table(sources, recs, "evict")
    row = [c.strip() for c in st.splitlines()[2].strip("|").split("|")]
    assert row == ["2", "tw-tq4+store", "300", "0", "4800", "5100", "3"]
    assert max(len(line) for line in st.splitlines()) <= 80


# ---------------------------------------------------------------------------------------------
# the CLI


@pytest.mark.parametrize("args,message", [
    (["bench", "serve", "--datasets", "random,lmsys"], "datasets must be among"),
    (["bench", "serve", "--configs", "vllm"], "'nixl' or 'tw:<preset>'"),
    (["bench", "serve", "--links", "0"], "must be > 0"),
    (["bench", "serve", "--links", "fast"], "use Gbit/s"),
    (["bench", "serve", "--concurrency", "1,x"], "comma list of integers"),
    (["bench", "serve", "--concurrency", "0"], ">= 1"),
    (["bench", "multiround", "--configs", "nixl+store"], "needs 'tw:<preset>'"),
    (["bench", "multiround", "--cache", "flush"], "cache modes"),
])
def test_cli_refuses_bad_arguments(args: list[str], message: str) -> None:
    result = CliRunner().invoke(app, [*args, "--dry-run"])
    assert result.exit_code == 2
    assert message in " ".join(result.output.split()).replace("│ ", "")


def test_cli_dry_runs_print_the_plan(tmp_path: Path) -> None:
    r = CliRunner().invoke(app, ["bench", "serve", "--dry-run", "--configs", "nixl,tw:tq4",
                                 "--links", "1", "--concurrency", "1,4", "--out",
                                 str(tmp_path)])
    assert r.exit_code == 0, r.output
    assert "2 stacks (nixl, tw-tq4), links 1G, 8 runs, 72 prompts in all" in r.output
    assert "vllm bench serve --backend openai" in r.output
    r = CliRunner().invoke(app, ["bench", "multiround", "--dry-run", "--rounds", "2",
                                 "--system-tokens", "1000"])
    assert r.exit_code == 0, r.output
    assert "prompt tokens per round: 1096, 1256" in r.output
    assert not list(tmp_path.iterdir())  # a dry run writes nothing


def test_help_has_examples() -> None:
    for sub in ("serve", "multiround"):
        r = CliRunner().invoke(app, ["bench", sub, "--help"])
        assert r.exit_code == 0 and "Examples" in r.output and f"turbowire bench {sub}" in r.output

