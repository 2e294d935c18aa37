"""The MLU backend: Cambricon MLUs through ``torch.mlu`` (torch_mlu), CNCL, and Mooncake ``rdma``.

Only device facts live here; streams, events, pinned memory and plan execution come from
``AcceleratorBackend``. Mooncake has no MLU transport of its own: it moves MLU memory over ``rdma`` with
DMA-BUF (a Mooncake built with ``USE_MLU``), registered with location ``mlu:N`` (``Backend.mooncake_location``),
as xLLM does. Plans run as one ``cnrtMemcpyAsync_V2`` per (coalesced) descriptor, looped in C.
"""

from __future__ import annotations

from collections.abc import Mapping
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
    # cnrtRet_t cnrtMemcpyAsync_V2(void *dst, void *src, size_t bytes, cnrtQueue_t queue, cnrtMemTransDir_t dir)
    # from Neuware's libcnrt.so, which torch_mlu loads (the queue comes before the direction). cnrtMemTransDir_t:
    # HostToDev 0, DevToDev 1, DevToHost 2, HostToHost 3 (not the ACL/CUDA order).
    memcpy_library = "libcnrt.so"
    memcpy_symbol = "cnrtMemcpyAsync_V2"
    memcpy_signature = "cnrt"
    memcpy_kinds: ClassVar[Mapping[str, int]] = {"h2d": 0, "d2d": 1, "d2h": 2, "h2h": 3}
    stream_handle_attribute = "mlu_stream"  # torch_mlu's Stream: the raw cnrtQueue_t
