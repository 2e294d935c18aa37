"""The Ascend backend: NPUs through ``torch.npu`` (torch_npu), HCCL, and Mooncake's ``ascend`` transport.

Only device facts live here; streams, events, pinned memory and plan execution come from
``AcceleratorBackend``. The registration facts follow vllm-ascend: Mooncake's ascend transport (ADXL/HIXL)
wants 2 MiB-aligned regions and at most 256 of them, so regions of one storage that lie within 4 KiB of each
other are merged before registering. Plans run as one ``aclrtMemcpyAsync`` per (coalesced) descriptor, looped
in C: gathering blocks on the device first was 5-7 % slower on Ascend (seed 000).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from kvplane.backend.accelerator import AcceleratorBackend


class AscendBackend(AcceleratorBackend):
    name = "npu"
    torch_device_type = "npu"
    collective_backend = "hccl"
    visible_devices_env = "ASCEND_RT_VISIBLE_DEVICES"
    device_package = "torch_npu"
    install_hint = (
        "pip install torch-npu, the release matching your torch, on a machine with the CANN toolkit"
    )
    mooncake_protocol = "ascend"  # call set_current_device() before TransferEngine.initialize
    nixl_memory_type = "DRAM"  # NIXL moves Ascend KV through host buffers
    registration_alignment = 2 << 20
    max_registered_regions = 256
    registration_merge_gap = 4096
    layouts: ClassVar[dict[str, str]] = {"gqa": "split_kv", "mla": "mla_split", "index": "index"}
    # Read by the ascend transport at TransferEngine.initialize, in milliseconds; these are the values
    # vllm-ascend's P/D guides export. A transport sets each one only where the user has not.
    mooncake_env_defaults: ClassVar[Mapping[str, str]] = {
        "ASCEND_CONNECT_TIMEOUT": "10000",
        "ASCEND_TRANSFER_TIMEOUT": "10000",
    }
    # aclError aclrtMemcpyAsync(void *dst, size_t destMax, const void *src, size_t count, aclrtMemcpyKind kind,
    # aclrtStream stream) from CANN's libascendcl.so, which torch_npu loads. aclrtMemcpyKind: HOST_TO_HOST 0,
    # HOST_TO_DEVICE 1, DEVICE_TO_HOST 2, DEVICE_TO_DEVICE 3. Host-to-host is left out: the async API refuses it
    # (ACL_ERROR_RT_FEATURE_NOT_SUPPORT). Host memory must be pinned (torch_npu pins through aclrtMallocHost).
    memcpy_library = "libascendcl.so"
    memcpy_symbol = "aclrtMemcpyAsync"
    memcpy_signature = "acl"
    memcpy_kinds: ClassVar[Mapping[str, int]] = {"h2d": 1, "d2h": 2, "d2d": 3}
    stream_handle_attribute = "npu_stream"  # torch_npu's Stream; reading it flushes torch_npu's task queue
