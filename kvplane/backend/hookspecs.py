"""The pluggy hooks a kvplane plugin implements. A plugin module is named by an entry point in the group
``kvplane.backends``; the built-in cpu backend registers through the same group as every other backend."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from kvplane.backend.base import Backend

PROJECT = "kvplane"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def kvplane_backend() -> type[Backend]:  # type: ignore[empty-body]
    """Return the Backend subclass this plugin provides. Called only after the plugin was chosen or listed,
    so the plugin module may import its device package lazily inside ``Backend.probe``."""
