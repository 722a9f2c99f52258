"""Prometheus export of turbowire connector stats on each engine's own ``/metrics``.

The connector facade (``turbowire.connector``) delegates its two vLLM classmethods here::

    from turbowire.connector import prom

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return prom.build_kv_connector_stats(data)

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig,
                           metric_types: dict[type[PromMetric], type[PromMetricT]],
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]],
                           ) -> KVConnectorPromMetrics | None:
        return prom.build_prom_metrics(vllm_config, metric_types, labelnames,
                                       per_engine_labelvalues)

and the worker (or scheduler) side returns ``stats.clone_and_reset()`` of a
:class:`~turbowire.connector.stats.TurboWireConnectorStats` from ``get_kv_connector_stats()``.

Why here and not a separate exporter: vLLM already serves ``/metrics`` on the API port and moves
connector stats from the workers to its frontend; registering through ``metric_types`` keeps the
series in vLLM's registry (multiprocess mode included) with vLLM's ``model_name``/``engine``
labels. The metric names, types and labels come from :mod:`turbowire.metrics_catalog`.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from prometheus_client import REGISTRY
from prometheus_client.metrics import MetricWrapperBase
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    PromMetric,
    PromMetricT,
)

from turbowire.connector.config import DEFAULT_PRESET, ConnectorConfigError, TurboWireConfig
from turbowire.connector.stats import (
    DIRECTIONS,
    P2P_LABEL,
    TurboWireConnectorStats,
    iter_counters,
    iter_gauges,
    iter_histograms,
    sanitize_data,
)
from turbowire.metrics_catalog import (
    BY_STATS_NAME,
    DURATION_BUCKETS,
    ENGINE_METRICS,
    ROLE_LABEL,
    MetricSpec,
)

logger = logging.getLogger(__name__)

_LABEL_OK = re.compile(r"^[A-Za-z0-9_.:+\-]{1,64}$")

_ROLE_BY_KV_ROLE = {"kv_producer": "producer", "kv_consumer": "consumer", "kv_both": "both"}


def role_label(vllm_config: VllmConfig) -> str:
    """The ``role`` label value: the engine's kv_role without the ``kv_`` prefix."""
    cfg = vllm_config.kv_transfer_config
    kv_role = getattr(cfg, "kv_role", None) if cfg is not None else None
    return _ROLE_BY_KV_ROLE.get(str(kv_role), "both")


def configured_preset(vllm_config: VllmConfig) -> str:
    """The preset of the validated connector config (this runs in the frontend process, which
    builds no connector: the config is validated here the same way the engine validates it). A
    config the engine refuses labels nothing the engine sends, so the default stands in."""
    cfg = vllm_config.kv_transfer_config
    extra = getattr(cfg, "kv_connector_extra_config", None) if cfg is not None else None
    try:
        preset = TurboWireConfig.from_extra_config(extra).preset
    except ConnectorConfigError as exc:
        logger.debug("metrics use the default preset label: %s", exc)
        return DEFAULT_PRESET
    return preset if _LABEL_OK.match(preset) else DEFAULT_PRESET


def _unregister_previous(names: list[str]) -> None:
    """Drop earlier registrations of our families from the default registry.

    Why: vLLM builds its stat loggers once per process, but tests and in-process engine restarts
    build them again; prometheus_client refuses duplicate names, and vLLM only unregisters
    ``vllm:*`` collectors itself.
    """
    wanted = set(names)
    for collector in list(REGISTRY._collector_to_names):  # noqa: SLF001 (same as vLLM does)
        if getattr(collector, "_name", None) in wanted:
            REGISTRY.unregister(collector)


class TurboWirePromMetrics(KVConnectorPromMetrics):
    """Registers every engine metric of the catalog and records stats payloads into them."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.role = role_label(vllm_config)
        classes = (self._gauge_cls, self._counter_cls, self._histogram_cls)
        if all(isinstance(c, type) and issubclass(c, MetricWrapperBase) for c in classes):
            _unregister_previous([spec.base_name for spec in ENGINE_METRICS])
        self._families: dict[str, Any] = {
            spec.stats_name: self._make_family(spec, list(labelnames)) for spec in ENGINE_METRICS
        }
        self._children: dict[tuple[str, int, tuple[str, ...]], Any] = {}
        # Last gauge reading per (engine, gauge) and worker: a step may carry only some workers.
        self._gauge_readings: dict[tuple[int, str], dict[str, float]] = {}
        # Series that exist (at 0) from the first scrape: rate() ignores the value a counter
        # series first appears with, so without this the first transfer's bytes would be lost.
        preset = configured_preset(vllm_config)
        directions = {"producer": ("send",), "consumer": ("recv",)}.get(self.role, DIRECTIONS)
        for engine_idx in self.per_engine_labelvalues:
            for name in ("stored_bytes", "dropped_observations"):
                self._child(name, engine_idx, ())
            for direction in directions:
                for name in ("dense_bytes", "wire_bytes", "transfers"):
                    self._child(name, engine_idx, (direction, P2P_LABEL, preset))

    def _make_family(self, spec: MetricSpec, labelnames: list[str]) -> Any:
        names = labelnames + [ROLE_LABEL, *spec.labels]
        if spec.type == "histogram":
            return self._histogram_cls(
                name=spec.base_name,
                documentation=spec.help,
                labelnames=names,
                buckets=list(DURATION_BUCKETS),
            )
        if spec.type == "gauge":
            return self._gauge_cls(
                name=spec.base_name,
                documentation=spec.help,
                labelnames=names,
                multiprocess_mode="mostrecent",
            )
        return self._counter_cls(name=spec.base_name, documentation=spec.help, labelnames=names)

    def _child(self, stats_name: str, engine_idx: int, values: tuple[str, ...]) -> Any:
        key = (stats_name, engine_idx, values)
        child = self._children.get(key)
        if child is None:
            engine_values = self.per_engine_labelvalues[engine_idx]
            child = self._families[stats_name].labels(*engine_values, self.role, *values)
            self._children[key] = child
        return child

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        if engine_idx not in self.per_engine_labelvalues:
            logger.warning("turbowire stats for unknown engine index %s ignored", engine_idx)
            return
        data = sanitize_data(transfer_stats_data)
        for name, labels, value in iter_counters(data):
            spec = BY_STATS_NAME[name]
            if value:
                self._child(name, engine_idx, tuple(labels[lbl] for lbl in spec.labels)).inc(value)
        for name, labels, values in iter_histograms(data):
            spec = BY_STATS_NAME[name]
            child = self._child(name, engine_idx, tuple(labels[lbl] for lbl in spec.labels))
            for v in values:
                child.observe(v)
        touched: set[str] = set()
        for name, worker, value in iter_gauges(data):
            self._gauge_readings.setdefault((engine_idx, name), {})[worker] = value
            touched.add(name)
        for name in touched:
            total = sum(self._gauge_readings[(engine_idx, name)].values())
            self._child(name, engine_idx, ()).set(total)


def build_kv_connector_stats(data: dict[str, Any] | None = None) -> TurboWireConnectorStats:
    """Rebuild stats from the dict that crossed vLLM's process boundary (validated)."""
    return TurboWireConnectorStats(data=sanitize_data(data))


def build_prom_metrics(
    vllm_config: VllmConfig,
    metric_types: dict[type[PromMetric], type[PromMetricT]],
    labelnames: list[str],
    per_engine_labelvalues: dict[int, list[object]],
) -> TurboWirePromMetrics:
    """The connector's ``KVConnectorPromMetrics`` (see the module docstring for wiring)."""
    return TurboWirePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


__all__ = [
    "TurboWirePromMetrics",
    "build_kv_connector_stats",
    "build_prom_metrics",
    "role_label",
]
