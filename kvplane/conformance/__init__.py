"""The conformance suite every kvplane backend passes, shipped as a pytest plugin.

Run it against any installed backend::

    pytest --pyargs kvplane.conformance --kvplane-device=npu [--kvplane-report=report.json]
    kvplane conformance --device npu            # the same, then a printed report

Checks: device facts present and consistent; stream order and events; pinned host memory; plans executed for
every layout with random block ids, D2H, H2D and D2D, bytes compared against torch indexing; registration
spans within the backend's alignment and region limit; collectives across two processes; copy bandwidth
against a contiguous ``copy_``, reported and never asserted.

The plugin (``kvplane.conformance.plugin``, entry point ``pytest11``) adds the options and the
``kvplane_backend`` fixture; every test id carries the device (``[npu-emulated-...]`` on an emulated device).
"""
