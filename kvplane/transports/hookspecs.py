"""The pluggy hook a transport plugin implements. A plugin object is named by an entry point in the group
``kvplane.transports``; the built-in Mooncake and NIXL transports register through the same group."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvplane.hookspecs import PROJECT, hookimpl, hookspec

if TYPE_CHECKING:
    from kvplane.transports.base import Transport

__all__ = ["PROJECT", "hookimpl", "kvplane_transport"]


@hookspec
def kvplane_transport() -> type[Transport]:  # type: ignore[empty-body]
    """Return the Transport subclass this plugin provides. Called only when the transport is chosen or listed;
    the engine's package is imported later still, by ``Transport.available`` or the constructor."""
