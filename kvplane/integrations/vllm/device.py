"""Which kvplane backend a vLLM worker uses, and which device index.

The config's ``device`` wins, then ``$KVPLANE_DEVICE`` (kvplane's own rule), then vLLM's platform
``device_type`` (``cuda``, ``npu`` under vllm-ascend, ``mlu`` under vllm-mlu, ``cpu``). The device index is the
one the KV caches live on.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from kvplane.backend.base import Backend
from kvplane.backend.registry import ENV_VAR, get_backend
from kvplane.kv.layouts import LayerValue


def platform_device_type() -> str:
    """vLLM's ``current_platform.device_type``; ``cpu`` when vLLM cannot tell."""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return "cpu"
    return str(getattr(current_platform, "device_type", "") or "cpu")


def device_index(kv_caches: Mapping[str, LayerValue]) -> int:
    for value in kv_caches.values():
        tensor = value if not isinstance(value, tuple) else value[0]
        index = tensor.device.index
        return int(index) if index is not None else 0
    return 0


def select_backend(configured: str | None, kv_caches: Mapping[str, LayerValue]) -> Backend:
    name = configured or os.environ.get(ENV_VAR) or platform_device_type()
    return get_backend(name, device_index(kv_caches))
