"""Named time marks on the connector's hot paths, for benchmarks and profilers.

``with probe.mark("loader.advance"): ...`` costs one global read and a shared no-op context
manager unless a recorder is installed; then the recorder gets ``(name, start_ns, end_ns)``
(``time.perf_counter_ns``) when the block ends, also when it raises. Install one with
``with probe.recording(recorder): ...`` (or ``install`` / ``uninstall``); one at a time, process
wide (the engine thread and the store's threads alike).

The marks (stable names; benchmarks build their timelines from them):

* ``loader.advance``: one load moved forward by a poll (``KVLoader._advance``);
* ``loader.take_landed``: finding the next run of landed READs (and posting READs);
* ``loader.post_reads``: posting layer-group READs;
* ``loader.decode``: handing a run of landed groups to the coder (the decode call);
* ``coder.prepare_load``: building a load's decode plan (and capturing its graphs);
* ``coder.capture``: capturing a load's launches into CUDA graphs;
* ``coder.launch``: launching (replaying or directly) a load's queued decode;
* ``coder.save_plan``: building a step's encode plan (the CUDA coder);
* ``coder.save_layer``: one ``save_kv_layer`` call's encode;
* ``coder.finish_save``: ``wait_for_save``'s encode and stream ordering;
* ``store.save``: the store path's save of a step (encode and hand-off);
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

Recorder = Callable[[str, int, int], None]

_recorder: Recorder | None = None
_NOTHING = contextlib.nullcontext()


def install(recorder: Recorder) -> None:
    """Send every mark's (name, start_ns, end_ns) to ``recorder`` from now on."""
    global _recorder
    _recorder = recorder


def uninstall() -> None:
    global _recorder
    _recorder = None


@contextlib.contextmanager
def recording(recorder: Recorder) -> Iterator[None]:
    """``recorder`` installed for the block (the one installed before comes back after)."""
    global _recorder
    before, _recorder = _recorder, recorder
    try:
        yield
    finally:
        _recorder = before


def mark(name: str) -> contextlib.AbstractContextManager[None]:
    """Time the block under ``name`` if a recorder is installed; else a shared no-op."""
    recorder = _recorder
    if recorder is None:
        return _NOTHING
    return _Mark(name, recorder)


class _Mark:
    __slots__ = ("name", "recorder", "start")

    def __init__(self, name: str, recorder: Recorder) -> None:
        self.name, self.recorder, self.start = name, recorder, 0

    def __enter__(self) -> None:
        self.start = time.perf_counter_ns()

    def __exit__(self, *exc: object) -> None:
        self.recorder(self.name, self.start, time.perf_counter_ns())
