"""What a backend plugin imports to mark its hook: ``@hookimpl def kvplane_backend() -> type[Backend]``.

The hooks themselves are declared once, in ``kvplane.hookspecs``; this name stays for backend packages.
"""

from kvplane.hookspecs import PROJECT, hookimpl, kvplane_backend

__all__ = ["PROJECT", "hookimpl", "kvplane_backend"]
