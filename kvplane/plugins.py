"""One plugin registry for every kind of kvplane plugin: entry points, loaded lazily through pluggy.

``BackendRegistry`` (``kvplane.backend.registry``) and ``TransportRegistry`` (``kvplane.transports.registry``)
are this class bound to one entry-point group, one hook (declared in the kind's ``hookspecs`` module) and one
base class; they add
only what selecting their kind means. A plugin module is imported only when its name is loaded or listed,
``check_pending`` refuses a misspelled hook, and a broken plugin is remembered with its reason (never fatal
to loading the others). ``add`` registers a plugin that no installed distribution declares: test doubles
(``kvplane.testing``) and test suites use it instead of a flag inside the library.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from importlib.metadata import EntryPoint, entry_points
from types import ModuleType
from typing import Generic, TypeVar, cast

import pluggy

from kvplane.hookspecs import PROJECT

T = TypeVar("T")


def installed_entry_points(group: str) -> Callable[[], list[EntryPoint]]:
    """The entry points of ``group`` in the installed distributions, read on every call."""
    return lambda: list(entry_points(group=group))


class PluginRegistry(Generic[T]):
    """The classes that plugins of one kind provide, by entry-point name."""

    def __init__(
        self, group: str, specs: ModuleType, hook: str, base: type,
        list_entry_points: Callable[[], Iterable[EntryPoint]],
    ) -> None:
        """``specs`` declares ``hook``; ``base`` is the (abstract) class every plugin of this kind returns a
        subclass of, named by its ``name``."""
        self.group, self.hook, self.base = group, hook, base
        self.kind = base.__name__.lower()
        self._list_entry_points = list_entry_points
        self._added: list[EntryPoint] = []
        self._pm = pluggy.PluginManager(PROJECT)
        self._pm.add_hookspecs(specs)
        self._classes: dict[str, type[T]] = {}
        self._errors: dict[str, str] = {}

    def entry_points(self) -> list[EntryPoint]:
        return [*self._list_entry_points(), *self._added]

    def names(self) -> list[str]:
        """Every plugin name, installed or added, without importing any of them."""
        return sorted({ep.name for ep in self.entry_points()})

    def add(self, entry_point: EntryPoint) -> None:
        """Register a plugin no installed distribution declares (a test double, a test suite's package)."""
        if entry_point.group != self.group:
            raise ValueError(f"entry point {entry_point.name!r} is in group {entry_point.group!r}, not {self.group!r}")
        self._added.append(entry_point)
        self._classes.pop(entry_point.name, None)
        self._errors.pop(entry_point.name, None)

    def added(self) -> tuple[EntryPoint, ...]:
        """What ``add`` registered, in order (a child process re-adds these to see the same plugins)."""
        return tuple(self._added)

    def load(self, name: str) -> type[T] | None:
        """The class plugin ``name`` provides, imported once; None when it failed (``error(name)`` says why)."""
        if name in self._classes:
            return self._classes[name]
        if name in self._errors:
            return None
        try:
            self._classes[name] = self._load(name)
        except Exception as e:  # a broken third-party plugin is reported, never fatal to listing
            self._errors[name] = f"plugin failed to load: {type(e).__name__}: {e}"
            return None
        return self._classes[name]

    def error(self, name: str) -> str:
        """Why ``load(name)`` returned None."""
        return self._errors.get(name, f"{self.kind} {name!r} is not installed")

    def _load(self, name: str) -> type[T]:
        eps = [ep for ep in self.entry_points() if ep.name == name]
        if not eps:
            raise LookupError(f"no plugin in the group {self.group!r} is named {name!r}")
        if len({ep.value for ep in eps}) > 1:
            raise ValueError(
                f"{self.kind} name {name!r} is registered by several plugins ({', '.join(ep.value for ep in eps)}); "
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
        found = self._pm.subset_hook_caller(self.hook, remove_plugins=others)()
        if len(found) != 1 or not (isinstance(found[0], type) and issubclass(found[0], self.base)):
            raise TypeError(f"plugin {name!r} must return one {self.base.__name__} subclass from {self.hook}()")
        returned = getattr(found[0], "name", None)
        if returned != name:
            raise ValueError(f"plugin {name!r} returned {self.kind} named {returned!r}; the names must match")
        return cast("type[T]", found[0])
