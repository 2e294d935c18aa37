"""The pluggy hook a backend plugin implements. A plugin module is named by an entry point in the group
``kvplane.backends``; the built-in cpu backend registers through the same group as every other backend."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvplane.hookspecs import PROJECT, hookimpl, hookspec

if TYPE_CHECKING:
    from kvplane.backend.base import Backend

__all__ = ["PROJECT", "hookimpl", "kvplane_backend"]


@hookspec
def kvplane_backend() -> type[Backend]:  # type: ignore[empty-body]
    """Return the Backend subclass this plugin provides. Called only after the plugin was chosen or listed,
    so the plugin module may import its device package lazily inside ``Backend.probe``."""
