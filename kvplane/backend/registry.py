"""Backend discovery and selection.

Backends are entry points in the group ``kvplane.backends`` (name = what ``KVPLANE_DEVICE`` says), loaded
through the shared ``kvplane.plugins.PluginRegistry``. A plugin module is imported only when it is selected or
when all are listed (``kvplane info``, auto-selection). Selection: ``KVPLANE_DEVICE`` names one; without it,
exactly one available accelerator wins, none means cpu. A test double (``Backend.emulated``, added by a test
fixture with ``add``) is used only when named.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib.metadata import EntryPoint

from kvplane.backend import hookspecs
from kvplane.backend.base import Backend, Probe
from kvplane.errors import BackendError, BackendUnavailable, UnknownBackend
from kvplane.plugins import PluginRegistry, installed_entry_points

GROUP = "kvplane.backends"
ENV_VAR = "KVPLANE_DEVICE"
FALLBACK = "cpu"


@dataclass(frozen=True)
class BackendStatus:
    name: str
    probe: Probe
    cls: type[Backend] | None = None

    @property
    def emulated(self) -> bool:
        return self.cls is not None and self.cls.emulated

    def describe(self) -> str:
        if self.probe.available:
            return f"{self.name}: available" + (" (emulated)" if self.emulated else "")
        return f"{self.name}: unavailable ({self.probe.reason})"


class BackendRegistry(PluginRegistry[Backend]):
    """Loads backend plugins on demand and selects one."""

    def __init__(self, list_entry_points: Callable[[], Iterable[EntryPoint]] = installed_entry_points(GROUP)) -> None:
        super().__init__(GROUP, hookspecs, "kvplane_backend", Backend, list_entry_points)

    def load(self, name: str) -> type[Backend] | None:
        """Import one backend plugin; None (with the reason kept for ``status``) when its module is broken."""
        if name not in self.names():
            raise UnknownBackend(self._unknown_message(name))
        return super().load(name)

    def status(self, name: str) -> BackendStatus:
        cls = self.load(name)
        if cls is None:
            return BackendStatus(name, Probe(False, self.error(name)))
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
        accelerators = [
            s for s in statuses if s.probe.available and s.cls is not None and s.cls.is_accelerator and not s.emulated
        ]
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
        return st.cls(device_index)

    def _listing(self) -> str:
        return "Installed backends: " + "; ".join(s.describe() for s in self.survey())

    def _unknown_message(self, name: str) -> str:
        return (
            f"{ENV_VAR}={name!r} matches no installed backend. {self._listing()}. "
            f"Install the backend's package (kvplane-cuda, kvplane-ascend, kvplane-mlu) or unset {ENV_VAR}."
        )


@functools.cache
def default_registry() -> BackendRegistry:
    """This process's registry: the installed entry points, plus what test fixtures ``add``."""
    return BackendRegistry()


def get_backend(requested: str | None = None, device_index: int = 0) -> Backend:
    """The selected backend, instantiated (see the module docstring for the rules)."""
    return default_registry().create(requested, device_index)
