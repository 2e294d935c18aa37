"""Transport discovery: entry points in the group ``kvplane.transports``, loaded by the shared ``kvplane.plugins``.

Flows and ``kvplane info`` call ``get_transport_class(name)`` and ``available_transports()``. A plugin is
imported only when it is asked for or listed, and an engine package only when its transport is probed or
built. A broken plugin is reported with its reason, never fatal to listing the others.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from importlib.metadata import EntryPoint

from kvplane.errors import TransportUnavailable
from kvplane.plugins import PluginRegistry, installed_entry_points
from kvplane.transports import hookspecs
from kvplane.transports.base import Transport

GROUP = "kvplane.transports"
# What kvplane's own pyproject declares; listed here too so an editable install whose metadata predates
# them still finds the built-ins. Installed entry points of the same name win.
BUILTINS = (
    EntryPoint("mooncake", "kvplane.transports.plugins:mooncake", GROUP),
    EntryPoint("nixl", "kvplane.transports.plugins:nixl", GROUP),
)


def _installed_entry_points() -> list[EntryPoint]:
    installed = installed_entry_points(GROUP)()
    names = {ep.name for ep in installed}
    return installed + [ep for ep in BUILTINS if ep.name not in names]


class TransportRegistry(PluginRegistry[Transport]):
    """Loads transport plugins on demand (the shared ``PluginRegistry``), and says which can run here."""

    def __init__(self, list_entry_points: Callable[[], Iterable[EntryPoint]] = _installed_entry_points) -> None:
        super().__init__(GROUP, hookspecs, "kvplane_transport", Transport, list_entry_points)

    def get(self, name: str) -> type[Transport]:
        """The transport class registered as ``name``; ``TransportUnavailable`` when unknown or broken."""
        if name not in self.names():
            installed = ", ".join(self.names()) or "none"
            raise TransportUnavailable(
                f"transport={name!r} matches no installed transport (installed: {installed}); install the "
                f"package that provides it, or add it to [project.entry-points.{GROUP!r}]"
            )
        cls = self.load(name)
        if cls is None:
            raise TransportUnavailable(f"transport {name!r}: {self.error(name)}")
        return cls

    def available(self) -> dict[str, tuple[bool, str]]:
        """Every installed transport: ``name -> (usable here, why or why not)``."""
        out: dict[str, tuple[bool, str]] = {}
        for name in self.names():
            try:
                out[name] = self.get(name).available()
            except TransportUnavailable as e:
                out[name] = (False, str(e))
            except Exception as e:  # available() must not raise; if it does, the transport declines
                out[name] = (False, f"available() raised {type(e).__name__}: {e}")
        return out


@functools.cache
def default_registry() -> TransportRegistry:
    """This process's registry: the installed entry points, plus what test fixtures ``add``."""
    return TransportRegistry()


def get_transport_class(name: str) -> type[Transport]:
    """The installed transport class called ``name`` ("mooncake", "nixl", or a plugin's)."""
    return default_registry().get(name)


def available_transports() -> dict[str, tuple[bool, str]]:
    """``name -> (ok, reason)`` for every installed transport."""
    return default_registry().available()
