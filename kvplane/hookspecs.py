"""The pluggy hooks a kvplane plugin implements, one per kind of plugin (``kvplane.plugins`` loads them).

A plugin is named by an entry point in the group of its kind: ``kvplane.backends`` (``kvplane_backend``) or
``kvplane.transports`` (``kvplane_transport``). The built-in cpu backend and the Mooncake and NIXL transports
register through the same groups as third-party plugins.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from kvplane.backend.base import Backend
    from kvplane.transports.base import Transport

PROJECT = "kvplane"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def kvplane_backend() -> type[Backend]:  # type: ignore[empty-body]
    """Return the Backend subclass this plugin provides. Called only after the plugin was chosen or listed,
    so the plugin module may import its device package lazily inside ``Backend.probe``."""


@hookspec
def kvplane_transport() -> type[Transport]:  # type: ignore[empty-body]
    """Return the Transport subclass this plugin provides. Called only when the transport is chosen or listed;
    the engine's package is imported later still, by ``Transport.available`` or the constructor."""
