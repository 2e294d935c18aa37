"""``KVPlaneStats``: the worker's counters as vLLM's ``KVConnectorStats`` (summed over workers and intervals)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats


@dataclass
class KVPlaneStats(KVConnectorStats):
    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> KVPlaneStats:
        for key, value in other.data.items():
            self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return {k: v for k, v in self.data.items() if isinstance(v, (int, float))}

    def is_empty(self) -> bool:
        return not any(self.data.values())
