"""The connector's stats through vLLM's own path: ``KVPlaneStats`` (a ``KVConnectorStats``) and
``KVPlanePromMetrics`` (a ``KVConnectorPromMetrics``, from ``KVPlaneConnector.build_prom_metrics``).

Each step the worker-side connector hands vLLM a ``KVPlaneStats`` holding a ``kvplane.metrics`` payload: the
connector events it counts, and what the process's ``Recorder`` took (transfers, failures, leases, offload
lookups, gauges); ``WorkerStats`` returns None when nothing changed. ``receive_skipped_blocks`` counts the decode
blocks a receive left out because vLLM's prefix cache held their KV (``EVENTS``: fed to
``vllm:kvplane_connector_events_total{event="receive_skipped_blocks"}`` here). vLLM adds the workers' payloads
(``KVOutputAggregator`` -> ``aggregate``), carries ``.data`` to its loggers, rebuilds it with
``build_kv_connector_stats``, logs ``reduce()`` every interval (``KVConnectorLogging``) and hands every step's
payload to ``KVPlanePromMetrics.observe`` (``KVConnectorProm``), which feeds metrics named ``vllm:kvplane_*``
(``kvplane.metrics.names``) with vLLM's own metric classes and per-engine labels on vLLM's ``/metrics``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from kvplane.metrics import names, payload, recorder
from kvplane.metrics.prom import PromMetrics

PREFIX = "vllm:kvplane_"
# decode blocks a receive left out because vLLM's prefix cache held their KV (TP rank 0 counts for the instance)
EVENTS = ("receive_skipped_blocks",)


@dataclass
class KVPlaneStats(KVConnectorStats):
    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data: dict[str, Any] = payload.empty()

    def aggregate(self, other: KVConnectorStats) -> KVPlaneStats:
        payload.merge(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        return payload.reduce(self.data)

    def is_empty(self) -> bool:
        return payload.is_empty(self.data)

    @classmethod
    def from_data(cls, data: dict[str, Any] | None) -> KVPlaneStats:
        """A copy: vLLM hands the same dict to its log and Prometheus loggers, and ``aggregate`` adds in place."""
        return cls(data=copy.deepcopy(data) if data else payload.empty())


class WorkerStats:
    """What the worker-side connector hands vLLM each step (``get_kv_connector_stats``)."""

    def __init__(self) -> None:
        recorder().enable()
        self._last_gauges: dict[str, float] | None = None

    def take(self, events: dict[str, int]) -> KVPlaneStats | None:
        data = recorder().take()
        data.update({k: v for k, v in events.items() if v})
        if payload.is_empty(data) and data["gauges"] == self._last_gauges:
            return None  # nothing new: vLLM's Prometheus gauges keep their values
        self._last_gauges = data["gauges"]
        return KVPlaneStats(data=data)


class KVPlanePromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.kvplane = PromMetrics(metric_types, PREFIX, labelnames)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        self.kvplane.observe(transfer_stats_data, labels)
        events = self.kvplane.metrics[names.CONNECTOR_EVENTS.name]
        for event in EVENTS:  # the connector's events PromMetrics does not feed (prom.LEGACY_EVENTS)
            if transfer_stats_data.get(event):
                events.labels(*(str(v) for v in labels), event).inc(transfer_stats_data[event])
