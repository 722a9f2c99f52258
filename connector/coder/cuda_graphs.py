"""The CUDA coder's decode launches captured into CUDA graphs, and their verdicts' way home.

A load's decode plan is built when its READs are posted (``CudaCoder.prepare_load``); once the
kernels have been launched directly once (compiled: ``warm``), the launch of each of the load's
layer groups, and of the runs of groups the loader is likely to hand over in one call
(``ChunkOffsets.runs``), are captured into graphs there, while the bytes move, and uploaded
(``cuGraphUpload``) so the replay does not pay for it. A replay costs ~6-13 us of host time
against ~35-75 us per direct Triton launch (H200). A capture that fails turns graphs off for
the worker's life: direct launches serve as before.

The flags (each decode program's verdict) come back through a ring of pinned int32 slots behind
an event: no allocation per launch, no host synchronisation until a handle must wait.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from turbowire.connector import probe

logger = logging.getLogger(__name__)

FLAG_SLOTS = 4096  # pinned int32 slots the decode launches' verdicts are copied into (a ring)

Ranges = list[tuple[Any, int, int]]  # (DecodeLayersPlan, lo, hi): positions in a family plan


@dataclass
class Captured:
    """One layer run's launch captured into a CUDA graph, with what its replay needs ready: the
    ranges (for the verdict), the device flags, the pinned slots they are copied into and the
    event recorded after the copies."""

    graph: Any
    ranges: Ranges
    flags: list[torch.Tensor]
    host: torch.Tensor
    slots: list[torch.Tensor]  # host[j:j + 1] per flag
    event: Any


@dataclass
class Launch:
    """One verify + decode launch of a load's contiguous layers and its flags on their way to
    the host (pinned memory, copied after the decode; ``event`` recorded after the copies)."""

    ranges: Ranges
    flags: list[np.ndarray]  # numpy views of the pinned slots, one value per range, in order
    event: Any
    error: BaseException | None = None
    checked: bool = False

    def done(self) -> bool:
        return self.error is not None or self.event is None or bool(self.event.query())

    def check(self) -> None:
        """Wait for the flags (the host synchronisation, if they are not there yet) and raise
        the reference's exception for the first refused chunk."""
        if self.error is not None:
            raise self.error
        if self.event is not None:
            self.event.synchronize()
        if self.checked:
            return
        values = [int(v) for host in self.flags for v in host]
        for (plan, lo, hi), flag in zip(self.ranges, values, strict=True):
            plan.check(lo, hi, flag)  # raises if flagged (reads the statuses back then)
        self.checked = True


class DecodeGraphs:
    """The captured decode launches of one worker's device, and everything they keep alive."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.enabled = self.cuda  # off for good once a capture fails
        self.replays = 0
        self.warm: set[Any] = set()  # kernel keys launched directly (compiled)
        self._stream: torch.cuda.Stream | None = None
        self._pool: Any = None
        # a graph pool whose graphs are all gone trips the caching allocator's assert at the
        # next capture (use_count > 0): the last graphs are kept until the next ones exist
        self._last: list[Any] = []
        # captured launches taken out of their loads, destroyed at the next capture: freeing a
        # load's ~10 graphs on its path took 20-25 us between its landing and its replay (H200)
        self.retired: list[Captured] = []
        self._flags_host: torch.Tensor | None = None
        self._flag_at = 0

    def flag_slots(self, k: int) -> torch.Tensor:
        """k int32 of the pinned ring (a slot is reused FLAG_SLOTS launches later, long after
        its load settled)."""
        if self._flags_host is None:
            self._flags_host = torch.zeros(FLAG_SLOTS, dtype=torch.int32, pin_memory=self.cuda)
        if self._flag_at + k > FLAG_SLOTS:
            self._flag_at = 0
        out = self._flags_host[self._flag_at:self._flag_at + k]
        self._flag_at += k
        return out

    def capture(self, runs: Iterable[tuple[range, Ranges]]) -> dict[tuple[int, int], Captured]:
        """Capture the launch of each run whose kernels are warm; {} when graphs are off."""
        if not self.enabled:
            self.retired.clear()
            return {}
        todo = []
        for layers, ranges in runs:
            ranges = [r for r in ranges if r[0].flag(r[1]) is not None]
            keys = set().union(*(plan.kernel_keys(lo, hi) for plan, lo, hi in ranges))
            if ranges and keys <= self.warm:
                todo.append((layers, ranges))
        captured: dict[tuple[int, int], Captured] = {}
        if todo:
            with probe.mark("coder.capture"):
                captured = self._capture(todo)
        self.retired.clear()  # after the capture: the graph pool keeps a graph alive
        return captured

    def _capture(self, todo: Sequence[tuple[range, Ranges]]) -> dict[tuple[int, int], Captured]:
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
            self._pool = torch.cuda.graph_pool_handle()
        captured = {}
        try:
            for layers, ranges in todo:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.stream(self._stream):
                    graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
                    try:
                        for plan, lo, hi in ranges:
                            plan.launch(lo, hi)
                    finally:
                        graph.capture_end()
                    _upload(graph, self._stream)
                flags = [plan.flag(lo) for plan, lo, _ in ranges]
                host = self.flag_slots(len(flags))
                captured[(layers.start, layers.stop)] = Captured(
                    graph, ranges, flags, host, [host[j:j + 1] for j in range(len(flags))],
                    torch.cuda.Event())
        except Exception as exc:  # noqa: BLE001 - direct launches serve as before
            logger.warning("turbowire: decode launches not captured into a CUDA graph (%s); "
                           "launching them directly from now on", exc)
            self.enabled = False
            return {}
        self._last = [c.graph for c in captured.values()]
        return captured

    def take(self, graphs: dict[tuple[int, int], Captured], layers: range) -> list[Captured]:
        """The captured launches that decode exactly ``layers``: the one of that range, else
        those of consecutive groups covering it; [] if there are none. Every captured launch
        that covers any of these layers is taken out of ``graphs`` (none is ever replayed twice,
        or after its layers were launched otherwise) and retired."""
        if not graphs:
            return []
        caps: list[Captured] = []
        exact = graphs.get((layers.start, layers.stop))
        if exact is not None:
            caps = [exact]
        else:
            inside = {a: (b, c) for (a, b), c in graphs.items()
                      if layers.start <= a and b <= layers.stop}
            at = layers.start
            while at in inside and at < layers.stop:
                at, cap = inside[at]
                caps.append(cap)
            if at != layers.stop:
                caps = []
        for key in [k for k in graphs if k[0] < layers.stop and layers.start < k[1]]:
            self.retired.append(graphs.pop(key))
        return caps

    def replay(self, caps: Sequence[Captured]) -> Launch:
        """Replay ``caps`` back to back on the current stream; their flags follow them home."""
        for cap in caps:
            cap.graph.replay()
            self.replays += 1
            for slot, f in zip(cap.slots, cap.flags, strict=True):
                slot.copy_(f, non_blocking=True)
        event = caps[-1].event
        event.record(torch.cuda.current_stream(self.device))
        return Launch([r for c in caps for r in c.ranges], [c.host.numpy() for c in caps], event)

    def launch(self, ranges: Ranges) -> Launch:
        """Launch ``ranges`` directly (one launch per family plan and layer policy); on CUDA the
        flags go home through the ring behind an event, elsewhere the launches ran inline."""
        for plan, lo, hi in ranges:
            plan.launch(lo, hi)
        live = [(r, r[0].flag(r[1])) for r in ranges]
        live = [(r, f) for r, f in live if f is not None]
        event = None
        if self.cuda:
            for plan, lo, hi in ranges:
                self.warm |= plan.kernel_keys(lo, hi)
            host = self.flag_slots(len(live))
            for j, (_, f) in enumerate(live):
                host[j:j + 1].copy_(f, non_blocking=True)
            if live:
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(self.device))
        else:  # CPU (tests, interpreter)
            host = torch.tensor([int(f) for _, f in live], dtype=torch.int32)
        return Launch([r for r, _ in live], [host.numpy()], event)


_GRAPH_UPLOAD: Any = None


def _upload(graph: Any, stream: Any) -> None:
    """Upload a captured graph's launch resources now (``cuGraphUpload``), not at its first
    (and only) replay, where the load waits for it. Best effort: skipped where the driver or
    this PyTorch does not offer it."""
    global _GRAPH_UPLOAD
    if _GRAPH_UPLOAD is False:
        return
    try:
        if _GRAPH_UPLOAD is None:
            fn = ctypes.CDLL("libcuda.so.1").cuGraphUpload
            fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
            fn.restype = ctypes.c_int
            _GRAPH_UPLOAD = fn
        rc = _GRAPH_UPLOAD(graph.raw_cuda_graph_exec(), stream.cuda_stream)
        if rc != 0:
            raise RuntimeError(f"cuGraphUpload returned {rc}")
    except Exception as exc:  # noqa: BLE001 - the first replay uploads then
        logger.info("turbowire: decode graphs are uploaded at their replay (%s)", exc)
        _GRAPH_UPLOAD = False
