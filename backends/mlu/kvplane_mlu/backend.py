"""The MLU backend: Cambricon MLUs through ``torch.mlu`` (torch_mlu), CNCL, and Mooncake ``rdma``.

Only device facts live here; streams, events and pinned memory come from ``AcceleratorBackend``. Mooncake has
no MLU transport of its own: it moves MLU memory over ``rdma`` with DMA-BUF (a Mooncake built with
``USE_MLU``), registered with location ``mlu:N`` (``Backend.mooncake_location``), as xLLM does.
"""

from __future__ import annotations

from typing import ClassVar

from kvplane.backend.accelerator import AcceleratorBackend


class MluBackend(AcceleratorBackend):
    name = "mlu"
    torch_device_type = "mlu"
    collective_backend = "cncl"
    visible_devices_env = "MLU_VISIBLE_DEVICES"
    device_package = "torch_mlu"
    install_hint = "install torch_mlu, Cambricon's build for your torch version, with the Neuware toolkit"
    mooncake_protocol = "rdma"
    nixl_memory_type = "DRAM"  # NIXL moves MLU KV through host buffers
    layouts: ClassVar[dict[str, str]] = {"gqa": "split_kv", "mla": "mla_split", "index": "index"}
