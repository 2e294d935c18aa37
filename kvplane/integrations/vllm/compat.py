"""The only module that imports vLLM's connector API, and the one place where the vLLM versions kvplane
supports (0.27.1 and 0.33.0, see docs/vllm.md) differ in what the connector must do.

The seven abstract methods are the same in both; what differs is named here after the behaviour, not the
version: ``REPORTS_FAILED_RECEIVES_BY_REQUEST`` (vLLM takes failed receives by request id through
``get_transfer_results``; older versions take only block ids, which they cannot map back to a request when
a model has several KV-cache groups), ``STARTS_LOADS_AFTER_FORWARD`` (vLLM calls ``start_load_kv`` after
the forward unless the step has a synchronous load, so work started there does not overlap the forward) and
``CACHE_HIT_SOURCE`` (vLLM's metrics count external hits per tier: host, p2p; None where they do not).
"""

from __future__ import annotations

import importlib
from dataclasses import fields
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import KVConnectorOutput

REPORTS_FAILED_RECEIVES_BY_REQUEST = "failed_recving" in {f.name for f in fields(KVConnectorOutput)}
STARTS_LOADS_AFTER_FORWARD = "has_sync_kv_loads" in {f.name for f in fields(SchedulerOutput)}
try:  # vLLM's metrics label external hits by tier where it has CacheHitSource
    CACHE_HIT_SOURCE: Any = importlib.import_module("vllm.v1.metrics.cache_hit_source").CacheHitSource
except ImportError:
    CACHE_HIT_SOURCE = None

__all__ = [
    "CACHE_HIT_SOURCE", "REPORTS_FAILED_RECEIVES_BY_REQUEST", "STARTS_LOADS_AFTER_FORWARD", "KVConnectorBase_V1",
    "KVConnectorMetadata", "KVConnectorRole", "KVConnectorWorkerMetadata", "SupportsHMA", "transfer_results",
]


def transfer_results(sending: set[str], recving: set[str], failed: set[str]) -> Any:
    """vLLM's ``KVConnectorTransferResults`` (only where ``REPORTS_FAILED_RECEIVES_BY_REQUEST``)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

    return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving, failed_recving=failed)
