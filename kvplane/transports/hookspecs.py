"""What a transport plugin imports to mark its hook: ``@hookimpl def kvplane_transport() -> type[Transport]``.

The hooks themselves are declared once, in ``kvplane.hookspecs``; this name stays for transport packages.
"""

from kvplane.hookspecs import PROJECT, hookimpl, kvplane_transport

__all__ = ["PROJECT", "hookimpl", "kvplane_transport"]
