"""A vLLM KV connector that moves no KV and reports TurboWireConnectorStats: a test probe.

Why: it drives turbowire's stats and Prometheus code through a real vLLM engine's whole path
(scheduler/worker ``get_kv_connector_stats`` -> engine core -> msgpack -> frontend ->
``KVConnectorPromMetrics.observe`` -> ``/metrics``; the periodic log line through
``build_kv_connector_stats``/``reduce``) independently of the real connector. The numbers are tied
to what the engine really does: every scheduled token counts ``BYTES_PER_TOKEN`` dense bytes and a
quarter of that on the "wire", and worker-side encode timings are real ``save_kv_layer`` ->
``wait_for_save`` intervals. Loaded by vLLM with ``kv_connector_module_path``.
"""

from __future__ import annotations

import time
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)

from turbowire.connector import prom
from turbowire.connector.stats import TurboWireConnectorStats

BYTES_PER_TOKEN = 4096
WIRE_DIVISOR = 4


class ProbeMeta(KVConnectorMetadata):
    """Nothing to carry: the probe moves no KV."""


class StatsProbeConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.stats = TurboWireConnectorStats()
        self._t = 0.0

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        if not self._t:
            self._t = time.perf_counter()

    def wait_for_save(self) -> None:
        if self._t:
            self.stats.observe("encode_seconds", time.perf_counter() - self._t, preset="tq4")
            self._t = 0.0

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        n = scheduler_output.total_num_scheduled_tokens
        if n:
            dense = n * BYTES_PER_TOKEN
            self.stats.record_send("nixl", "tq4", dense, dense // WIRE_DIVISOR)
            self.stats.set_gauge("staging_bytes_in_use", n * 1000)
            self.stats.set_gauge("staging_capacity_bytes", 1 << 30)
        return ProbeMeta()

    def get_kv_connector_stats(self) -> TurboWireConnectorStats | None:
        return None if self.stats.is_empty() else self.stats.clone_and_reset()

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> TurboWireConnectorStats:
        return prom.build_kv_connector_stats(data)

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: Any,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> Any:
        return prom.build_prom_metrics(
            vllm_config, metric_types, labelnames, per_engine_labelvalues
        )
