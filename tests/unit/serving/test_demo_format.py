"""``turbowire demo``'s output at 80 columns (issue 37): every table fits, no number is truncated
("3,985,9…") or wrapped, units are human (KiB/MiB/GiB, ms/s, 3.77x), and each act's text is
whole. Rendered from plain measurements, no engines."""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from rich.cells import cell_len
from rich.console import Console, RenderableType

from turbowire.commands.demo import (
    fmt_ms,
    print_demo,
    prompt_summary,
    store_table,
    transfers_table,
)
from turbowire.serving.demo import DEFAULT_PROMPTS, STORE_DOCUMENT, DemoResult, DemoRun, StoreAct

WIDTH = 80


def _console() -> Console:
    return Console(width=WIDTH, record=True, file=io.StringIO(), color_system=None)


def _render(renderable: RenderableType) -> list[str]:
    console = _console()
    console.print(renderable)
    return console.export_text().splitlines()


def _assert_fits(lines: Sequence[str]) -> None:
    wide = [line for line in lines if cell_len(line.rstrip()) > WIDTH]
    assert not wide, wide
    assert not any("…" in line for line in lines), "\n".join(lines)


def _assert_row(lines: Sequence[str], *cells: str) -> None:
    """All of a row's cells on one line: nothing wrapped onto the next."""
    assert any(all(c in line for c in cells) for line in lines), (cells, "\n".join(lines))


def _result(tokens: int, dense: float, wire: float, transfer_ms: float | None = 12.8,
            prefill_ms: float | None = 400.0, ttft_ms: float = 900.0) -> DemoResult:
    return DemoResult(prompt="What is the capital of France?", completion="Paris.",
                      prompt_tokens=tokens, dense_bytes=dense, wire_bytes=wire,
                      transfer_ms=transfer_ms, ttft_ms=ttft_ms, prefill_ms=prefill_ms,
                      total_ms=ttft_ms + 1000)


STORE = StoreAct(
    prompt_tokens=1868, cold_ttft_ms=5349.0, hit_ttft_ms=886.0, loaded_tokens=1792,
    loaded_dense_bytes=41_287_680.0, loaded_store_bytes=11_081_920.0, redis_chunks=9,
    redis_bytes=14_264_640, proxy_route="store_hit", proxy_ttft_ms=273.0,
    completion_a="The decode phase is limited by memory bandwidth.",
    completion_b="The decode phase is limited by memory bandwidth.",
)  # the 2-core VM's run (bench/RESULTS.md, "The demo's second act")


def _store(**changes: Any) -> StoreAct:
    return dataclasses.replace(STORE, **changes)


@pytest.mark.parametrize(("ms", "text"), [
    (None, "-"), (0.0, "0.0 ms"), (0.42, "0.4 ms"), (9.96, "10 ms"), (12.8, "13 ms"),
    (999.4, "999 ms"), (999.6, "1.00 s"), (5349.0, "5.35 s"), (12_345.0, "12.3 s"),
    (12_345_678.0, "12346 s"),
])
def test_fmt_ms_picks_ms_or_s(ms: float | None, text: str) -> None:
    assert fmt_ms(ms) == text


def test_transfers_table_representative() -> None:
    """A run like the 2-core VM's: the numbers in KiB/MiB, ms/s, with the ratio."""
    results = [_result(37, 1_105_920, 357_888), _result(563, 16_883_712, 4_823_000, 204.0,
                                                         3900.0, 4400.0)]
    lines = _render(transfers_table(results))
    _assert_fits(lines)
    _assert_row(lines, "#", "tokens", "dense", "wire", "ratio", "transfer", "prefill", "TTFT")
    _assert_row(lines, "37", "1.05 MiB", "349.50 KiB", "3.09x", "13 ms", "400 ms", "900 ms")
    _assert_row(lines, "563", "16.10 MiB", "4.60 MiB", "3.50x", "204 ms", "3.90 s", "4.40 s")


def test_transfers_table_extremes() -> None:
    """A 2 GB request with a million tokens, a 40-byte one, one with nothing transferred, and a
    thousand rows: still 80 columns, every number whole."""
    results = [_result(7, 40, 12, 0.01, None, 3.0)] * 997 + [
        _result(1_048_576, 2_000_000_000, 519_999_999, 98_765.0, 1_234_567.0, 12_345_678.0),
        _result(0, 0, 0, None, None, 0.0),
        _result(131_072, 1_073_741_823, 1_048_575, 9.96, 999.6, 99_999.0),
    ]
    lines = _render(transfers_table(results))
    _assert_fits(lines)
    _assert_row(lines, "997", "7", "40 B", "12 B", "3.33x", "0.0 ms", "-", "3.0 ms")
    _assert_row(lines, "998", "1,048,576", "1.86 GiB", "495.91 MiB", "3.85x", "98.8 s",
                "1235 s", "12346 s")
    _assert_row(lines, "999", "0 B", "0 B", "-")
    _assert_row(lines, "1000", "131,072", "1024.00 MiB", "1024.00 KiB", "1024.00x", "10 ms",
                "1.00 s", "100 s")


@pytest.mark.parametrize("act", [
    _store(),
    # a 0-token store hit: nothing loaded, B no faster than A
    _store(prompt_tokens=12, cold_ttft_ms=40.0, hit_ttft_ms=55.0, loaded_tokens=0,
           loaded_dense_bytes=0.0, loaded_store_bytes=0.0, redis_chunks=0, redis_bytes=0,
           proxy_route="pd_short"),
    # huge: a million-token document, GiB in Redis, an unknown route
    _store(prompt_tokens=1_048_576, cold_ttft_ms=12_345_678.0, hit_ttft_ms=98_765.0,
           loaded_tokens=1_048_320, loaded_dense_bytes=2_000_000_000.0,
           loaded_store_bytes=15_000_000.0, redis_chunks=123_456,
           redis_bytes=1_099_511_627_775, proxy_route="?"),
], ids=["representative", "zero-token-hit", "huge"])
def test_store_table_fits(act: StoreAct) -> None:
    lines = _render(store_table(act))
    _assert_fits(lines)
    _assert_row(lines, "prompt tokens", f"{act.prompt_tokens:,}")
    _assert_row(lines, "tokens B loaded (full chunks)", f"{act.loaded_tokens:,}")
    _assert_row(lines, "same request via the proxy: route", act.proxy_route)


def test_store_table_values() -> None:
    lines = _render(store_table(_store()))
    _assert_row(lines, "engine A computes it: TTFT", "5.35 s")
    _assert_row(lines, "engine B loads it from the store: TTFT", "886 ms")
    _assert_row(lines, "time saved on B", "4.46 s (6.04x faster)")
    _assert_row(lines, "dense KV of them", "39.38 MiB")
    _assert_row(lines, "bytes B read from the store", "10.57 MiB (3.73x smaller)")
    _assert_row(lines, "chunks / bytes held in Redis", "9 / 13.60 MiB")
    _assert_row(lines, "same request via the proxy: TTFT", "273 ms")


def test_store_table_zero_token_hit() -> None:
    lines = _render(store_table(_store(cold_ttft_ms=40.0, hit_ttft_ms=55.0, loaded_tokens=0,
                                       loaded_dense_bytes=0.0, loaded_store_bytes=0.0)))
    _assert_row(lines, "time saved on B", "none (15 ms slower)")
    _assert_row(lines, "tokens B loaded (full chunks)", "0")
    _assert_row(lines, "bytes B read from the store", "0 B")
    assert not any("smaller" in line for line in lines)


def test_prompt_summary_whole_sentences() -> None:
    assert prompt_summary("  What is\nthe capital of France? ") == (
        "What is the capital of France?")
    long = DEFAULT_PROMPTS[3]
    summary = prompt_summary(long)
    head, _, rest = summary.partition(" (+")
    assert head == "Read the text and list three facts from it."
    assert rest == f"{len(long.split()) - len(head.split()):,} more words)"
    doc = prompt_summary(STORE_DOCUMENT, limit=40)
    assert doc.startswith("Answer from the document below. (+")


def test_prompt_summary_one_long_sentence_cuts_at_a_word() -> None:
    prompt = " ".join(f"word{i}" for i in range(100))
    summary = prompt_summary(prompt, limit=30)
    shown, _, rest = summary.partition(" (+")
    assert len(shown) <= 30 and shown.split() == prompt.split()[: len(shown.split())]
    assert rest == f"{100 - len(shown.split())} more words)"


def _run(prompts: Sequence[str], completion: str, store: StoreAct | None) -> DemoRun:
    run = DemoRun("tq4", startup_seconds=95.3, warmup_ms=812.0, store=store)
    for i, prompt in enumerate(prompts):
        run.results.append(DemoResult(
            prompt=prompt, completion=completion, prompt_tokens=37 + 100 * i,
            dense_bytes=1_105_920.0 * (i + 1), wire_bytes=357_888.0 * (i + 1), transfer_ms=12.8,
            ttft_ms=900.0, prefill_ms=400.0, total_ms=2900.0,
        ))
    return run


COMPLETION = (
    "Paris is the capital of France [citation needed]. It lies on the Seine, and its "
    "3,985,920-byte answer here is long enough to wrap over two or three lines at eighty "
    "columns, which is fine as long as no word and no number is cut."
)


def test_print_demo_whole_output_fits_and_keeps_text() -> None:
    """Both acts end to end: each line fits, the completions and every act's explanation are
    complete (rich wraps at spaces, so the words come back in order), markup is not parsed."""
    store = _store(completion_a="A says [b]this[/b].", completion_b="B says something else.")
    run = _run(DEFAULT_PROMPTS, COMPLETION, store)
    console = _console()
    print_demo(console, run, Path("/tmp/turbowire-demo"))
    lines = console.export_text().splitlines()
    _assert_fits(lines)
    flat = " ".join(" ".join(lines).split())
    for i in range(1, len(DEFAULT_PROMPTS) + 1):
        assert f"#{i} completion: {COMPLETION}" in flat
    assert "#1 prompt: What is the capital of France?" in flat
    assert "#4 prompt: Read the text and list three facts from it. (+" in flat
    assert "Act 1: prefill and decode over NIXL, preset tq4" in flat
    assert "Act 2: the store path, preset tq4" in flat
    assert "engine A (computed): A says [b]this[/b]." in flat
    assert "engine B (from the store): B says something else." in flat
    assert "KiB, MiB, GiB: 1024-based." in flat
    assert "past prefill." in flat
    assert "startup 95.3 s, warm-up request 812 ms; logs in /tmp/turbowire-demo" in flat
    _assert_row(lines, "4", "337", "4.22 MiB", "1.37 MiB", "3.09x")


def test_print_demo_without_store_and_same_completion() -> None:
    console = _console()
    print_demo(console, _run(["Hi"] * 120, "Hello!", None), Path("/tmp/x"))
    lines = console.export_text().splitlines()
    _assert_fits(lines)
    assert not any("Act 2" in line for line in lines)
    _assert_row(lines, "120", "11,937", "126.56 MiB", "40.96 MiB", "3.09x")

    console = _console()
    print_demo(console, _run(["Hi"], "Hello!", _store()), Path("/tmp/x"))
    flat = " ".join(console.export_text().split())
    assert "engine B (from the store): the same text as engine A" in flat
