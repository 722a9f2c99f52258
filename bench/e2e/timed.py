"""Timestamped wrappers around KV connectors, so every connector is timed the same way.

``TimedNixlConnector`` is vLLM's ``NixlConnector`` and ``TimedTurboWireConnector`` is turbowire's
``TurboWireConnector``, each with three hooks that only append a timestamp to a JSON-lines file
(``TW_BENCH_EVENTS``) and call the parent unchanged:

- ``request_finished`` (scheduler, prefill engine): ``prefill_done`` -- the prefill engine finished
  the request (its KV is complete and handed to the connector);
- ``update_state_after_alloc`` with external tokens (scheduler, decode engine): ``load_queued``;
- ``get_transfer_results`` (worker, decode engine): ``load_done`` / ``load_failed`` -- the connector
  reports the KV as present in the decode engine's paged cache (for turbowire: pulled, verified
  and decoded into the cache), and ``send_done`` on the prefill engine.

Both engines run on one machine (namespaces do not change clocks), so ``time.time()`` stamps are
comparable across them. Load with ``kv_connector_module_path=turbowire.bench_e2e.timed``.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnector

from turbowire.bench_e2e.events import record

logger = logging.getLogger(__name__)


class _TimingMixin:
    """Adds the timestamps; every method returns exactly what the parent returns."""

    def request_finished(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        out = super().request_finished(request, *args, **kwargs)  # type: ignore[misc]
        params = out[1] if isinstance(out, tuple) and len(out) == 2 else None
        if params:
            record("prefill_done", request.request_id, tokens=request.num_prompt_tokens)
        return out

    def request_finished_all_groups(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        out = super().request_finished_all_groups(request, *args, **kwargs)  # type: ignore[misc]
        params = out[1] if isinstance(out, tuple) and len(out) == 2 else None
        if params:
            record("prefill_done", request.request_id, tokens=request.num_prompt_tokens)
        return out

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> Any:
        if num_external_tokens > 0:
            record("load_queued", request.request_id, tokens=num_external_tokens)
        return super().update_state_after_alloc(request, blocks, num_external_tokens)  # type: ignore[misc]

    def get_transfer_results(self, *args: Any, **kwargs: Any) -> Any:
        res = super().get_transfer_results(*args, **kwargs)  # type: ignore[misc]
        failed = set(getattr(res, "failed_recving", None) or ())
        recv = set(getattr(res, "finished_recving", None) or ()) - failed
        record("load_done", sorted(recv))
        record("load_failed", sorted(failed))
        record("send_done", sorted(getattr(res, "finished_sending", None) or ()))
        return res


class TimedNixlConnector(_TimingMixin, NixlConnector):
    """vLLM's NixlConnector (pull mode), unchanged, plus timestamps -- and one fix-up.

    On CPU, NixlConnector's worker pins the calling thread (the engine worker's main thread, and
    every thread it starts later) to the last core of each NUMA node ("reserve different cores for
    start_load_kv() from model_forward()"). On a 2-core machine that is core 1 for both engines,
    so the prefill and decode engines share one core while the other idles, undoing
    ``VLLM_CPU_OMP_THREADS_BIND``. The wrapper restores the affinity the engine had before the
    connector was built (logged), so both connectors run with the same core placement.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        before = os.sched_getaffinity(0)
        super().__init__(*args, **kwargs)
        after = os.sched_getaffinity(0)
        if after != before:
            os.sched_setaffinity(0, before)
            logger.warning("NixlConnector re-pinned this thread to cores %s; restored %s",
                           sorted(after), sorted(before))


def __getattr__(name: str) -> Any:
    # turbowire's connector is imported only when asked for, so the NIXL baseline works alone.
    if name == "TimedTurboWireConnector":
        from turbowire.connector import TurboWireConnector

        cls = type("TimedTurboWireConnector", (_TimingMixin, TurboWireConnector),
                   {"__doc__": "turbowire's TurboWireConnector, unchanged, plus timestamps.",
                    "__module__": __name__})
        globals()[name] = cls
        return cls
    raise AttributeError(name)
