"""``TurboWireConnector``: the facade vLLM instantiates (once per role), forwarding to the
scheduler-side or worker-side object, like vLLM's NixlConnector package.

The scheduler-side hooks run inside vLLM's engine-core loop, where an exception kills the
engine with every request in flight (``EngineCore._handle_client_request`` and ``schedule()``
catch nothing): each one falls back instead (no transfer for that request, counted
``internal``, logged with its traceback), see ``_fallback``.

Load it with::

    --kv-transfer-config '{"kv_connector": "TurboWireConnector",
                           "kv_connector_module_path": "turbowire.connector",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"preset": "tq4"}}'
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from turbowire.connector.config import TurboWireConfig
from turbowire.connector.logs import attach_to_vllm_logging
from turbowire.connector.metadata import TurboWireConnectorMetadata

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from turbowire.connector.scheduler import TurboWireScheduler
    from turbowire.connector.worker import TurboWireWorker

logger = logging.getLogger(__name__)


def load_config(vllm_config: VllmConfig) -> TurboWireConfig:
    """Validate ``kv_connector_extra_config`` and reconcile ``load_failure_policy`` with vLLM's."""
    from turbowire.connector.codecs import known_presets

    ktc = vllm_config.kv_transfer_config
    config = TurboWireConfig.from_extra_config(
        ktc.kv_connector_extra_config, known_presets=known_presets()
    )
    config.check_resolvable()
    if config.load_failure_policy is not None:
        # vLLM's scheduler reads the policy right after building the connector.
        ktc.kv_load_failure_policy = config.load_failure_policy
    elif config.uses_store:
        # A store miss (chunk evicted, corrupt, Redis down) recomputes from the first missing
        # chunk; it is never an error to the client (the config refuses an explicit "fail").
        ktc.kv_load_failure_policy = "recompute"
    return config


class TurboWireConnector(KVConnectorBase_V1, SupportsHMA):
    """Compressed P/D KV transfer: TurboQuant+ chunks staged on P, READ over NIXL by D."""

    _cache_hit_source = CacheHitSource.P2P

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        attach_to_vllm_logging()
        self.config = load_config(vllm_config)
        engine_id = vllm_config.kv_transfer_config.engine_id
        assert engine_id is not None
        self.engine_id: str = engine_id
        self.connector_scheduler: TurboWireScheduler | None = None
        self.connector_worker: TurboWireWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            from turbowire.connector.scheduler import TurboWireScheduler

            self.connector_scheduler = TurboWireScheduler(
                vllm_config, kv_cache_config, self.config, engine_id
            )
        else:
            from turbowire.connector.worker import TurboWireWorker

            self.connector_worker = TurboWireWorker(
                vllm_config, kv_cache_config, self.config, engine_id
            )

    # ------------------------------------------------------------------ class hooks
    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """None: the kernels handle LBHNC and LBNHC."""
        return None

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """True unless ``save_schedule`` is ``after_forward``: a layerwise save runs between
        layers (``save_kv_layer``), which a FULL CUDA graph would capture once and skip on
        replay. vLLM passes only the extra config (not the role), so a decode engine says so
        with ``save_schedule: after_forward`` (the Helm chart sets it)."""
        from turbowire.connector.config import CONFIG_KEYS_BY_NAME

        key = CONFIG_KEYS_BY_NAME["save_schedule"]
        raw = (extra_config or {}).get(key.name, key.default_value())
        return key.kind.parse(key.name, raw) != "after_forward"

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        from turbowire.connector.stats import TurboWireConnectorStats

        return TurboWireConnectorStats(data=data) if data is not None else TurboWireConnectorStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        from turbowire.connector.prom import build_prom_metrics

        return build_prom_metrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ------------------------------------------------------------------ scheduler side
    def _sched(self) -> TurboWireScheduler:
        assert self.connector_scheduler is not None, "scheduler-side call on a worker connector"
        return self.connector_scheduler

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._sched().bind_kv_cache_manager(kv_cache_manager)

    def _fallback(self, hook: str, request: Request | None = None) -> None:
        """An unexpected exception in turbowire's code under a vLLM scheduler hook: logged with
        its traceback and counted ``internal``; the caller then falls back (no transfer for the
        request) instead of letting it reach vLLM's engine-core loop."""
        rid = getattr(request, "request_id", None)
        logger.exception(
            "turbowire %s failed%s; falling back (no KV transfer for it)", hook,
            f" for request {rid}" if rid is not None else "",
        )
        sched = self.connector_scheduler
        if sched is not None:
            with contextlib.suppress(Exception):
                sched.stats.record_failure("internal")

    def _forget(self, request: Request, finished: bool = False) -> None:
        with contextlib.suppress(Exception):
            self._sched().forget(request, finished)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        try:
            return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)
        except Exception:  # noqa: BLE001 - never into vLLM's engine loop
            self._fallback("get_num_new_matched_tokens", request)
            self._forget(request)  # nothing is loaded for it: recomputed
            return 0, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        try:
            self._sched().update_state_after_alloc(request, blocks, num_external_tokens)
        except Exception:  # noqa: BLE001
            self._fallback("update_state_after_alloc", request)
            if num_external_tokens > 0:
                # vLLM now waits for this request's KV: the workers report it failed instead
                try:
                    self._sched().fail_load(request)
                except Exception:  # noqa: BLE001
                    logger.exception("turbowire: could not fail the load of %s",
                                     request.request_id)

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        """Peer (P2P) or store tokens; vLLM counts them in prompt_tokens_by_source."""
        if num_external_tokens == 0:
            return {}
        try:
            store = self._sched().cache_hit_source(request.request_id) == "store"
        except Exception:  # noqa: BLE001
            self._fallback("get_external_cache_hit_sources", request)
            store = False
        if store:
            return {CacheHitSource.EXTERNAL_UNSPECIFIED: num_external_tokens}
        return {CacheHitSource.P2P: num_external_tokens}

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        try:
            return self._sched().build_connector_meta(scheduler_output)
        except Exception:  # noqa: BLE001 - the step goes on without transfers this once
            self._fallback("build_connector_meta")
            return TurboWireConnectorMetadata()

    def on_new_request(self, request: Request) -> None:
        try:
            self._sched().on_new_request(request)
        except Exception:  # noqa: BLE001
            self._fallback("on_new_request", request)
            self._forget(request)
            params = getattr(request, "kv_transfer_params", None)
            if params is not None and not isinstance(params, Mapping):
                request.kv_transfer_params = None  # vLLM reads params.get right after

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        try:
            self._sched().update_connector_output(connector_output)
        except Exception:  # noqa: BLE001
            self._fallback("update_connector_output")

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        try:
            return self._sched().request_finished(request, block_ids)
        except Exception:  # noqa: BLE001 - dense blocks freed, nothing handed on
            self._fallback("request_finished", request)
            self._forget(request, finished=True)
            return False, None

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's hybrid KV cache manager (``SupportsHMA``): the request finished in every KV
        cache group. The same as ``request_finished``: what moves was encoded into staging
        while the blocks were held, so no group's blocks are kept."""
        return self.request_finished(request, block_ids[0] if block_ids else [])

    def set_xfer_handshake_metadata(
        self, metadata: dict[int, KVConnectorHandshakeMetadata]
    ) -> None:
        self._sched().set_handshake_metadata({(0, rank): m for rank, m in metadata.items()})

    def set_xfer_handshake_metadata_pp_aware(
        self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]
    ) -> None:
        self._sched().set_handshake_metadata(dict(metadata))

    def has_pending_push_work(self) -> bool:
        """Scheduler side: keep the engine stepping until the staging gauges are exported true
        (leases outstanding, or a release/expiry not yet exported); see the scheduler's."""
        if self.connector_scheduler is not None:
            try:
                return self.connector_scheduler.has_pending_push_work()
            except Exception:  # noqa: BLE001
                self._fallback("has_pending_push_work")
        return False

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self.connector_worker is not None:
            return self.connector_worker.get_stats()
        if self.connector_scheduler is not None:
            try:
                return self.connector_scheduler.get_stats()
            except Exception:  # noqa: BLE001 - one step's stats are lost, not the engine
                logger.exception("turbowire get_kv_connector_stats failed")
        return None

    # ------------------------------------------------------------------ worker side
    def _worker(self) -> TurboWireWorker:
        assert self.connector_worker is not None, "worker-side call on a scheduler connector"
        return self.connector_worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker().register_kv_caches(kv_caches)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self._worker().handshake_metadata

    def _meta(self) -> TurboWireConnectorMetadata | None:
        meta = self._connector_metadata
        return meta if isinstance(meta, TurboWireConnectorMetadata) else None

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._meta()
        if meta is not None:
            self._worker().start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete asynchronously, before the request is scheduled

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        meta = self._meta()
        if meta is not None:
            self._worker().save_kv_layer(layer_name, kv_layer, meta)

    def wait_for_save(self) -> None:
        self._worker().wait_for_save(self._meta())

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker().take_invalid_blocks()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        finished, _ = self._worker().get_transfer_results()
        return None, finished or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        finished, failed = self._worker().get_transfer_results()
        return KVConnectorTransferResults(
            finished_sending=set(), finished_recving=finished, failed_recving=failed
        )

    def build_connector_worker_meta(self) -> Any:
        return self._worker().take_reports()

    def shutdown(self) -> None:
        if self.connector_worker is not None:
            self.connector_worker.shutdown()
        if self.connector_scheduler is not None:
            self.connector_scheduler.shutdown()


def _register_with_vllm() -> None:
    """Register the name so MultiConnector can rebuild our stats in the frontend process."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if "TurboWireConnector" not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(
            "TurboWireConnector", "turbowire.connector.connector", "TurboWireConnector"
        )


_register_with_vllm()
