"""Backend discovery and selection.

Backends are entry points in the group ``kvplane.backends`` (name = what ``KVPLANE_DEVICE`` says). A plugin
module is imported only when it is selected or when all are listed (``kvplane info``, auto-selection).
Selection: ``KVPLANE_DEVICE`` names one; without it, exactly one available accelerator wins, none means cpu.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points

import pluggy

from kvplane.backend import hookspecs
from kvplane.backend.base import Backend, Probe
from kvplane.errors import BackendError, BackendUnavailable, UnknownBackend

GROUP = "kvplane.backends"
ENV_VAR = "KVPLANE_DEVICE"
FALLBACK = "cpu"


@dataclass(frozen=True)
class BackendStatus:
    name: str
    probe: Probe
    cls: type[Backend] | None = None

    def describe(self) -> str:
        if self.probe.available:
            return f"{self.name}: available" + (" (emulated)" if self.probe.emulated else "")
        return f"{self.name}: unavailable ({self.probe.reason})"


def _installed_entry_points() -> list[EntryPoint]:
    return list(entry_points(group=GROUP))


class BackendRegistry:
    """Loads backend plugins on demand through one pluggy manager."""

    def __init__(self, list_entry_points: Callable[[], Iterable[EntryPoint]] = _installed_entry_points) -> None:
        self._list_entry_points = list_entry_points
        self._pm = pluggy.PluginManager(hookspecs.PROJECT)
        self._pm.add_hookspecs(hookspecs)
        self._classes: dict[str, type[Backend]] = {}
        self._errors: dict[str, str] = {}

    def names(self) -> list[str]:
        """Installed backend names, without importing any of them."""
        return sorted({ep.name for ep in self._list_entry_points()})

    def load(self, name: str) -> type[Backend] | None:
        """Import one backend plugin; None (with the reason kept for ``status``) when its module is broken."""
        if name in self._classes:
            return self._classes[name]
        if name in self._errors:
            return None
        eps = [ep for ep in self._list_entry_points() if ep.name == name]
        if not eps:
            raise UnknownBackend(self._unknown_message(name))
        try:
            if len({ep.value for ep in eps}) > 1:
                raise BackendError(
                    f"backend name {name!r} is registered by several plugins ({', '.join(ep.value for ep in eps)}); "
                    f"uninstall all but one"
                )
            module = eps[0].load()
            if self._pm.get_plugin(name) is None:
                self._pm.register(module, name=name)
                try:
                    self._pm.check_pending()
                except pluggy.PluginValidationError:
                    self._pm.unregister(name=name)  # a misspelled hook must not poison plugins loaded later
                    raise
            cls = self._pm.subset_hook_caller(
                "kvplane_backend", remove_plugins=[p for n, p in self._pm.list_name_plugin() if n != name]
            )()
            if len(cls) != 1 or not (isinstance(cls[0], type) and issubclass(cls[0], Backend)):
                raise BackendError(f"plugin {name!r} must return one Backend subclass from kvplane_backend()")
            if cls[0].name != name:
                raise BackendError(f"plugin {name!r} returned backend named {cls[0].name!r}; the names must match")
        except Exception as e:  # a broken third-party plugin is reported, never fatal to listing
            self._errors[name] = f"plugin failed to load: {type(e).__name__}: {e}"
            return None
        self._classes[name] = cls[0]
        return cls[0]

    def status(self, name: str) -> BackendStatus:
        cls = self.load(name)
        if cls is None:
            return BackendStatus(name, Probe(False, self._errors[name]))
        try:
            probe = cls.probe()
        except Exception as e:  # probe() must not raise; if it does, the backend declines with the reason
            probe = Probe(False, f"probe raised {type(e).__name__}: {e}")
        return BackendStatus(name, probe, cls)

    def survey(self) -> list[BackendStatus]:
        """Load and probe every installed backend."""
        return [self.status(n) for n in self.names()]

    def select(self, requested: str | None = None) -> BackendStatus:
        """The backend to use: ``requested``, else ``$KVPLANE_DEVICE``, else auto-selection."""
        requested = requested if requested is not None else os.environ.get(ENV_VAR) or None
        if requested is not None:
            requested = requested.strip().lower()
            if requested not in self.names():
                raise UnknownBackend(self._unknown_message(requested))
            st = self.status(requested)
            if not st.probe.available:
                raise BackendUnavailable(
                    f"{ENV_VAR}={requested!r}: that backend is installed but cannot run here: {st.probe.reason}. "
                    f"{self._listing()}"
                )
            return st
        statuses = self.survey()
        accelerators = [s for s in statuses if s.probe.available and s.cls is not None and s.cls.is_accelerator]
        if len(accelerators) == 1:
            return accelerators[0]
        if len(accelerators) > 1:
            names = ", ".join(s.name for s in accelerators)
            raise BackendError(f"several accelerators are available ({names}); set {ENV_VAR} to one of them")
        fallback = [s for s in statuses if s.name == FALLBACK]
        if not fallback or not fallback[0].probe.available:
            raise BackendUnavailable(f"no accelerator is available and the cpu backend is missing. {self._listing()}")
        return fallback[0]

    def create(self, requested: str | None = None, device_index: int = 0) -> Backend:
        st = self.select(requested)
        if st.cls is None:  # select() only returns loaded backends
            raise BackendError(f"backend {st.name!r} did not load")
        return st.cls(device_index, emulated=st.probe.emulated)

    def _listing(self) -> str:
        return "Installed backends: " + "; ".join(s.describe() for s in self.survey())

    def _unknown_message(self, name: str) -> str:
        return (
            f"{ENV_VAR}={name!r} matches no installed backend. {self._listing()}. "
            f"Install the backend's package (kvplane-cuda, kvplane-ascend, kvplane-mlu) or unset {ENV_VAR}."
        )


_default: BackendRegistry | None = None


def default_registry() -> BackendRegistry:
    global _default
    if _default is None:
        _default = BackendRegistry()
    return _default


def get_backend(requested: str | None = None, device_index: int = 0) -> Backend:
    """The selected backend, instantiated (see the module docstring for the rules)."""
    return default_registry().create(requested, device_index)
