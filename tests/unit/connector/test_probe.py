"""connector/probe.py: marks cost nothing without a recorder and report (name, start, end) with
one, also when the block raises; the recorder installed before a ``recording`` block returns."""

from __future__ import annotations

import time

import pytest

from turbowire.connector import probe


def test_a_mark_without_a_recorder_is_the_shared_no_op():
    assert probe.mark("loader.advance") is probe.mark("coder.launch")
    with probe.mark("loader.advance"):
        pass


def test_a_recorder_gets_each_mark_with_its_times_also_when_the_block_raises():
    seen: list[tuple[str, int, int]] = []
    with probe.recording(lambda *rec: seen.append(rec)):
        before = time.perf_counter_ns()
        with probe.mark("coder.save_layer"):
            time.sleep(0.001)
        with pytest.raises(KeyError), probe.mark("loader.decode"):
            raise KeyError("x")
        after = time.perf_counter_ns()
    assert [name for name, _, _ in seen] == ["coder.save_layer", "loader.decode"]
    (_, s0, e0), (_, s1, e1) = seen
    assert before <= s0 and e0 - s0 >= 1_000_000 and e0 <= s1 <= e1 <= after
    with probe.mark("loader.advance"):  # uninstalled again
        pass
    assert len(seen) == 2


def test_recording_restores_the_recorder_installed_before():
    outer: list[str] = []
    inner: list[str] = []
    probe.install(lambda name, s, e: outer.append(name))
    try:
        with probe.recording(lambda name, s, e: inner.append(name)):
            with probe.mark("a"):
                pass
        with probe.mark("b"):
            pass
    finally:
        probe.uninstall()
    assert inner == ["a"] and outer == ["b"]
    assert probe.mark("c") is probe.mark("d")


def test_the_marks_documented_are_the_marks_in_the_code():
    """The names the benchmarks build their timelines from: each documented one is placed."""
    import pathlib
    import re

    root = pathlib.Path(probe.__file__).parent
    placed = set()
    for path in root.rglob("*.py"):
        placed |= set(re.findall(r'probe\.mark\("([a-z_.]+)"\)', path.read_text()))
    documented = set(re.findall(r"``([a-z_]+\.[a-z_]+)``:", probe.__doc__ or ""))
    assert documented and documented == placed
