"""The vLLM-facing scheduler side of the connector: one object per engine, a thin dispatcher.

The prefill role (``do_remote_decode`` requests: staging plans, the pool, leases, the side-channel
server) is :class:`~turbowire.connector.sender.Sender`; the decode role (``do_remote_prefill``
requests: params, declines, the load queue, heartbeats) is
:class:`~turbowire.connector.receiver.Receiver`; the store path is
:class:`~turbowire.connector.store_scheduler.StorePlanner` and speculative decoding's positions
the :class:`~turbowire.connector.speculative.DraftLedger`. This class routes vLLM's hooks to
them and runs the maintenance thread (lease reaping, heartbeats, the store registry).

``kv_transfer_params`` that are not a mapping (smuggled through ``vllm_xargs``) are dropped in
``on_new_request``, before vLLM's own scheduler reads them. Every vLLM-facing hook falls back
instead of raising (connector.py): an exception in vLLM's engine-core loop kills the engine with
every request in flight.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from turbowire.connector.config import TurboWireConfig, security_warnings
from turbowire.connector.metadata import TurboWireConnectorMetadata, TurboWireWorkerMeta
from turbowire.connector.params import is_remote_decode, is_remote_prefill, params_mac_key
from turbowire.connector.receiver import Receiver, with_drafts
from turbowire.connector.sender import Sender
from turbowire.connector.spec import EngineSetup
from turbowire.connector.speculative import DraftLedger
from turbowire.connector.stats import TurboWireConnectorStats
from turbowire.kernels import NO_BLOCK

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

MAINTENANCE_PERIOD_S = 0.5


class TurboWireScheduler:
    """Scheduler-side state of one engine (both roles, ``kv_both`` does both)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        kv_cache_config: KVCacheConfig,
        config: TurboWireConfig,
        engine_id: str,
    ) -> None:
        self.vllm_config = vllm_config
        self.config = config
        self.engine_id = engine_id
        setup = EngineSetup.build(vllm_config, kv_cache_config, config)
        self.is_producer, self.is_consumer = setup.is_producer, setup.is_consumer
        self.geometry = setup.geometry
        self.block_size = self.geometry.block_size
        self.codec = setup.codec
        self.layout = setup.layout
        self.tp_size = setup.tp_size
        self.record = setup.record
        self.side_channel_port = (
            config.side_channel_port + vllm_config.parallel_config.data_parallel_index
        )
        self.stats = TurboWireConnectorStats()
        # params MAC key: the prefill role signs with it, the decode role verifies
        mac_key = params_mac_key(config.auth_token) if config.auth_token else None
        self.sender = Sender(
            config, setup, engine_id=engine_id, side_channel_port=self.side_channel_port,
            stats=self.stats, mac_key=mac_key, block_tables=self._request_tables,
        )
        self.pool = self.sender.pool
        self.speculative = setup.speculative
        self.receiver = Receiver(
            config, engine_id=engine_id, block_size=self.block_size, record=self.record,
            tp_size=self.tp_size, prefill_backoff=setup.prefill_backoff,
            stats=self.stats, mac_key=mac_key, state_groups=setup.geometry.state_groups,
        )
        self.drafts = DraftLedger(self.stats) if self.speculative.enabled else None
        self._kv_cache_manager: KVCacheManager | None = None
        self._stop = threading.Event()
        self._maintenance: threading.Thread | None = None
        self.store = None
        if setup.store_scope is not None:
            from turbowire.connector.store_scheduler import StorePlanner

            self.store = StorePlanner(
                config, setup.store_scope, self.block_size, engine_id, self.stats,
                self._request_block_ids,
            )
            logger.info(
                "turbowire store: transport %s, chunks of %d tokens, scope %s, store %s, "
                "directory %s", config.transport, config.store_chunk_tokens,
                setup.store_scope.prefix, _redact(config.store_url) or "local tiers only",
                _redact(config.directory_url) or "none (local index)",
            )
        self.sender.publish_gauges()
        # the gauge values handed to vLLM last (the ones above go with the first step)
        self._published_gauges: tuple[int, int] = self.sender.gauge_values()
        # an idle CPU engine that keeps stepping spins its worker's main thread on a core that
        # other engines' transfer threads need (bench/RESULTS.md "Starved CPUs"): there, steps
        # are only asked for while the exported gauges are known to be stale
        device = getattr(getattr(vllm_config, "device_config", None), "device_type", None)
        self._step_while_leased = device != "cpu"
        if self.speculative.enabled:
            logger.info(
                "turbowire speculative decoding: %s, %d tokens; saves held %d position(s) behind "
                "the verified tokens; prefill backoff %d token(s)", self.speculative.method,
                self.speculative.num_speculative_tokens, self.speculative.draft_lookahead,
                self.speculative.prefill_backoff,
            )
        extra = getattr(vllm_config.kv_transfer_config, "kv_connector_extra_config", None)
        for line in security_warnings(config, extra, producer=self.is_producer,
                                      consumer=self.is_consumer, port=self.side_channel_port):
            logger.warning("turbowire security: %s", line)
        logger.info(
            "turbowire scheduler: engine %s, preset %s, %d layers (%d draft), block %d tokens, "
            "staging %d slots x %d B",
            engine_id,
            config.preset,
            self.geometry.num_layers,
            self.geometry.num_draft_layers,
            self.block_size,
            self.layout.num_slots,
            self.layout.slot_bytes,
        )
        note = self.layout.state_note(self.geometry) if self.is_producer else None
        if note:
            logger.warning("turbowire staging: %s", note)

    # ------------------------------------------------------------------ lifecycle
    def bind_kv_cache_manager(self, manager: KVCacheManager) -> None:
        self._kv_cache_manager = manager

    def set_handshake_metadata(self, metadata: dict[tuple[int, int], Any]) -> None:
        """Workers registered their staging pools: serve them on the side channel."""
        self.sender.serve(metadata)
        self._start_maintenance()

    def _start_maintenance(self) -> None:
        if self._maintenance is None:
            self._maintenance = threading.Thread(
                target=self._maintenance_loop, name="tw-maintenance", daemon=True
            )
            self._maintenance.start()

    def _request_tables(self, request_id: str) -> list[list[int]]:
        """The request's block table of each KV cache group; the blocks a sliding window left
        (vLLM's null block, which stands in for each of them) are ``NO_BLOCK``."""
        assert self._kv_cache_manager is not None, "bind_kv_cache_manager was not called"
        groups = self._kv_cache_manager.get_blocks(request_id).blocks
        return [[NO_BLOCK if b.is_null else b.block_id for b in blocks] for blocks in groups]

    def _request_block_ids(self, request_id: str) -> list[int]:
        """The block table of the first KV cache group (the store path serves one group)."""
        return self._request_tables(request_id)[0]

    def shutdown(self) -> None:
        self._stop.set()
        if self._maintenance is not None:
            self._maintenance.join(timeout=2)
        if self.store is not None:
            self.store.close()
        self.sender.close()
        self.receiver.close()

    # ------------------------------------------------------------------ both roles
    def on_new_request(self, request: Request) -> None:
        params = request.kv_transfer_params
        if params is not None and not isinstance(params, Mapping):
            # vllm_xargs={"kv_transfer_params": "x"} gets here unchecked; vLLM's scheduler calls
            # params.get right after this hook (and would die in its engine loop): drop them
            logger.warning(
                "request %s: kv_transfer_params is a %s, not an object; ignored (a plain "
                "request)", request.request_id, type(params).__name__,
            )
            request.kv_transfer_params = params = None
            self.stats.record_failure("bad_params")
        if self.drafts is not None:
            self.drafts.track(request)
        if self.is_producer and is_remote_decode(params):
            self.sender.track(request)
        elif self.is_consumer and is_remote_prefill(params):
            self.receiver.track(request)
            self._start_maintenance()

    def forget(self, request: Request, finished: bool = False) -> None:
        """Drop what this engine holds for a request after an internal error (connector.py's
        fallback): its reserved staging slots, its heartbeats, and its params (treated as
        refused from now on: nothing more is loaded or dialed for it)."""
        self.sender.forget(request.request_id)  # a lease it already handed on stays
        self.receiver.forget(request.request_id, finished)
        self.sender.publish_gauges()

    def fail_load(self, request: Request) -> None:
        """The load announced to vLLM for ``request`` could not be planned (an internal error
        in ``update_state_after_alloc``): the workers report it failed at once, so vLLM
        recomputes or fails it per ``load_failure_policy`` instead of waiting for KV forever."""
        self.receiver.fail_load(request.request_id, self.config.preset)

    def build_connector_meta(self, scheduler_output: Any) -> TurboWireConnectorMetadata:
        meta = TurboWireConnectorMetadata()
        if self.drafts is not None:
            self.drafts.observe(scheduler_output)
        if self.sender.sending:
            meta.saves.extend(self.sender.plan_saves(scheduler_output.num_scheduled_tokens))
        if self.receiver.pending_loads:
            meta.loads = self.receiver.take_loads()
        if self.store is not None:
            meta.store_loads = self.store.take_loads()
            meta.store_saves = self.store.plan_saves(
                scheduler_output.num_scheduled_tokens, self.speculative.draft_lookahead
            )
        self.sender.reap()
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for req_id in output.finished_recving or ():
            self.receiver.stop_heartbeat(req_id)
        worker_meta = getattr(output, "kv_connector_worker_meta", None)
        if isinstance(worker_meta, TurboWireWorkerMeta):
            reports = self.receiver.reports
            for req_id, report in worker_meta.reports.items():
                prev = reports.get(req_id)
                reports[req_id] = prev.merge(report) if prev else report
                if self.store is not None and report.source == "store" and report.failed:
                    self.store.load_failed(req_id, report.tokens)
            if self.store is not None and worker_meta.stored:
                self.store.note_stored(worker_meta.stored)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        """Dense blocks are always freed now (False); the compressed copy waits under a lease."""
        req_id = request.request_id
        drafts = self.drafts.finished(request) if self.drafts is not None else None
        if self.store is not None:
            self.store.finished(req_id)
        if self.is_consumer and is_remote_prefill(request.kv_transfer_params):
            return False, self.receiver.finished(request, drafts)
        self.receiver.parsed.pop(req_id, None)
        store_report = None
        if self.store is not None:
            report = self.receiver.reports.pop(req_id, None)
            if report is not None:
                store_report = {"turbowire_load": with_drafts(report.as_params(), drafts)}
        staged, params = self.sender.finish(req_id)
        if not staged:
            return False, store_report
        if store_report is not None and params is not None:
            params = {**params, **store_report}
        return False, params or store_report

    def cache_hit_source(self, request_id: str) -> str:
        """Where a request's external tokens come from: ``store`` or ``p2p``."""
        if self.store is not None and self.store.is_store_load(request_id):
            return "store"
        return "p2p"

    def get_stats(self) -> TurboWireConnectorStats | None:
        """What vLLM carries to the frontend this step. The staging gauges are re-read from
        the live pool whenever they differ from what was last handed out (a release or a lease
        expiry on another thread), so the exported values catch up on the next step."""
        live = self.sender.gauge_values()
        if live != self._published_gauges:
            self.sender.publish_gauges()
        if self.stats.is_empty():
            return None
        self._published_gauges = live
        return self.stats.clone_and_reset()

    def has_pending_push_work(self) -> bool:
        """Keep vLLM's engine loop stepping (vLLM's hook; an idle engine otherwise blocks on its
        input queue and sends no stats at all) while leases are outstanding, or while the live
        staging gauges differ from the exported ones. The pool lives in the engine-core process
        and ``/metrics`` is served by the frontend, which only hears of it through the stats of
        an engine step: without this, a lease released or expired after the last request (the
        reaper thread frees it) left ``turbowire_staging_in_use_bytes`` and
        ``turbowire_leases_outstanding`` at their last value forever. Bounded: leases end within
        ``lease_seconds``, then one step exports the empty pool and the engine idles again
        (empty steps, like vLLM's NixlConnector stepping until its delayed frees are read).

        Not on CPU engines: there an idle engine's empty steps spin its worker's main thread on
        a core shared with other engines' NIXL threads; a decode engine's first READ from it
        then stalled past ``lease_seconds`` (5 pinned engines on 2 cores). A CPU engine steps
        only while the exported gauges are known to differ from the pool; a lease that expires
        after the engine went idle is exported at its next step."""
        live = self.sender.gauge_values()
        if live != self._published_gauges:
            return True
        return self._step_while_leased and live[1] > 0

    # ------------------------------------------------------------------ decode role
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Remote prompt tokens beyond the local prefix hit; side-effect free (cached parse)."""
        if not is_remote_prefill(request.kv_transfer_params):
            if self.store is None:
                return 0, False
            self._start_maintenance()  # the registry heartbeat
            count = self.store.lookup(request, num_computed_tokens)
            return (count, True) if count > 0 else (0, False)
        if not self.is_consumer:
            return 0, False
        return self.receiver.matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if self.store is not None and not is_remote_prefill(request.kv_transfer_params):
            self.store.after_alloc(request, blocks, num_external_tokens)
            return
        if (
            not self.is_consumer
            or not is_remote_prefill(request.kv_transfer_params)
            or request.request_id in self.receiver.load_queued
        ):
            return
        remote = self.receiver.parse(request)
        if self.store is not None:
            # this engine saves what it computes itself: from the first chunk not loaded
            loaded = (self.receiver.remote_total(remote, request)
                      if remote and num_external_tokens else 0)
            self.store.track_decode(request, loaded)
        if remote is not None:
            self.receiver.queue_load(request, remote, blocks, num_external_tokens)

    # ------------------------------------------------------------------ background
    def _maintenance_loop(self) -> None:
        """Reap expired leases (prefill) and send heartbeats for waiting loads (decode)."""
        while not self._stop.wait(MAINTENANCE_PERIOD_S):
            try:
                if self.is_producer:
                    self.sender.reap()
                if self.is_consumer:
                    self.receiver.send_heartbeats()
                if self.store is not None:
                    self.store.maintain(
                        self.vllm_config.kv_transfer_config.kv_role or "kv_both",
                        f"{self.config.side_channel_host}:{self.side_channel_port}", self.record,
                    )
            except Exception:  # noqa: BLE001 - a background hiccup must not kill the engine
                logger.exception("turbowire maintenance step failed")


def _redact(url: str | None) -> str | None:
    """A URL without its password, for logs."""
    if not url or "@" not in url:
        return url
    scheme, _, rest = url.partition("://")
    return f"{scheme}://***@{rest.rsplit('@', 1)[1]}"
