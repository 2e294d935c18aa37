"""Entry point of the Ascend backend (group ``kvplane.backends``, name ``npu``); never imports torch_npu."""

from __future__ import annotations

from kvplane.backend.base import Backend
from kvplane.backend.hookspecs import hookimpl


@hookimpl
def kvplane_backend() -> type[Backend]:
    from kvplane_ascend.backend import AscendBackend

    return AscendBackend
