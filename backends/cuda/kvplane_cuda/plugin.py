"""Entry point of the cuda backend (group ``kvplane.backends``, name ``cuda``); touches no device."""

from __future__ import annotations

from kvplane.backend.base import Backend
from kvplane.backend.hookspecs import hookimpl


@hookimpl
def kvplane_backend() -> type[Backend]:
    from kvplane_cuda.backend import CudaBackend

    return CudaBackend
