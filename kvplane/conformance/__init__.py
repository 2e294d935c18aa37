"""The conformance suite every kvplane backend passes, shipped as a pytest plugin (the ``conformance`` extra).

Run it against any installed backend::

    pip install 'kvplane[conformance]'
    pytest -p kvplane.conformance --pyargs kvplane.conformance --kvplane-device=npu [--kvplane-report=report.json]
    kvplane conformance --device npu            # the same, then a printed report

Checks: device facts present and consistent with what the backend declares and torch reports; stream order and
events; pinned host memory; plans executed for every layout with random block ids, D2H, H2D and D2D, bytes
compared against torch indexing; registration spans within the backend's alignment and region limit;
collectives across two processes; copy bandwidth against a contiguous ``copy_``, reported and never asserted.

``-p kvplane.conformance`` loads this package, which registers ``kvplane.conformance.plugin`` (its options,
fixtures and report) with pytest; importing the package imports neither pytest nor the plugin. There is no ``pytest11`` entry point, so no other pytest
session loads it. Every test id carries the device (``[npu-emulated-...]`` on an emulated device).
"""

from __future__ import annotations

from typing import Any


def pytest_load_initial_conftests(early_config: Any, parser: Any, args: list[str]) -> None:
    """Register the suite's plugin before the command line is parsed, after installed plugins are loaded (so
    an environment whose old metadata still declares it as a ``pytest11`` plugin gets it once, not twice)."""
    from kvplane.conformance import plugin

    manager = early_config.pluginmanager
    if not manager.is_registered(plugin):
        manager.register(plugin, "kvplane.conformance.plugin")
