"""Entry point of the MLU backend (group ``kvplane.backends``, name ``mlu``); never imports torch_mlu."""

from __future__ import annotations

from kvplane.backend.base import Backend
from kvplane.backend.hookspecs import hookimpl


@hookimpl
def kvplane_backend() -> type[Backend]:
    from kvplane_mlu.backend import MluBackend

    return MluBackend
