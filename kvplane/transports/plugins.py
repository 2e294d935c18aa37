"""Entry points of the built-in transports (group ``kvplane.transports``): ``plugins:mooncake``, ``plugins:nixl``.

Each object implements ``kvplane_transport`` and imports its transport module only when the hook is called.
"""

from __future__ import annotations

import importlib

from kvplane.transports.base import Transport
from kvplane.transports.hookspecs import hookimpl


class BuiltinTransport:
    """A plugin object naming one transport class by module and attribute, imported on demand."""

    def __init__(self, module: str, attribute: str) -> None:
        self.module, self.attribute = module, attribute

    @hookimpl
    def kvplane_transport(self) -> type[Transport]:
        cls: type[Transport] = getattr(importlib.import_module(self.module), self.attribute)
        return cls


mooncake = BuiltinTransport("kvplane.transports.mooncake", "MooncakeTransport")
nixl = BuiltinTransport("kvplane.transports.nixl", "NixlTransport")
