"""Transport discovery: entry points in the group ``kvplane.transports``, loaded through one pluggy manager.

Flows and ``kvplane info`` call ``get_transport_class(name)`` and ``available_transports()``. A plugin is
imported only when it is asked for or listed, and an engine package only when its transport is probed or
built. A broken plugin is reported with its reason, never fatal to listing the others.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from importlib.metadata import EntryPoint, entry_points

import pluggy

from kvplane.errors import TransportError, TransportUnavailable
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
    installed = list(entry_points(group=GROUP))
    names = {ep.name for ep in installed}
    return installed + [ep for ep in BUILTINS if ep.name not in names]


class TransportRegistry:
    def __init__(self, list_entry_points: Callable[[], Iterable[EntryPoint]] = _installed_entry_points) -> None:
        self._list_entry_points = list_entry_points
        self._pm = pluggy.PluginManager(hookspecs.PROJECT)
        self._pm.add_hookspecs(hookspecs)
        self._classes: dict[str, type[Transport]] = {}
        self._errors: dict[str, str] = {}

    def names(self) -> list[str]:
        """Installed transport names, without importing any of them."""
        return sorted({ep.name for ep in self._list_entry_points()})

    def get(self, name: str) -> type[Transport]:
        """The transport class registered as ``name``; ``TransportUnavailable`` when unknown or broken."""
        if name in self._classes:
            return self._classes[name]
        if name not in self._errors:
            try:
                self._classes[name] = self._load(name)
                return self._classes[name]
            except TransportUnavailable:
                raise
            except Exception as e:  # a broken third-party plugin: remember why, report it by name
                self._errors[name] = f"plugin failed to load: {type(e).__name__}: {e}"
        raise TransportUnavailable(f"transport {name!r}: {self._errors[name]}")

    def available(self) -> dict[str, tuple[bool, str]]:
        """Every installed transport: ``name -> (usable here, why or why not)``."""
        out: dict[str, tuple[bool, str]] = {}
        for name in self.names():
            try:
                cls = self.get(name)
                out[name] = cls.available()
            except TransportUnavailable as e:
                out[name] = (False, str(e))
            except Exception as e:  # available() must not raise; if it does, the transport declines
                out[name] = (False, f"available() raised {type(e).__name__}: {e}")
        return out

    def _load(self, name: str) -> type[Transport]:
        eps = [ep for ep in self._list_entry_points() if ep.name == name]
        if not eps:
            installed = ", ".join(self.names()) or "none"
            raise TransportUnavailable(
                f"transport={name!r} matches no installed transport (installed: {installed}); install the "
                f"package that provides it, or add it to [project.entry-points.{GROUP!r}]"
            )
        if len({ep.value for ep in eps}) > 1:
            raise TransportError(
                f"transport name {name!r} is registered by several plugins ({', '.join(ep.value for ep in eps)}); "
                f"uninstall all but one"
            )
        plugin = eps[0].load()
        if self._pm.get_plugin(name) is None:
            self._pm.register(plugin, name=name)
            try:
                self._pm.check_pending()
            except pluggy.PluginValidationError:
                self._pm.unregister(name=name)  # a misspelled hook must not poison plugins loaded later
                raise
        others = [p for n, p in self._pm.list_name_plugin() if n != name]
        found = self._pm.subset_hook_caller("kvplane_transport", remove_plugins=others)()
        if len(found) != 1 or not (isinstance(found[0], type) and issubclass(found[0], Transport)):
            raise TransportError(f"plugin {name!r} must return one Transport subclass from kvplane_transport()")
        cls: type[Transport] = found[0]
        if cls.name != name:
            raise TransportError(f"plugin {name!r} returned transport named {cls.name!r}; the names must match")
        return cls


_default: TransportRegistry | None = None


def default_registry() -> TransportRegistry:
    global _default
    if _default is None:
        _default = TransportRegistry()
    return _default


def get_transport_class(name: str) -> type[Transport]:
    """The installed transport class called ``name`` ("mooncake", "nixl", or a plugin's)."""
    return default_registry().get(name)


def available_transports() -> dict[str, tuple[bool, str]]:
    """``name -> (ok, reason)`` for every installed transport."""
    return default_registry().available()
