"""Backends: the device interface, plugin hooks, discovery/selection, and the built-in cpu backend."""

from kvplane.backend.base import Backend, Event, Probe, Stream
from kvplane.backend.hookspecs import hookimpl
from kvplane.backend.registry import BackendRegistry, default_registry, get_backend

__all__ = ["Backend", "BackendRegistry", "Event", "Probe", "Stream", "default_registry", "get_backend", "hookimpl"]
