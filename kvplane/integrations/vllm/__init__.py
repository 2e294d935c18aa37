"""kvplane as a vLLM KV connector: ``--kv-transfer-config '{"kv_connector": "KVPlaneConnector",
"kv_connector_module_path": "kvplane.integrations.vllm", ...}'`` (see docs/vllm.md).

``KVPlaneConnector`` is imported on first access, so importing this package (the ``vllm.general_plugins`` entry
point does, through ``plugin``) does not pull in vLLM's connector machinery before vLLM asks for it.
"""

from __future__ import annotations

from typing import Any

CONNECTOR_NAME = "KVPlaneConnector"
CONNECTOR_MODULE = "kvplane.integrations.vllm.connector"

__all__ = ["CONNECTOR_MODULE", "CONNECTOR_NAME", "KVPlaneConnector"]


def __getattr__(name: str) -> Any:
    if name == CONNECTOR_NAME:
        from kvplane.integrations.vllm.connector import KVPlaneConnector

        return KVPlaneConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
