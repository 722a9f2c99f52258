"""Scheduler side of the connector: what to encode, what to load, leases, kv_transfer_params.

Prefill role (``do_remote_decode`` requests): every step, the blocks that became complete (and,
when the prompt is done, the partial last block) get staging slots and an encode order for the
worker. A full pool is back-pressure: the request falls back to local recompute on the decode
engine (``turbowire_fallback``), its slots are returned, and the fallback is counted.
``request_finished`` frees the dense blocks at once and turns the slots into a lease.

Decode role (``do_remote_prefill`` requests): ``get_num_new_matched_tokens`` announces the
remote tokens (async load) after validating the params; ``update_state_after_alloc`` queues the
load into the newly allocated blocks; heartbeats keep the prefill lease alive while the request
waits; load reports from the workers are returned in the finished request's params.

What the params name is not trusted: with an ``auth_token`` their MAC
(``turbowire_params_mac``) must verify, and with ``prefill_peers`` their host must be listed,
before anything is dialed (a heartbeat, a handshake, a release); the claim and every heartbeat
present this engine's own prompt, which the prefill engine compares with the one it staged.
``kv_transfer_params`` that are not a mapping (smuggled through ``vllm_xargs``) are dropped in
``on_new_request``, before vLLM's own scheduler reads them. Every vLLM-facing hook falls back
instead of raising (connector.py): an exception in vLLM's engine-core loop kills the engine with
every request in flight.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from turbowire.connector.config import TurboWireConfig, security_warnings
from turbowire.connector.geometry import block_tag, blocks_for_tokens, tokens_in_block
from turbowire.connector.metadata import (
    LoadBlock,
    LoadReport,
    LoadRequest,
    PeerAddress,
    SaveBlock,
    SaveRequest,
    TurboWireConnectorMetadata,
    TurboWireHandshakeMetadata,
    TurboWireWorkerMeta,
)
from turbowire.connector.params import (
    PeerAllowlist,
    PeerNotAllowedError,
    RemotePrefill,
    TransferParamsError,
    is_remote_decode,
    is_remote_prefill,
    params_mac_key,
    prefill_result,
    prompt_digest,
)
from turbowire.connector.spec import EngineSetup
from turbowire.connector.speculative import (
    DraftLedger,
    remote_prefill_tokens,
    truncate_for_prefill,
)
from turbowire.connector.staging import (
    DuplicateLeaseError,
    LeaseAnswer,
    PromptClaim,
    StagingFullError,
    StagingPool,
)
from turbowire.connector.stats import TurboWireConnectorStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

MAINTENANCE_PERIOD_S = 0.5
#: A waiting decode request's first heartbeat goes out this long after it arrived (its load's
#: claim usually comes first): well within the prefill engine's claim_timeout_seconds (>= 2 s)
FIRST_HEARTBEAT_S = 1.0
MAX_LET_GO = 65536  # remembered released leases (a few MiB at most)


@dataclass
class SendState:
    """A prefill request whose KV is being staged."""

    request: Request
    encoded_blocks: int = 0
    fallback: str | None = None
    wire_bytes: int = 0
    dense_bytes: int = 0


@dataclass
class HeartbeatTarget:
    host: str
    port: int
    remote_request_id: str
    lease_token: str = field(repr=False)  # the lease's capability: never in a repr or log line
    interval: float
    # set so that the first heartbeat goes out FIRST_HEARTBEAT_S after arrival: it claims the
    # lease of a request still queued here before the prefill engine's claim_timeout_seconds
    last_sent: float = field(default_factory=time.monotonic)
    prompt: PromptClaim = ("", 0)  # this engine's prompt (digest, tokens), presented with it
    request_id: str = ""  # the decode request waiting for it


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
        share = config.staging_request_share
        self.pool = StagingPool(
            self.layout.num_slots, config.lease_seconds, on_refused=self._lease_refused,
            on_mismatch=self._prompt_mismatch, claim_seconds=config.claim_deadline_seconds,
            max_age_seconds=config.lease_age_cap_seconds,
            max_request_slots=None if share >= 1 else max(1, int(share * self.layout.num_slots)),
        )
        # params MAC key (sign as prefill, verify as decode) and the peers this engine may dial
        self._mac_key = params_mac_key(config.auth_token) if config.auth_token else None
        self._allowlist = PeerAllowlist.parse(config.prefill_peers)
        self.speculative = setup.speculative
        self.drafts = DraftLedger(self.stats) if self.speculative.enabled else None
        self._kv_cache_manager: KVCacheManager | None = None
        self._send: dict[str, SendState] = {}
        self._pending_loads: list[LoadRequest] = []
        # (prefill engine, remote request id) of the leases this engine's loads already let go
        # (loaded or released): vLLM's cleanup request for the same request sends no second one
        self._let_go: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._load_queued: set[str] = set()
        self._parsed: dict[str, RemotePrefill | None] = {}
        self._reports: dict[str, LoadReport] = {}
        self._heartbeats: dict[str, HeartbeatTarget] = {}
        self._hb_lock = threading.Lock()
        self._hb_inflight: set[tuple[str, int]] = set()  # peers with a heartbeat on the wire
        self._hb_lanes: Any = None  # PeerExecutors: heartbeats to each peer on its own thread
        self._server: Any = None
        self._clients: Any = None
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
        self._publish_gauges()
        # the gauge values handed to vLLM last (the ones above go with the first step)
        self._published_gauges: tuple[int, int] = self._gauge_values()
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

    # ------------------------------------------------------------------ lifecycle
    def bind_kv_cache_manager(self, manager: KVCacheManager) -> None:
        self._kv_cache_manager = manager

    def set_handshake_metadata(self, metadata: dict[tuple[int, int], Any]) -> None:
        """Workers registered their staging pools: serve them on the side channel."""
        from turbowire.connector.sidechannel.convert import StagingInfo
        from turbowire.connector.sidechannel.server import SideChannelServer, SideChannelTLS

        staging: dict[int, StagingInfo] = {}
        for (pp_rank, tp_rank), meta in metadata.items():
            if pp_rank != 0:
                raise ValueError("turbowire does not support pipeline-parallel KV transfer yet")
            if not isinstance(meta, TurboWireHandshakeMetadata):
                raise TypeError(f"unexpected handshake metadata {type(meta).__name__}")
            staging[tp_rank] = StagingInfo(
                agent_name=meta.agent_name,
                agent_metadata=meta.agent_metadata,
                base_addr=meta.base_addr,
                slot_bytes=meta.slot_bytes,
                num_slots=meta.num_slots,
                layer_offsets=tuple(meta.layer_offsets),
                device_id=meta.device_id,
                mem_type=meta.mem_type,
            )
            if meta.slot_bytes != self.layout.slot_bytes or meta.num_slots != self.layout.num_slots:
                raise RuntimeError(
                    "worker staging layout differs from the scheduler's "
                    f"({meta.num_slots}x{meta.slot_bytes} vs "
                    f"{self.layout.num_slots}x{self.layout.slot_bytes})"
                )
        if self._server is None and staging and self.is_producer:
            self._server = SideChannelServer(
                engine_id=self.engine_id,
                record=self.record,
                staging=staging,
                leases=_GaugedLeases(self),
                lease_seconds=self.config.lease_seconds,
                bind_host=self.config.side_channel_bind,
                port=self.side_channel_port,
                auth_token=self.config.auth_token,
                tls=SideChannelTLS.from_config(self.config),
            ).start()
        self._start_maintenance()

    def _start_maintenance(self) -> None:
        if self._maintenance is None:
            self._maintenance = threading.Thread(
                target=self._maintenance_loop, name="tw-maintenance", daemon=True
            )
            self._maintenance.start()

    def _request_block_ids(self, request_id: str) -> list[int]:
        assert self._kv_cache_manager is not None, "bind_kv_cache_manager was not called"
        return list(self._kv_cache_manager.get_block_ids(request_id)[0])

    def shutdown(self) -> None:
        self._stop.set()
        if self._maintenance is not None:
            self._maintenance.join(timeout=2)
        if self.store is not None:
            self.store.close()
        if self._server is not None:
            self._server.stop()
            self._server = None
        if self._hb_lanes is not None:
            self._hb_lanes.shutdown(wait=False, cancel_futures=True)
        if self._clients is not None:
            self._clients.close()

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
            if truncate_for_prefill(request, self.speculative.prefill_backoff):
                logger.debug(
                    "request %s: the last %d prompt token(s) are left to the decode engine",
                    request.request_id, self.speculative.prefill_backoff,
                )
            self._send[request.request_id] = SendState(request)
        elif self.is_consumer and is_remote_prefill(params):
            if _is_cleanup(request):
                return  # nothing to load or heartbeat: request_finished queues the release
            remote = self._parse(request)
            if remote is not None and remote.slots:
                interval = max(0.5, remote.lease_seconds / 3)
                with self._hb_lock:
                    self._heartbeats[request.request_id] = HeartbeatTarget(
                        host=remote.host,
                        port=remote.port,
                        remote_request_id=remote.request_id,
                        lease_token=remote.lease_token or "",
                        interval=interval,
                        last_sent=time.monotonic() - interval + min(interval, FIRST_HEARTBEAT_S),
                        prompt=self._claim_prompt(request, remote),
                        request_id=request.request_id,
                    )
            self._start_maintenance()

    def forget(self, request: Request, finished: bool = False) -> None:
        """Drop what this engine holds for a request after an internal error (connector.py's
        fallback): its reserved staging slots, its heartbeats, and its params (treated as
        refused from now on: nothing more is loaded or dialed for it)."""
        rid = request.request_id
        self._send.pop(rid, None)
        self.pool.drop(rid)  # reserved slots only: a lease it already handed on stays
        self._stop_heartbeat(rid)
        self._load_queued.discard(rid)
        self._reports.pop(rid, None)
        if finished:
            self._parsed.pop(rid, None)
        else:
            self._parsed[rid] = None
        self._publish_gauges()

    def fail_load(self, request: Request) -> None:
        """The load announced to vLLM for ``request`` could not be planned (an internal error
        in ``update_state_after_alloc``): the workers report it failed at once, so vLLM
        recomputes or fails it per ``load_failure_policy`` instead of waiting for KV forever."""
        rid = request.request_id
        remote = self._parsed.get(rid)
        if remote is not None:
            load = _load_request(rid, remote, self._peer(remote), [])
        else:
            load = LoadRequest(rid, "", PeerAddress("", "", 0, 1), [], self.config.preset)
        load.fail_reason = "internal"
        self._load_queued.add(rid)
        self._stop_heartbeat(rid)
        self._queue_load(load)

    def build_connector_meta(self, scheduler_output: Any) -> TurboWireConnectorMetadata:
        meta = TurboWireConnectorMetadata()
        if self.drafts is not None:
            self.drafts.observe(scheduler_output)
        if self._send:
            for req_id, num_scheduled in scheduler_output.num_scheduled_tokens.items():
                state = self._send.get(req_id)
                if state is not None and state.fallback is None:
                    try:
                        save = self._plan_save(state, num_scheduled)
                    except Exception:  # noqa: BLE001 - one request falls back, the step goes on
                        logger.exception(
                            "turbowire: staging request %s failed; the decode engine recomputes "
                            "its prompt", req_id,
                        )
                        self.pool.drop(req_id)
                        state.fallback = "internal"
                        self.stats.record_failure("internal")
                        continue
                    if save is not None:
                        meta.saves.append(save)
        if self._pending_loads:
            meta.loads = self._pending_loads
            self._pending_loads = []
        if self.store is not None:
            meta.store_loads = self.store.take_loads()
            meta.store_saves = self.store.plan_saves(
                scheduler_output.num_scheduled_tokens, self.speculative.draft_lookahead
            )
        self._reap()
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for req_id in output.finished_recving or ():
            self._stop_heartbeat(req_id)
        worker_meta = getattr(output, "kv_connector_worker_meta", None)
        if isinstance(worker_meta, TurboWireWorkerMeta):
            for req_id, report in worker_meta.reports.items():
                prev = self._reports.get(req_id)
                self._reports[req_id] = prev.merge(report) if prev else report
                if self.store is not None and report.source == "store" and report.failed:
                    self.store.load_failed(req_id, report.tokens)
            if self.store is not None and worker_meta.stored:
                self.store.note_stored(worker_meta.stored)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        """Dense blocks are always freed now (False); the compressed copy waits under a lease."""
        req_id = request.request_id
        params = request.kv_transfer_params
        drafts = self.drafts.finished(request) if self.drafts is not None else None
        if self.store is not None:
            self.store.finished(req_id)
        if self.is_consumer and is_remote_prefill(params):
            self._stop_heartbeat(req_id)
            if req_id not in self._load_queued:
                # Aborted before it was scheduled, or its params were refused: the prefill engine
                # still waits for a release. The cached parse is reused (a fresh one would count
                # a refusal twice), then dropped.
                self._queue_release_only(request)
            self._parsed.pop(req_id, None)
            self._load_queued.discard(req_id)
            report = self._reports.pop(req_id, None)
            if report is not None:
                return False, {"turbowire_load": _with_drafts(report.as_params(), drafts)}
            return False, None
        self._parsed.pop(req_id, None)
        store_report = None
        if self.store is not None:
            report = self._reports.pop(req_id, None)
            if report is not None:
                store_report = {"turbowire_load": _with_drafts(report.as_params(), drafts)}
        state = self._send.pop(req_id, None)
        if state is None:
            return False, store_report
        params = self._finish_send(state)
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
        live = self._gauge_values()
        if live != self._published_gauges:
            self._publish_gauges()
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
        live = self._gauge_values()
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
        if not self.is_consumer or _is_cleanup(request):
            return 0, False
        if request.request_id in self._load_queued:
            return 0, False
        remote = self._parse(request)
        if remote is None or remote.num_tokens == 0:
            return 0, False
        count = self._remote_total(remote, request) - num_computed_tokens
        if count <= 0 or count < self.config.min_transfer_tokens:
            return 0, False
        return count, True

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        req_id = request.request_id
        if self.store is not None and not is_remote_prefill(request.kv_transfer_params):
            self.store.after_alloc(request, blocks, num_external_tokens)
            return
        if (
            not self.is_consumer
            or not is_remote_prefill(request.kv_transfer_params)
            or req_id in self._load_queued
        ):
            return
        remote = self._parse(request)
        if self.store is not None:
            # this engine saves what it computes itself: from the first chunk not loaded
            loaded = self._remote_total(remote, request) if remote and num_external_tokens else 0
            self.store.track_decode(request, loaded)
        if remote is None:
            return
        self._load_queued.add(req_id)
        peer = self._peer(remote)
        if num_external_tokens <= 0:
            if remote.slots:  # full local hit (or declined): only let the prefill engine go
                self._queue_load(_load_request(req_id, remote, peer, []))
            return
        claim = self._claim_prompt(request, remote)
        total = self._remote_total(remote, request)
        first_token = total - num_external_tokens
        first_block = first_token // self.block_size
        last_block = blocks_for_tokens(total, self.block_size)
        group = blocks.blocks[0]
        if len(group) < last_block:
            logger.error(
                "request %s: %d local blocks allocated, %d needed; loading nothing",
                req_id, len(group), last_block,
            )
            self._queue_load(_load_request(req_id, remote, peer, []))
            return
        load_blocks = [
            LoadBlock(
                index=i,
                block_id=group[i].block_id,
                num_tokens=tokens_in_block(i, total, self.block_size),
                slot=remote.slots[i],
                tag=block_tag(remote.request_id, i),
            )
            for i in range(first_block, last_block)
        ]
        self._queue_load(
            _load_request(
                req_id, remote, peer, load_blocks, [b.block_id for b in group[:last_block]],
                prompt=claim,
            )
        )

    def _remote_total(self, remote: RemotePrefill, request: Request) -> int:
        """Prompt tokens loaded from the peer: never the backoff a drafter needs recomputed."""
        cap = remote_prefill_tokens(request.num_prompt_tokens, self.speculative.prefill_backoff)
        return min(remote.num_tokens, cap)

    def _parse(self, request: Request) -> RemotePrefill | None:
        """Validate a decode request's params once; malformed ones are logged and recomputed."""
        req_id = request.request_id
        if req_id in self._parsed:
            return self._parsed[req_id]
        params = request.kv_transfer_params or {}
        remote: RemotePrefill | None
        try:
            remote = RemotePrefill.parse(params, self.block_size)
            self._authenticate(remote)
        except TransferParamsError as exc:
            logger.error("request %s: %s; its prompt is recomputed locally", req_id, exc)
            self.stats.record_failure(exc.reason)
            remote = None
        else:
            problem = self._decline_reason(request, remote)
            if problem is not None:
                reason, message = problem
                logger.warning("request %s: %s; its prompt is recomputed locally", req_id, message)
                if reason == "fallback":
                    self.stats.record_fallback(remote.fallback or "unknown")
                else:
                    self.stats.record_failure(reason)
                # Load nothing, but keep the slots so the prefill engine's lease is released.
                remote = dataclasses.replace(remote, num_tokens=0)
        self._parsed[req_id] = remote
        return remote

    def _authenticate(self, remote: RemotePrefill) -> None:
        """Before anything is dialed or resolved for these params: their MAC (an engine with an
        ``auth_token``) and their peer (``prefill_peers``). Raises the refusal."""
        if self._mac_key is not None:
            remote.verify_mac(self._mac_key)
        if not self._allowlist.allows(remote.host, remote.port):
            raise PeerNotAllowedError(
                f"kv_transfer_params name prefill engine {remote.host}:{remote.port}, which is "
                "not in prefill_peers; nothing is dialed"
            )

    def _claim_prompt(self, request: Request, remote: RemotePrefill) -> PromptClaim:
        """(digest, tokens) of this engine's own prompt as the lease must hold it: presented
        with every heartbeat and the claim. ("", 0) (nothing checked) for declined params, which
        load nothing, and for a prompt without token ids."""
        tokens = request.prompt_token_ids
        if tokens is None or remote.num_tokens <= 0:
            return ("", 0)
        n = min(remote.num_tokens, request.num_prompt_tokens)
        return prompt_digest(tokens, n), n

    def _decline_reason(self, request: Request, remote: RemotePrefill) -> tuple[str, str] | None:
        if remote.fallback:
            return "fallback", f"prefill engine sent no KV ({remote.fallback})"
        if remote.format_version != self.record.format_version:
            return (
                "incompatible",
                f"prefill engine speaks turbowire transfer format {remote.format_version}, this "
                f"engine {self.record.format_version} (format 2 added lease tokens); run the "
                "same turbowire version on both engines",
            )
        if remote.preset != self.config.preset:
            return (
                "incompatible",
                f"prefill preset {remote.preset!r} differs from this engine's "
                f"{self.config.preset!r}",
            )
        if remote.tp_size != self.tp_size:
            return "incompatible", f"prefill tp_size {remote.tp_size} != {self.tp_size}"
        if remote.prompt_hash is not None and request.prompt_token_ids is not None:
            n = min(remote.num_tokens, request.num_prompt_tokens)
            if prompt_digest(request.prompt_token_ids, n) != remote.prompt_hash:
                return "prompt_mismatch", "prompt tokens differ from the prefill engine's"
        return None

    def _queue_release_only(self, request: Request) -> None:
        if _is_cleanup(request):
            remote = self._parse_cleanup(request)
            if remote is not None and self._already_let_go(remote):
                logger.debug(
                    "cleanup request %s: the lease of %s was already released by its load",
                    request.request_id, remote.request_id,
                )
                return
        else:
            remote = self._parse(request)
        if remote is None or not remote.slots:
            return
        self._queue_load(_load_request(request.request_id, remote, self._peer(remote), []))

    def _parse_cleanup(self, request: Request) -> RemotePrefill | None:
        """The params of vLLM's pre-aborted cleanup request, which exists only to let the
        prefill engine free its lease (``notify_kv_transfer_request_rejected``: the serving layer
        refused or errored a request, e.g. after a ``load_failure_policy: fail`` load failure).
        Its prompt is a placeholder (``[0]``), so the load checks (prompt hash, preset, TP)
        do not apply, and nothing is counted: the request it stands for was counted by its own
        load, or never reached the connector. Malformed params are logged, not counted."""
        try:
            remote = RemotePrefill.parse(request.kv_transfer_params or {}, self.block_size)
            self._authenticate(remote)  # nothing goes to a host the params merely name
            return remote
        except TransferParamsError as exc:
            logger.info(
                "cleanup request %s: %s; no lease to release", request.request_id, exc
            )
            return None

    def _peer(self, remote: RemotePrefill) -> PeerAddress:
        return PeerAddress(remote.engine_id, remote.host, remote.port, remote.tp_size)

    def _queue_load(self, load: LoadRequest) -> None:
        """Hand a load (or a release) to the workers; remember that its lease is let go."""
        key = (load.peer.engine_id, load.remote_request_id)
        self._let_go[key] = None
        self._let_go.move_to_end(key)
        while len(self._let_go) > MAX_LET_GO:
            self._let_go.popitem(last=False)
        self._pending_loads.append(load)

    def _already_let_go(self, remote: RemotePrefill) -> bool:
        return (remote.engine_id, remote.request_id) in self._let_go

    def _stop_heartbeat(self, req_id: str) -> None:
        with self._hb_lock:
            self._heartbeats.pop(req_id, None)

    # ------------------------------------------------------------------ prefill role
    def _plan_save(self, state: SendState, num_scheduled: int) -> SaveRequest | None:
        request = state.request
        prompt_len = request.num_prompt_tokens
        computed_after = request.num_computed_tokens + num_scheduled
        if computed_after >= prompt_len:
            target_blocks = blocks_for_tokens(prompt_len, self.block_size)
        else:
            target_blocks = computed_after // self.block_size
        new = range(state.encoded_blocks, target_blocks)
        if not new:
            return None
        try:
            slots = self.pool.reserve(request.request_id, len(new))
        except StagingFullError as exc:  # the pool is full, or the request's share of it
            logger.warning(
                "request %s: %s; the decode engine recomputes its prompt", request.request_id, exc
            )
            self.pool.drop(request.request_id)
            state.fallback = exc.reason
            self.stats.record_fallback(exc.reason)
            return None
        except DuplicateLeaseError as exc:  # a repeated request id: the first one keeps its lease
            logger.warning(
                "request %s: %s; this one is not staged (the decode engine recomputes it)",
                request.request_id, exc,
            )
            self.pool.drop(request.request_id)
            state.fallback = "internal"
            self.stats.record_failure("internal")
            return None
        assert self._kv_cache_manager is not None, "bind_kv_cache_manager was not called"
        block_ids = self._kv_cache_manager.get_block_ids(request.request_id)[0]
        blocks = []
        for i, slot in zip(new, slots, strict=True):
            n = tokens_in_block(i, prompt_len, self.block_size)
            blocks.append(
                SaveBlock(
                    index=i,
                    block_id=block_ids[i],
                    num_tokens=n,
                    slot=slot,
                    tag=block_tag(request.request_id, i),
                )
            )
            state.wire_bytes += sum(
                self.codec.encoded_nbytes(layer, n, spec.num_kv_heads, i * self.block_size)
                for layer, spec in enumerate(self.geometry.layers)
            )
            state.dense_bytes += n * self.geometry.dense_bytes_per_token(self._element_size())
        state.encoded_blocks = target_blocks
        self._publish_gauges()
        return SaveRequest(request.request_id, list(block_ids[:target_blocks]), blocks)

    def _finish_send(self, state: SendState) -> dict[str, Any] | None:
        from vllm.v1.request import RequestStatus

        request = state.request
        req_id = request.request_id
        if request.status not in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH_CAPPED,
        ):
            self.pool.drop(req_id)
            self._publish_gauges()
            return None
        expected_blocks = blocks_for_tokens(request.num_prompt_tokens, self.block_size)
        if state.fallback is None and state.encoded_blocks != expected_blocks:
            state.fallback = "incomplete"
            self.stats.record_fallback("incomplete")
            logger.warning(
                "request %s finished with %d of %d blocks staged", req_id,
                state.encoded_blocks, expected_blocks,
            )
        common = dict(
            engine_id=self.engine_id,
            request_id=req_id,
            host=self.config.side_channel_host,
            port=self.side_channel_port,
            tp_size=self.tp_size,
            preset=self.config.preset,
            format_version=self.record.format_version,
            lease_seconds=self.config.lease_seconds,
            mac_key=self._mac_key,
        )
        num_tokens = request.num_prompt_tokens
        digest = None
        lease = None
        if state.fallback is None:
            prompt = request.prompt_token_ids or []
            digest = prompt_digest(prompt, num_tokens) if prompt else None
            try:  # bound to the prompt staged: a claim presenting another is refused
                lease = self.pool.lease(req_id, state.wire_bytes, consumers=self.tp_size,
                                        prompt_digest=digest, num_tokens=num_tokens)
            except DuplicateLeaseError as exc:
                logger.warning("request %s: %s; not handed to a decode engine", req_id, exc)
                state.fallback = "internal"
                self.stats.record_failure("internal")
        if state.fallback is not None:
            self.pool.drop(req_id)
            self._publish_gauges()
            return prefill_result(
                **common, slots=[], num_tokens=0, prompt_hash=None, dense_bytes=0,
                wire_bytes=0, fallback=state.fallback,
            )
        assert lease is not None
        self._publish_gauges()
        return prefill_result(
            **common,
            slots=lease.slots,
            num_tokens=num_tokens,
            prompt_hash=digest,
            dense_bytes=state.dense_bytes,
            wire_bytes=state.wire_bytes,
            lease_token=lease.token,
        )

    def _element_size(self) -> int:
        import torch

        return torch.empty((), dtype=getattr(torch, self.geometry.dtype)).element_size()

    def _reap(self) -> None:
        expired = self.pool.reap()
        for _ in expired:
            self.stats.record_failure("lease_expired")
        if expired:
            self._publish_gauges()

    def _lease_refused(self, missing: list[str], wrong: list[str]) -> None:
        """Side-channel calls that named a lease without its token (gRPC threads): counted once
        per lease, ``incompatible`` without a token (a decode engine of transfer format 1),
        ``lease_refused`` with a wrong one (forged or altered kv_transfer_params; the decode
        engine whose claim was refused counts the same reason)."""
        for _ in missing:
            self.stats.record_failure("incompatible")
        for _ in wrong:
            self.stats.record_failure("lease_refused")

    def _prompt_mismatch(self, ids: list[str]) -> None:
        """Claims (gRPC threads) that presented another prompt than the lease's: params of one
        prompt sent with another. Counted once per lease; the decode engine counts its failed
        load by the same reason."""
        for _ in ids:
            self.stats.record_failure("prompt_mismatch")

    def _gauge_values(self) -> tuple[int, int]:
        """(staging bytes in use, leases outstanding) of the pool right now. Every TP worker
        holds a staging pool of the same slots, so the bytes are summed over the workers."""
        snap = self.pool.snapshot()
        return snap.used_slots * self.layout.slot_bytes * self.tp_size, snap.leases

    def _publish_gauges(self) -> None:
        """The staging gauges, all three owned by the scheduler (the workers set none): they
        share one ``worker`` label, and vLLM merges worker and scheduler stats of a step by
        overwriting the same series, so a second owner's reading made the exported value depend
        on which side reported last (a decode-only engine exported the capacity of a staging
        pool it never allocated)."""
        in_use, leases = self._gauge_values()
        capacity = self.layout.pool_bytes * self.tp_size if self.is_producer else 0
        self.stats.set_gauge("staging_bytes_in_use", in_use)
        self.stats.set_gauge("staging_capacity_bytes", capacity)
        self.stats.set_gauge("leases_outstanding", leases)

    # ------------------------------------------------------------------ background
    def _maintenance_loop(self) -> None:
        """Reap expired leases (prefill) and send heartbeats for waiting loads (decode)."""
        while not self._stop.wait(MAINTENANCE_PERIOD_S):
            try:
                if self.is_producer:
                    self._reap()
                if self.is_consumer:
                    self._send_heartbeats()
                if self.store is not None:
                    self.store.maintain(
                        self.vllm_config.kv_transfer_config.kv_role or "kv_both",
                        f"{self.config.side_channel_host}:{self.side_channel_port}", self.record,
                    )
            except Exception:  # noqa: BLE001 - a background hiccup must not kill the engine
                logger.exception("turbowire maintenance step failed")

    def _send_heartbeats(self) -> None:
        """Hand the due heartbeats to their peers' lanes (one call per peer, at most
        ``MAX_IDS_PER_CALL`` ids each, a peer skipped while its last one is on the wire): the
        maintenance thread never waits on the network, and a peer that never answers delays
        no other peer's heartbeats (they were sent one peer after another, each up to
        ``handshake_timeout_seconds``)."""
        now = time.monotonic()
        due: dict[tuple[str, int], list[HeartbeatTarget]] = {}
        with self._hb_lock:
            for target in self._heartbeats.values():
                key = (target.host, target.port)
                if key in self._hb_inflight:
                    continue
                if now - target.last_sent >= target.interval:
                    target.last_sent = now
                    due.setdefault(key, []).append(target)
            self._hb_inflight.update(due)
        if not due:
            return
        if self._clients is None:
            from turbowire.connector.sidechannel.client import ClientPool

            self._clients = ClientPool.from_config(self.config)
        if self._hb_lanes is None:
            from turbowire.connector.sidechannel.client import PeerExecutors

            self._hb_lanes = PeerExecutors(self.config.max_peers, threads_per_peer=1,
                                           thread_name_prefix="tw-heartbeat")
        for key, targets in due.items():
            try:
                self._hb_lanes.submit_to(key, self._heartbeat_peer, key, targets)
            except RuntimeError:  # shut down
                with self._hb_lock:
                    self._hb_inflight.discard(key)

    def _heartbeat_peer(self, key: tuple[str, int], targets: list[HeartbeatTarget]) -> None:
        """One peer's heartbeats (its lane's thread); refused or mismatched leases are not
        heartbeated again."""
        from turbowire.connector.sidechannel.client import batched

        host, port = key
        try:
            for rows in batched(targets):
                batch = [targets[i] for i in rows]
                try:
                    reply = self._clients.get(host, port).heartbeat(
                        [t.remote_request_id for t in batch], self.engine_id,
                        lease_tokens=[t.lease_token for t in batch],
                        prompts=[t.prompt for t in batch],
                    )
                except Exception as exc:  # noqa: BLE001 - logged and counted, retried next period
                    logger.warning("heartbeat to %s:%d failed: %s", host, port, exc)
                    self.stats.record_failure("peer_unreachable")
                    return
                self._heartbeat_answered(host, port, batch, reply)
        finally:
            with self._hb_lock:
                self._hb_inflight.discard(key)

    def _heartbeat_answered(self, host: str, port: int, batch: list[HeartbeatTarget],
                            reply: Any) -> None:
        refused = set(reply.refused)
        mismatched = set(getattr(reply, "prompt_mismatch", ()))
        if refused:
            logger.warning(
                "prefill engine %s:%d refused heartbeats for leases %s: the lease token in "
                "their kv_transfer_params is not the lease's (altered params, or another "
                "request's)", host, port, sorted(refused)[:5],
            )
        if mismatched:
            logger.warning(
                "prefill engine %s:%d refused heartbeats for leases %s: they hold the KV of "
                "another prompt than this engine's requests (kv_transfer_params of another "
                "prompt)", host, port, sorted(mismatched)[:5],
            )
        expired = [rid for rid in reply.unknown if rid not in refused and rid not in mismatched]
        if expired:
            logger.warning(
                "prefill engine %s:%d no longer holds leases %s (expired?)",
                host, port, expired[:5],
            )
        if refused or mismatched:
            with self._hb_lock:
                for t in batch:
                    if t.remote_request_id in refused | mismatched and t.request_id:
                        self._heartbeats.pop(t.request_id, None)


def _load_request(
    req_id: str,
    remote: RemotePrefill,
    peer: PeerAddress,
    blocks: list[LoadBlock],
    block_ids: list[int] | None = None,
    prompt: PromptClaim = ("", 0),
) -> LoadRequest:
    """A load (no blocks: only the release) of ``remote``'s lease, with the lease's token and
    this engine's prompt for the claim."""
    return LoadRequest(
        req_id, remote.request_id, peer, blocks, remote.preset, block_ids or [],
        lease_token=remote.lease_token or "", lease_seconds=remote.lease_seconds,
        prompt_digest=prompt[0], prompt_tokens=prompt[1],
    )


def _is_cleanup(request: Request) -> bool:
    """vLLM's pre-aborted request (``abort_immediately``): it only runs ``request_finished`` so
    the connector frees what a refused request holds (here: the prefill engine's lease)."""
    return bool(getattr(request, "abort_immediately", False))


def _with_drafts(report: dict[str, Any], drafts: Any) -> dict[str, Any]:
    """The request report with its speculative positions (decode engines running drafts)."""
    if drafts is None:
        return report
    return {**report, "spec_drafted_tokens": drafts.drafted,
            "spec_accepted_tokens": drafts.accepted}


def _redact(url: str | None) -> str | None:
    """A URL without its password, for logs."""
    if not url or "@" not in url:
        return url
    scheme, _, rest = url.partition("://")
    return f"{scheme}://***@{rest.rsplit('@', 1)[1]}"


class _GaugedLeases:
    """The pool as the side channel sees it: gauges follow releases made from gRPC threads."""

    def __init__(self, owner: TurboWireScheduler) -> None:
        self._owner = owner

    def release(
        self, request_ids: Sequence[str], consumer: int, tokens: Sequence[str]
    ) -> LeaseAnswer:
        result = self._owner.pool.release(request_ids, consumer, tokens)
        self._owner._publish_gauges()
        return result

    def heartbeat(
        self, request_ids: Sequence[str], tokens: Sequence[str],
        prompts: Sequence[PromptClaim] | None = None,
    ) -> LeaseAnswer:
        return self._owner.pool.heartbeat(request_ids, tokens, prompts)

    def snapshot(self) -> Any:
        return self._owner.pool.snapshot()
