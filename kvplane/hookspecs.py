"""The pluggy markers every kvplane plugin uses (one project name, so one ``hookimpl`` serves all kinds).

Each kind declares its own hook beside its base class: ``kvplane.backend.hookspecs.kvplane_backend`` and
``kvplane.transports.hookspecs.kvplane_transport``; ``kvplane.plugins.PluginRegistry`` loads plugins of a kind
against that kind's hookspec module.
"""

from __future__ import annotations

import pluggy

PROJECT = "kvplane"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)
