"""The retrieval task's harness logic, without the model: needle placement at a depth, the token
budget, scoring, the Wilson interval, grouping per length/depth and the 80-column tables."""

from __future__ import annotations

import io
import math
import re

import pytest

from turbowire.quality.needles import (
    HAYSTACKS,
    TASKS,
    PromptFormat,
    answer_complete,
    boundary_for_depth,
    build_case,
    case_seed,
    extract_number,
    filler_units,
    is_correct,
    max_new_tokens,
    needle_text,
    prompt_budget,
    task_text,
    wilson,
)
from turbowire.quality.retrieval import (
    REFERENCE,
    CaseResult,
    RetrievalConfig,
    RetrievalRun,
    ratio_ci,
)

TOKEN_RE = re.compile(r"\s|\w+|[^\w\s]")


def word_format() -> PromptFormat:
    """A stand-in tokenizer: words, single spaces and punctuation are tokens (additive)."""
    return PromptFormat(encode=lambda text: [hash(t) % 50000 for t in TOKEN_RE.findall(text)],
                        template=lambda user: f"<user> {user} </user> <assistant> ")


def real_format() -> PromptFormat:
    from transformers import AutoTokenizer

    from turbowire.models import ensure_smollm2

    path = ensure_smollm2()  # `make test` prepares it: a missing model is a failure, not a skip
    return PromptFormat.from_tokenizer(AutoTokenizer.from_pretrained(str(path)))


def haystack_depth(fmt: PromptFormat, case) -> float:
    """Where the target needle starts, as a fraction of the haystack's tokens (needles excluded)."""
    needle = needle_text(case.task, case.answer, case.key)
    before = case.context[: case.needle_offset]
    after = case.context[case.needle_offset + len(needle):]
    n_before = len(fmt.encode(before))
    return n_before / max(n_before + len(fmt.encode(after)), 1)


# ---- cases --------------------------------------------------------------------------------------
@pytest.mark.parametrize("depth", [0, 10, 25, 50, 75, 90, 100])
def test_the_passkey_sits_at_the_requested_depth(depth: int) -> None:
    fmt = word_format()
    case = build_case(fmt, "passkey", "filler", 1024, depth, f"s{depth}")
    unit = max(len(fmt.encode(" " + u)) for u in filler_units())
    haystack = len(fmt.encode(case.context))
    assert abs(haystack_depth(fmt, case) - depth / 100) <= unit / haystack + 1e-9
    assert case.context.count(case.answer) == 2  # "The pass key is N. ... N is the pass key."


@pytest.mark.parametrize("depth", [0, 50, 100])
def test_multikey_asks_one_key_among_distractors(depth: int) -> None:
    fmt = word_format()
    case = build_case(fmt, "multikey", "corpus", 2048, depth, f"m{depth}", keys=4)
    assert case.key is not None and len(case.distractors) == 3
    assert case.answer not in case.distractors and len(set(case.distractors)) == 3
    assert len(case.answer) == 7 and all(len(d) == 7 for d in case.distractors)
    for value in (case.answer, *case.distractors):
        assert case.context.count(value) == 1
    assert case.context.count(f"for {case.key} is: {case.answer}.") == 1
    assert case.context[case.needle_offset:].startswith(f"The special magic number for {case.key}")
    prompt = fmt.encode(fmt.template(
        f"{task_text('multikey', case.key).instruction}\n\n{case.context}\n\n"
        f"{task_text('multikey', case.key).question}"))
    assert case.prompt_ids[: len(prompt)] == prompt
    if depth == 0:
        assert case.needle_offset == 0
    if depth == 100:
        assert case.context.endswith(needle_text("multikey", case.answer, case.key))


def test_cases_are_deterministic_per_seed() -> None:
    fmt = word_format()
    a = build_case(fmt, "multikey", "corpus", 512, 50, "seed-1")
    b = build_case(fmt, "multikey", "corpus", 512, 50, "seed-1")
    c = build_case(fmt, "multikey", "corpus", 512, 50, "seed-2")
    assert a == b
    assert (a.answer, a.key, a.context) != (c.answer, c.key, c.context)
    assert case_seed(0, "passkey", "filler", 1024, 50, 0) != case_seed(0, "passkey", "filler",
                                                                        1024, 50, 1)


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("haystack", HAYSTACKS)
@pytest.mark.parametrize("length", [200, 1000, 3000])
def test_prompts_fill_the_budget_and_never_pass_it(task: str, haystack: str, length: int) -> None:
    fmt = word_format()
    case = build_case(fmt, task, haystack, length, 50, f"{task}{haystack}{length}")
    assert length - 2 <= case.prompt_tokens <= length


def test_the_budget_leaves_room_for_the_answer_in_the_model_positions() -> None:
    assert prompt_budget(8192, 8192) == 8192 - 16
    assert prompt_budget(4096, 8192) == 4096
    assert prompt_budget(8180, 8192) == 8176
    assert prompt_budget(100_000, 0) == 100_000  # no limit known
    with pytest.raises(ValueError):
        prompt_budget(32, 8192)
    # the whole answer pass fits: prompt + gold answer + the extra greedy tokens
    assert prompt_budget(8192, 8192) + max_new_tokens([0] * 7) <= 8192


def test_unknown_task_or_haystack_or_depth() -> None:
    fmt = word_format()
    with pytest.raises(ValueError):
        build_case(fmt, "qa", "filler", 512, 50, "x")
    with pytest.raises(ValueError):
        build_case(fmt, "passkey", "essays", 512, 50, "x")
    with pytest.raises(ValueError):
        build_case(fmt, "passkey", "filler", 512, 120, "x")
    with pytest.raises(ValueError):
        RetrievalConfig(depths=(50, 101))
    with pytest.raises(ValueError):
        RetrievalConfig(tasks=("passkey", "qa"))


def test_boundary_for_depth() -> None:
    counts = [10] * 10
    assert boundary_for_depth(counts, 0) == 0
    assert boundary_for_depth(counts, 100) == 10
    assert boundary_for_depth(counts, 50) == 5
    assert boundary_for_depth(counts, 24) == 2
    assert boundary_for_depth([], 50) == 0


def test_real_tokenizer_budget_depth_and_answer_tokens() -> None:
    """SmolLM2's own tokenizer: the prompt fits (8k capped to leave the answer room), the depth
    holds, and prompt + answer ids are the tokenization of the whole text (digits one token
    each), so teacher forcing scores what the model would write."""
    fmt = real_format()
    for task, haystack, length, depth in [("passkey", "corpus", 8176, 25),
                                          ("multikey", "filler", 2048, 75),
                                          ("multikey", "corpus", 1024, 100)]:
        case = build_case(fmt, task, haystack, length, depth, f"{task}-{depth}")
        assert length - 4 <= case.prompt_tokens <= length
        assert abs(haystack_depth(fmt, case) - depth / 100) < 0.03
        text = task_text(task, case.key)
        user = f"{text.instruction}\n\n{case.context}\n\n{text.question}"
        whole = fmt.encode(fmt.template(user)) + fmt.encode(text.answer_prefix + case.answer)
        assert case.prompt_ids + case.answer_ids == whole
        assert len(case.answer_ids) == len(case.answer)


def test_grid_rotates_haystacks_so_one_case_per_cell_covers_both() -> None:
    cfg = RetrievalConfig(lengths=(1024, 2048), depths=(0, 25, 50, 75, 100), cases=1)
    grid = cfg.grid()
    assert len(grid) == 2 * 2 * 5
    for length in (1024, 2048):
        for task in TASKS:
            assert {h for t, h, L, _, _ in grid if L == length and t == task} == set(HAYSTACKS)
    assert len(set(grid)) == len(grid)


# ---- scoring ------------------------------------------------------------------------------------
@pytest.mark.parametrize(("generated", "gold", "correct"), [
    ("83863.", "83863", True),
    ("\nThe pass key is 83863. Remember", "83863", True),
    ("838634", "83863", False),
    ("8386", "83863", False),
    ("The pass key is a special attribute", "83863", False),
    ("12345 and 83863", "83863", False),  # the first number counts
    ("", "83863", False),
])
def test_exact_retrieval_scoring(generated: str, gold: str, correct: bool) -> None:
    assert is_correct(generated, gold) is correct


def test_extraction_and_stop_condition() -> None:
    assert extract_number("x 0042 y") == "0042"
    assert extract_number("none") is None
    assert not answer_complete("1234")
    assert not answer_complete("The pass key")
    assert answer_complete("1234.")
    assert answer_complete("1234\n")


@pytest.mark.parametrize(("k", "n", "lo", "hi"), [
    (0, 10, 0.0, 0.2775), (10, 10, 0.7225, 1.0), (5, 10, 0.2366, 0.7634),
    (19, 20, 0.7639, 0.9911), (1, 1, 0.2065, 1.0),
])
def test_wilson_interval(k: int, n: int, lo: float, hi: float) -> None:
    got = wilson(k, n)
    assert got == pytest.approx((lo, hi), abs=1e-4)


def test_wilson_edges() -> None:
    assert wilson(0, 0) == (0.0, 1.0)
    with pytest.raises(ValueError):
        wilson(3, 2)


def test_ratio_ci_brackets_the_ratio_and_is_seeded() -> None:
    values, refs = [1.2, 0.9, 1.5, 1.1, 1.0], [1.0, 1.0, 1.1, 0.9, 1.0]
    lo, hi = ratio_ci(values, refs)
    assert lo <= sum(values) / sum(refs) <= hi
    assert ratio_ci(values, refs) == (lo, hi)
    assert math.isnan(ratio_ci([1.0], [1.0])[0])


# ---- grouping and reports -----------------------------------------------------------------------
def synthetic_run(cases: int = 10) -> RetrievalRun:
    from turbowire.quality.methods import ANCHORS

    cfg = RetrievalConfig(lengths=(1024, 8192), depths=(0, 25, 50, 75, 100), cases=cases)
    run = RetrievalRun("SmolLM2-135M-Instruct", cfg)
    methods = [(REFERENCE, "reference", 16.0, 1.0), ("tq4", "turbowire", 4.3, 1.02),
               ("k4v3", "turbowire", 3.8, 1.2), ("tq3", "turbowire", 3.3, 1.5)]
    methods += [(name, "baseline", 5.0, 1.1) for name in ANCHORS]
    methods += [("vLLM turboquant_k3v4_nc +bf16 boundary 2+2 (repro)", "reproduction", 5.5, 1.3)]
    for task, haystack, length, depth, index in cfg.grid():
        seed = case_seed(0, task, haystack, length, depth, index)
        for name, family, bits, factor in methods:
            wrong = family != "reference" and index == 0 and depth == 50
            run.results.append(CaseResult(
                method=name, family=family, task=task, haystack=haystack, length=length,
                prompt_tokens=length - 3, depth=depth, seed=seed, answer="12345",
                generated="99" if wrong else "12345.", correct=not wrong,
                nll=0.5 * factor, kl=0.0 if family == "reference" else 0.01 * factor,
                wire_bytes=int(bits * 1000 / 8), dense_elements=1000))
    return run


def test_summaries_pair_the_reference_on_the_same_cases() -> None:
    run = synthetic_run()
    ref = run.summarize(REFERENCE, length=1024)
    assert ref.n == 2 * 5 * 10 and ref.accuracy == 1.0 and ref.nll_ratio == pytest.approx(1.0)
    s = run.summarize("tq4", length=1024)
    assert s.n == 100 and s.correct == 98
    assert s.nll_ratio == pytest.approx(1.02)
    assert s.bits_per_element == pytest.approx(4.296, abs=1e-3)
    lo, hi = s.ci
    assert lo < 0.98 < hi
    d = run.summarize("tq4", depth=50)
    assert d.n == 2 * 2 * 10 and d.correct == d.n - 4
    assert run.summarize("tq4", length=4096).n == 0


def test_tables_fit_80_columns_and_targets() -> None:
    from rich.console import Console

    from turbowire.quality.retrieval_report import check_targets, markdown, rich_tables

    run = synthetic_run()
    out = io.StringIO()
    console = Console(file=out, width=200, record=True)
    for table in rich_tables(run):
        console.print(table)
    widths = [len(line) for line in out.getvalue().splitlines()]
    assert max(widths) <= 80, max(widths)
    assert "k3v4_nc+b2" in out.getvalue()
    checks = {(c.length, c.method): c.met for c in check_targets(run)}
    assert checks == {(1024, "tq4"): True, (1024, "k4v3"): False,
                      (8192, "tq4"): True, (8192, "k4v3"): False}
    md = markdown(run, "turbowire eval --task retrieval")
    assert md.startswith("`turbowire eval --task retrieval`")
    assert "| tq4 | 4.30 | 98% |" in md
    assert "**not met**" in md


def test_plot_writes_a_png(tmp_path) -> None:
    from turbowire.quality.retrieval_report import plot

    path = tmp_path / "r.png"
    plot(synthetic_run(cases=1), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_text_file_can_be_the_haystack(tmp_path) -> None:
    path = tmp_path / "essay.txt"
    path.write_text("Rivers carve valleys over ages. " * 5 + "\n\n" + "Stars are far away! " * 5)
    fmt = word_format()
    case = build_case(fmt, "passkey", str(path), 400, 50, "file")
    assert "Rivers carve valleys" in case.context and "Stars are far away!" in case.context
    assert 398 <= case.prompt_tokens <= 400
    assert RetrievalConfig(haystacks=(str(path), "filler")).haystacks[0] == str(path)
    with pytest.raises(ValueError):
        RetrievalConfig(haystacks=(str(tmp_path / "missing.txt"),))


def test_a_saved_run_renders_again_without_the_model(tmp_path) -> None:
    import json

    from typer.testing import CliRunner

    from turbowire.cli import app
    from turbowire.quality.retrieval_report import markdown

    run = synthetic_run(cases=1)
    saved = tmp_path / "r.json"
    saved.write_text(json.dumps({"command": "turbowire eval --task retrieval", **run.to_json()}))
    again = RetrievalRun.from_json(json.loads(saved.read_text()))
    assert again.results == run.results
    md = tmp_path / "r.md"
    res = CliRunner().invoke(app, ["eval", "--task", "retrieval", "--from-json", str(saved),
                                   "--markdown", str(md)])
    assert res.exit_code == 0, res.output
    assert md.read_text() == markdown(run, "turbowire eval --task retrieval")
    res = CliRunner().invoke(app, ["eval", "--task", "layers", "--from-json", str(saved)])
    assert res.exit_code != 0
    assert "not a saved --task layers run" in re.sub(r"[│╭╮╰╯─\s]+", " ", res.output)
