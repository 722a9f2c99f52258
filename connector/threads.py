"""Where the connector's background threads run on CPU engines.

vLLM's CPU worker binds its main thread to the first core of its OpenMP list, and every thread
that thread starts later inherits that one core: NIXL's progress thread, UCX's async thread, the
worker's thread pool. With ``VLLM_CPU_OMP_THREADS_BIND=auto`` (vLLM's default) on a small
machine both engines' workers get the same first core, so the prefill engine's progress thread,
which must answer the decode engine's UCX wire-up before the first READ can finish, queues on
the core where the decode worker's main thread spins waiting for its next step; measured on a
2-core machine, its threads stayed runnable with no CPU time for 10 s and more, and the first
load timed out (bench/RESULTS.md, "Starved CPUs").

``connector_thread_cpus: auto`` (the default) starts those threads on the cores of the engine
process that spawned the worker (vLLM's EngineCore, the process vLLM itself leaves unpinned or
gives the cores it reserves) instead; a list such as ``2,3`` or ``4-7`` names the cores;
``inherit`` keeps vLLM's placement. Over UCX's TCP transport a READ is emulated with active
messages, so the prefill engine's UCX thread must run for the wire-up and for every fragment of
every READ: confined to the shared core it got too little CPU, and first loads of fresh engine
pairs timed out; with ``auto`` they finish (bench/RESULTS.md, "Starved CPUs", sittings 5-6).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator

logger = logging.getLogger(__name__)

AUTO = "auto"
INHERIT = "inherit"


def parse_cpu_list(text: str) -> frozenset[int]:
    """``"0,2-3"`` -> {0, 2, 3}; raises ValueError with what is wrong."""
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            raise ValueError(f"empty item in CPU list {text!r}")
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"{part!r} is not a core number or a range like 2-5")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first or last >= 65536:
            raise ValueError(f"bad CPU range {part!r}")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


def _can_pin() -> bool:
    return hasattr(os, "sched_getaffinity") and hasattr(os, "sched_setaffinity")


def engine_cpus() -> frozenset[int] | None:
    """The cores of the process that started this worker (vLLM's EngineCore), or None where the
    platform has no affinity calls or the parent cannot be read."""
    if not _can_pin():
        return None
    try:
        return frozenset(os.sched_getaffinity(os.getppid()))
    except OSError:
        return None


def resolve(setting: str) -> frozenset[int] | None:
    """The cores the connector's threads should run on, or None to leave placement alone."""
    if setting == INHERIT or not _can_pin():
        return None
    if setting == AUTO:
        return engine_cpus()
    return parse_cpu_list(setting)


def pin_current_thread(cpus: frozenset[int] | None) -> None:
    """Move the calling thread to ``cpus`` (a thread-pool initializer)."""
    if not cpus:
        return
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as exc:  # cores outside the cgroup's cpuset: keep the inherited placement
        logger.warning("cannot move thread %s to cores %s: %s",
                       threading.current_thread().name, sorted(cpus), exc)


@contextlib.contextmanager
def threads_started_on(cpus: frozenset[int] | None) -> Iterator[None]:
    """Threads the block starts (native ones too: they inherit the creator's affinity) run on
    ``cpus``; the calling thread gets its own placement back afterwards."""
    if not cpus:
        yield
        return
    before = os.sched_getaffinity(0)
    if before == cpus:
        yield
        return
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as exc:
        logger.warning("cannot start connector threads on cores %s (%s); they share cores %s "
                       "with the engine's main thread", sorted(cpus), exc, sorted(before))
        yield
        return
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
    logger.info("connector threads start on cores %s (the engine's main thread keeps %s)",
                sorted(cpus), sorted(before))
