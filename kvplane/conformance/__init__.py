"""The conformance suite every kvplane backend passes, shipped as a pytest plugin (the ``conformance`` extra).

Run it against any installed backend::

    pip install 'kvplane[conformance]'
    pytest -p kvplane.conformance --pyargs kvplane.conformance --kvplane-device=npu [--kvplane-report=report.json]
    kvplane conformance --device npu            # the same, then a printed report

Checks: device facts present and consistent with what the backend declares and torch reports; stream order and
events; pinned host memory; plans executed for every layout with random block ids, D2H, H2D and D2D, bytes
compared against torch indexing; registration spans within the backend's alignment and region limit;
collectives across two processes; copy bandwidth against a contiguous ``copy_``, reported and never asserted.

``-p kvplane.conformance`` loads this package as the plugin: its hooks and fixtures are those of
``kvplane.conformance.plugin``, re-exported here. There is no ``pytest11`` entry point, so no other pytest
session loads it. Every test id carries the device (``[npu-emulated-...]`` on an emulated device).
"""

from kvplane.conformance.plugin import (
    kvplane_backend,
    kvplane_bandwidth_bytes,
    kvplane_report,
    pytest_addoption,
    pytest_collection_modifyitems,
    pytest_configure,
    pytest_generate_tests,
)

__all__ = [
    "kvplane_backend",
    "kvplane_bandwidth_bytes",
    "kvplane_report",
    "pytest_addoption",
    "pytest_collection_modifyitems",
    "pytest_configure",
    "pytest_generate_tests",
]
