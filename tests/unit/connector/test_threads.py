"""Where the connector's background threads are started (connector/threads.py)."""

from __future__ import annotations

import os
import threading

import pytest

from turbowire.connector import threads
from turbowire.connector.config import ConnectorConfigError, TurboWireConfig

needs_affinity = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"),
                                    reason="the platform has no thread affinity calls")


@pytest.mark.parametrize(("text", "cpus"), [("0", {0}), ("0,2-3", {0, 2, 3}), (" 1 , 4-4", {1, 4})])
def test_cpu_lists_parse(text, cpus):
    assert threads.parse_cpu_list(text) == cpus


@pytest.mark.parametrize("text", ["", "a", "1,", "3-1", "-2", "1-", "0-70000"])
def test_bad_cpu_lists_are_refused(text):
    with pytest.raises(ValueError):
        threads.parse_cpu_list(text)


def test_config_key_accepts_auto_inherit_and_lists_and_names_itself_when_wrong():
    assert TurboWireConfig.from_extra_config({}).connector_thread_cpus == "auto"
    for ok in ("auto", "0-1", "0,1"):
        assert TurboWireConfig.from_extra_config(
            {"connector_thread_cpus": ok}).connector_thread_cpus == ok
    with pytest.raises(ConnectorConfigError, match="connector_thread_cpus"):
        TurboWireConfig.from_extra_config({"connector_thread_cpus": "all"})


@needs_affinity
def test_inherit_leaves_placement_alone_and_auto_reads_the_parent():
    assert threads.resolve("inherit") is None
    assert threads.resolve("auto") == frozenset(os.sched_getaffinity(os.getppid()))


@needs_affinity
def test_threads_started_inside_get_the_cores_and_the_caller_keeps_its_own():
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("needs two cores to tell placements apart")
    original = os.sched_getaffinity(0)
    seen: dict[str, set[int]] = {}
    try:
        os.sched_setaffinity(0, {allowed[0]})  # like vLLM's OpenMP master

        def record(name: str) -> None:
            seen[name] = os.sched_getaffinity(0)

        with threads.threads_started_on(frozenset(allowed)):
            t = threading.Thread(target=record, args=("inside",))
            t.start()
            t.join()
        assert os.sched_getaffinity(0) == {allowed[0]}  # the caller is back on its core
        t = threading.Thread(target=record, args=("after",))
        t.start()
        t.join()
    finally:
        os.sched_setaffinity(0, original)
    assert seen["inside"] == set(allowed)
    assert seen["after"] == {allowed[0]}


@needs_affinity
def test_pool_initializer_moves_its_thread():
    allowed = frozenset(os.sched_getaffinity(0))
    box: list[set[int]] = []

    def run() -> None:
        threads.pin_current_thread(allowed)
        box.append(os.sched_getaffinity(0))

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert box == [set(allowed)]
