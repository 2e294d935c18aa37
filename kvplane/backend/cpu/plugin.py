"""Entry point of the built-in cpu backend (group ``kvplane.backends``, name ``cpu``)."""

from __future__ import annotations

from kvplane.backend.base import Backend
from kvplane.backend.hookspecs import hookimpl


@hookimpl
def kvplane_backend() -> type[Backend]:
    from kvplane.backend.cpu.backend import CpuBackend

    return CpuBackend
