"""The only module that imports vLLM: the connector base classes and the role enum, in one place.

vLLM's KV connector API is stable across 0.23 - 0.33 for what kvplane uses (see docs/vllm.md); if it moves,
this file is where the names change.
"""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

__all__ = ["KVConnectorBase_V1", "KVConnectorMetadata", "KVConnectorRole", "SupportsHMA"]
