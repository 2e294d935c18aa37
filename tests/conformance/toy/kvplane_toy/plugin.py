"""Entry point of the toy backend (group ``kvplane.backends``, name ``toy``)."""

from __future__ import annotations

from kvplane.backend.base import Backend
from kvplane.backend.hookspecs import hookimpl


@hookimpl
def kvplane_backend() -> type[Backend]:
    from kvplane_toy.backend import ToyBackend

    return ToyBackend
