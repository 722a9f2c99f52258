"""A tiny slice of ``turbowire eval --task retrieval`` and ``--task layers`` on the real model
(SmolLM2-135M-Instruct, short prompts, one preset and raw): only what is guaranteed is asserted.
The exact KV scores the same as itself, the raw preset (bf16 passthrough in the container)
reproduces the exact result, and the results are well formed. The full tables are in
bench/RESULTS.md, "Long-context retrieval" and "Per-layer sensitivity"."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import pytest
import torch

from turbowire.quality.methods import CodecMethod
from turbowire.quality.retrieval import REFERENCE, RetrievalConfig, evaluate_retrieval


@dataclass
class Exact:
    """The identity method: the reference's own KV, passed through as a method would."""

    name: str = "exact again"
    family: str = "baseline"

    def apply(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        return k, v, (k.numel() + v.numel()) * 2


@pytest.fixture(scope="module")
def mut():
    from turbowire.quality.harness import ModelUnderTest

    return ModelUnderTest()  # `make test` prepares the model: missing is a failure, not a skip


@pytest.fixture(scope="module")
def run(mut):
    config = RetrievalConfig(lengths=(320,), depths=(50,), cases=1, threads=1)
    methods = [Exact(), CodecMethod("raw", mut.head_dim, mut.num_layers),
               CodecMethod("tq4", mut.head_dim, mut.num_layers)]
    return evaluate_retrieval(methods, config, mut)


def test_the_exact_kv_scores_the_same_as_itself(run) -> None:
    by = {(r.method, r.task): r for r in run.results}
    for task in run.config.tasks:
        ref, again = by[(REFERENCE, task)], by[("exact again", task)]
        assert again.generated == ref.generated and again.correct == ref.correct
        assert again.nll == ref.nll and again.kl == 0.0


def test_raw_reproduces_the_exact_result(run) -> None:
    by = {(r.method, r.task): r for r in run.results}
    for task in run.config.tasks:
        ref, raw = by[(REFERENCE, task)], by[("raw", task)]
        assert raw.generated == ref.generated
        assert raw.nll == pytest.approx(ref.nll, rel=1e-5, abs=1e-6)
        assert raw.kl < 1e-6
        assert 16.0 <= raw.wire_bytes * 8 / raw.dense_elements < 16.5  # + container headers


def test_results_are_well_formed(run) -> None:
    assert {r.method for r in run.results} == {REFERENCE, "exact again", "raw", "tq4"}
    assert len(run.results) == 4 * len(run.config.tasks)
    for r in run.results:
        assert 300 <= r.prompt_tokens <= 320
        assert r.answer.isdigit() and len(r.answer) in (5, 7)
        assert math.isfinite(r.nll) and r.nll >= 0 and r.kl >= 0
    tq4 = run.summarize("tq4")
    assert tq4.n == 2 and 0 <= tq4.accuracy <= 1
    assert 4.0 < tq4.bits_per_element < 4.6
    assert tq4.kl > 0  # it really went through a lossy codec
    lo, hi = tq4.ci
    assert 0 <= lo <= tq4.accuracy <= hi <= 1
    assert math.isfinite(tq4.nll_ratio)
    assert json.loads(json.dumps(run.to_json()))["results"][0]["method"] == REFERENCE


def test_layers_slice(mut) -> None:
    from turbowire.quality.layers import LayersConfig, evaluate_layers, policy_lines

    config = LayersConfig(prompt_len=64, windows=1, continuation=8, threads=1,
                          layers=[0, mut.num_layers - 1])
    methods = [CodecMethod("raw", mut.head_dim, mut.num_layers),
               CodecMethod("tq2", mut.head_dim, mut.num_layers)]
    sweep = evaluate_layers(methods, config, mut)
    assert all(abs(sweep.mean("raw", i)) < 1e-6 for i in config.layers)
    assert all(sweep.mean("tq2", i) > 0 for i in config.layers)
    assert sweep.all_mean("tq2") > max(sweep.mean("tq2", i) for i in config.layers)
    assert policy_lines(sweep)


def test_cli_retrieval_slice(mut, tmp_path) -> None:
    from typer.testing import CliRunner

    from turbowire.cli import app

    md, js, png = tmp_path / "r.md", tmp_path / "r.json", tmp_path / "r.png"
    res = CliRunner().invoke(app, [
        "eval", "--task", "retrieval", "--lengths", "256", "--depths", "50", "--needles",
        "passkey", "--haystacks", "filler", "--presets", "raw", "--no-baselines", "--threads", "1",
        "--markdown", str(md), "--json", str(js), "--plot", str(png)])
    assert res.exit_code == 0, res.output
    assert "Retrieval at 256 tokens" in res.output
    data = json.loads(js.read_text())
    assert {r["method"] for r in data["results"]} == {REFERENCE, "raw"}
    assert data["config"]["lengths"] == [256]
    assert "| raw | 16." in md.read_text()
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_cli_rejects_unknown_task_and_two_layer_lengths() -> None:
    from typer.testing import CliRunner

    from turbowire.cli import app

    res = CliRunner().invoke(app, ["eval", "--task", "qa"])
    assert res.exit_code != 0 and "unknown task" in res.output
    res = CliRunner().invoke(app, ["eval", "--task", "layers", "--lengths", "512,1024"])
    assert res.exit_code != 0 and "one prompt length" in res.output


def test_a_recomputed_tail_over_the_raw_prefix_is_the_exact_run(mut) -> None:
    """``--recompute``: the prefix's KV through the preset, the last tokens run by the model
    over it. Over raw (exact) KV that is the exact run again, up to the tail's bf16 rounding;
    the wire carries the prefix only."""
    from turbowire.quality.harness import EvalConfig, evaluate
    from turbowire.quality.methods import RecomputedTailMethod

    raw = CodecMethod("raw", mut.head_dim, mut.num_layers)
    config = EvalConfig(prompt_lengths=[160], windows=2, continuation=16, threads=1)
    res = {r.name: r for r in evaluate([RecomputedTailMethod(raw, 40),
                                        RecomputedTailMethod(raw, 200)], config, mut)}
    tail = res["raw +recompute 40"]
    assert tail.family == "turbowire" and len(tail.kl) == 2
    assert max(tail.kl) < 1e-3 and min(tail.top1) > 0.9
    # two windows, each the raw chunks of its 120-token prefix
    prefix = sum(raw.codec.encoded_nbytes(layer, 120, mut.num_kv_heads)
                 for layer in range(mut.num_layers))
    assert tail.wire_bytes == 2 * prefix
    # a prompt no longer than the window is loaded whole, as the connector does
    whole = sum(raw.codec.encoded_nbytes(layer, 160, mut.num_kv_heads)
                for layer in range(mut.num_layers))
    assert res["raw +recompute 200"].wire_bytes == 2 * whole


def test_a_recomputed_tail_in_retrieval_over_raw_reproduces_the_exact_answers(mut) -> None:
    from turbowire.quality.methods import RecomputedTailMethod

    config = RetrievalConfig(lengths=(320,), depths=(50,), cases=1, threads=1)
    raw = CodecMethod("raw", mut.head_dim, mut.num_layers)
    run = evaluate_retrieval([RecomputedTailMethod(raw, 24)], config, mut)
    exact = {(r.task, r.haystack): r for r in run.results if r.method == REFERENCE}
    tail = [r for r in run.results if r.method == "raw +recompute 24"]
    assert tail and len(tail) == len(exact)
    for r in tail:
        ref = exact[(r.task, r.haystack)]
        assert r.correct == ref.correct and math.isclose(r.nll, ref.nll, rel_tol=0.02)
        # the prefix's raw chunks (bf16 and headers), less than the whole prompt in bf16
        assert r.wire_bytes < ref.wire_bytes
