"""The cuda backend: NVIDIA GPUs through ``torch.cuda`` (vLLM's layouts, NCCL, Mooncake rdma, NIXL VRAM).

Only device facts live here, plus the batched copy: plans run as one ``cudaMemcpyBatchAsync`` where the CUDA
runtime has it (``batch``), else as one ``cudaMemcpyAsync`` per coalesced descriptor, looped in C. Streams,
events and pinned memory come from ``AcceleratorBackend``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from kvplane.backend.accelerator import AcceleratorBackend
from kvplane.backend.base import Probe
from kvplane.backend.vendor_copy import CopyFunction
from kvplane.testing.emulated import emulation_requested


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
        if emulation_requested(cls.name):
            return super().probe()  # declines: torch.cuda is torch's own module, never emulated
        try:
            import torch

            if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
                return Probe(False, f"torch {torch.__version__} is built without CUDA; {cls.install_hint}")
        except Exception as e:  # noqa: BLE001 - probe() must not raise
            return Probe(False, f"probing torch.cuda raised {type(e).__name__}: {e}")
        return super().probe()

    def memcpy_libraries(self) -> tuple[str, ...]:
        """The versioned runtime torch was built with (``libcudart.so.12``), which it has already loaded."""
        import torch

        major = (torch.version.cuda or "").split(".")[0]
        return (f"libcudart.so.{major}", self.memcpy_library) if major else (self.memcpy_library,)

    def _copy_function(self) -> CopyFunction:
        if self._copy_fn is None:
            loop = super()._copy_function()
            if loop.library != "emulated":
                from kvplane_cuda.batch import with_batch

                self._copy_fn = with_batch(loop, self.install_hint)
        return super()._copy_function()
