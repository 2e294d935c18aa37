"""The cuda backend: NVIDIA GPUs through ``torch.cuda`` (vLLM's layouts, NCCL, Mooncake rdma, NIXL VRAM).

Only device facts live here, plus the copy paths: plans run as one ``cudaMemcpyBatchAsync`` where the CUDA
runtime has it (``batch``), else as one ``cudaMemcpyAsync`` per coalesced descriptor, looped in C; plans of
small descriptors go through the Triton copy kernel (``gather``) where Triton is installed, below the crossover
``kvplane.backend.gather`` measures. Streams, events and pinned memory come from ``AcceleratorBackend``.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from typing import ClassVar

from kvplane.backend.accelerator import AcceleratorBackend
from kvplane.backend.base import Probe
from kvplane.backend.gather import CopyKernel
from kvplane.backend.vendor_copy import CopyFunction


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
    # UCX turns cuda_ipc GET off on GPUs without NVLink ("auto"), so a NIXL READ between two processes on one
    # PCIe GPU fell back to TCP through host memory: 2.8 s for 1.1 GB on an H200, WRITE by cuda_ipc 0.18 s
    nixl_env_defaults: ClassVar[Mapping[str, str]] = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"}
    layouts: ClassVar[dict[str, str]] = {"gqa": "packed_kv", "mla": "mla_fused", "index": "index"}
    # cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t count, cudaMemcpyKind kind, cudaStream_t s)
    # from the libcudart torch has loaded. Every direction maps to cudaMemcpyDefault (4): with unified
    # addressing the runtime infers it from the pointers (the explicit kinds are H2H 0, H2D 1, D2H 2, D2D 3).
    memcpy_library = "libcudart.so"
    memcpy_symbol = "cudaMemcpyAsync"
    memcpy_signature = "cuda"
    memcpy_kinds: ClassVar[Mapping[str, int]] = {"h2d": 4, "d2h": 4, "d2d": 4, "h2h": 4}
    stream_handle_attribute = "cuda_stream"

    @classmethod
    def probe(cls) -> Probe:
        try:
            import torch

            hip = getattr(torch.version, "hip", None)
            if hip is not None:  # ROCm torch answers to torch.cuda too: a ROCm backend claims those GPUs
                return Probe(
                    False, f"torch {torch.__version__} is a ROCm (HIP {hip}) build, whose torch.cuda drives AMD "
                    f"GPUs; this backend runs NVIDIA's CUDA runtime only: install a ROCm backend for kvplane"
                )
            if torch.version.cuda is None:
                return Probe(False, f"torch {torch.__version__} is built without CUDA; {cls.install_hint}")
        except Exception as e:  # noqa: BLE001 - probe() must not raise
            return Probe(False, f"probing torch.cuda raised {type(e).__name__}: {e}")
        return super().probe()

    def memcpy_libraries(self) -> tuple[str, ...]:
        """The versioned runtime torch was built with (``libcudart.so.12``), which it has already loaded."""
        import torch

        major = (torch.version.cuda or "").split(".")[0]
        return (f"libcudart.so.{major}", self.memcpy_library) if major else (self.memcpy_library,)

    def copy_kernel(self) -> CopyKernel | None:
        """The Triton copy kernel (``gather``), where Triton is installed: small descriptors go through it."""
        if importlib.util.find_spec("triton") is None:
            self.copy_notes.append("no Triton here: every plan goes by DMA (pip install triton for the copy kernel)")
            return None
        from kvplane_cuda.gather import TritonCopyKernel

        return TritonCopyKernel(self.device(), self.device_module().stream)

    def load_copy_function(self) -> CopyFunction:
        """``cudaMemcpyBatchAsync`` where the runtime has it, falling back to the ``cudaMemcpyAsync`` loop."""
        from kvplane_cuda.batch import with_batch

        return with_batch(super().load_copy_function(), self.install_hint)
