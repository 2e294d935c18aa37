"""Probing a device package without failing: what each accelerator backend's ``probe()`` calls.

``probe_device_package`` imports the device package only when called (never when a backend or plugin module is
imported) and answers ``Probe(False, reason)`` for a missing or broken package, a torch without the device
module, or a machine with no visible device; ``install_hint`` is appended where installing something is the fix.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from types import ModuleType

from kvplane.backend.base import Probe


def probe_device_package(
    module_name: str | None,
    install_hint: str,
    *,
    device_type: str,
    visible_devices_env: str | None = None,
) -> Probe:
    """Whether ``torch.<device_type>`` has a device here, importing ``module_name`` first when one is given.

    Never raises: a missing package, a package that fails to import, a torch without the device module and a
    machine with no visible device each come back as ``Probe(False, reason)``; ``install_hint`` is appended
    where installing something is the fix.
    """
    try:
        if module_name is not None and module_name not in sys.modules:
            if importlib.util.find_spec(module_name) is None:
                return Probe(False, f"{module_name} is not installed; {install_hint}")
            try:
                importlib.import_module(module_name)
            except Exception as e:  # noqa: BLE001 - a broken device stack declines, never crashes
                return Probe(
                    False, f"importing {module_name} failed ({type(e).__name__}: {e}); {install_hint}"
                )
        import torch

        module = getattr(torch, device_type, None)
        if not isinstance(module, ModuleType):
            return Probe(
                False, f"torch {torch.__version__} has no torch.{device_type} module; {install_hint}"
            )
        no_device = _no_device(device_type, visible_devices_env)
        if not module.is_available():
            return Probe(False, f"torch.{device_type}.is_available() is False: {no_device}")
        count = int(module.device_count())
        if count == 0:
            return Probe(False, f"torch.{device_type}.device_count() is 0: {no_device}")
        return Probe(True, f"{count} {device_type} device(s) visible")
    except Exception as e:  # noqa: BLE001 - probe() must not raise
        return Probe(False, f"probing torch.{device_type} raised {type(e).__name__}: {e}")


def _no_device(device_type: str, visible_devices_env: str | None) -> str:
    reason = f"no {device_type} device is visible"
    if visible_devices_env is not None and visible_devices_env in os.environ:
        reason += f" ({visible_devices_env}={os.environ[visible_devices_env]!r})"
    return reason


