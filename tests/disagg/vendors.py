"""Ranks of two vendors for the cross-vendor P/D tests, both emulated: the backend a device name selects, and
vllm-ascend's cache allocation.

- ``npu-emulated``: kvplane's Ascend backend over host memory behind a stand-in ``torch.npu``
  (``kvplane.testing.backends.emulated_backend``): Mooncake protocol ``ascend``, 2 MiB registration alignment,
  at most 256 registered regions, split caches.
- ``cuda-emulated``: the cpu backend wearing the cuda backend's facts (``host_stand_in``), since torch provides
  ``torch.cuda`` itself on this CPU build: protocol ``rdma``, vLLM's packed caches.

``ascend_cache`` allocates as vllm-ascend does (FACTS.md): every tensor of a layer (``k`` and ``v``, or MLA's
``nope`` and ``rope``) its own allocation, over-allocated by 2 MiB and viewed from its first 2 MiB-aligned byte.
Nothing here is Ascend or CUDA hardware.
"""

from __future__ import annotations

import torch

from kvplane.backend import get_backend
from kvplane.backend.base import Backend
from kvplane.kv.binding import allocate_cache
from kvplane.kv.layouts import LayerValue
from kvplane.kv.spec import KVSpec

ALIGN = 2 << 20


def backend_for(device: str) -> Backend:
    """The backend a rank of ``device`` runs: ``cpu``, ``npu-emulated`` or ``cuda-emulated``."""
    from kvplane.testing.backends import emulated_backend, host_stand_in

    if device == "npu-emulated":
        from kvplane_ascend.backend import AscendBackend

        return emulated_backend(AscendBackend)()
    if device == "cuda-emulated":
        from kvplane_cuda.backend import CudaBackend

        return host_stand_in(CudaBackend)()
    return get_backend(device)


def ascend_cache(spec: KVSpec, layout: str, num_blocks: int, order: str = "NHD") -> dict[str, LayerValue]:
    """Zeroed caches of ``layout``, each tensor its own allocation viewed from a 2 MiB-aligned start."""
    shapes = allocate_cache(spec, layout, num_blocks, device="meta", order=order)
    out: dict[str, LayerValue] = {}
    for name, value in shapes.items():
        views = []
        for like in (value,) if isinstance(value, torch.Tensor) else value:
            nbytes = like.numel() * like.element_size()
            raw = torch.zeros(nbytes + ALIGN, dtype=torch.uint8)
            start = -raw.data_ptr() % ALIGN
            views.append(raw[start : start + nbytes].view(like.dtype).as_strided(like.shape, like.stride()))
        out[name] = views[0] if isinstance(value, torch.Tensor) else tuple(views)
    return out
