"""The cuda backend: NVIDIA GPUs through ``torch.cuda`` (vLLM's layouts, NCCL, Mooncake rdma, NIXL VRAM).

Only device facts live here; streams, events and pinned memory come from ``AcceleratorBackend``.
"""

from __future__ import annotations

from typing import ClassVar

from kvplane.backend.accelerator import AcceleratorBackend
from kvplane.backend.base import Probe


class CudaBackend(AcceleratorBackend):
    name = "cuda"
    torch_device_type = "cuda"
    collective_backend = "nccl"
    visible_devices_env = "CUDA_VISIBLE_DEVICES"
    device_package = None  # torch itself carries torch.cuda
    install_hint = (
        "install a CUDA build of torch, e.g. pip install torch --index-url "
        "https://download.pytorch.org/whl/cu128"
    )
    mooncake_protocol = "rdma"  # registered with location "cuda:N" (Backend.mooncake_location)
    nixl_memory_type = "VRAM"
    layouts: ClassVar[dict[str, str]] = {"gqa": "gqa_fused", "mla": "mla_fused", "index": "index"}

    @classmethod
    def probe(cls) -> Probe:
        try:
            import torch

            if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
                return Probe(False, f"torch {torch.__version__} is built without CUDA; {cls.install_hint}")
        except Exception as e:  # noqa: BLE001 - probe() must not raise
            return Probe(False, f"probing torch.cuda raised {type(e).__name__}: {e}")
        return super().probe()
