"""Emulated device types for CI: a stand-in ``torch.<device>`` over CPU memory, installed and removed on demand.

An emulation puts a stand-in device package (``torch_npu``, ``torch_mlu``) into ``sys.modules`` and a stand-in
``torch.<device>`` module (``kvplane.testing.emulated_device``) on torch. The emulated backends
(``kvplane.testing.backends``) install one on first use; tests can also use
``with emulated("npu", device_package="torch_npu"): ...``. Emulation never shadows a real device stack: it
declines where the device package is installed or torch already has the device module.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType

from kvplane.errors import BackendError

DEFAULT_DEVICE_COUNT = 2  # two, so code that picks a device by rank runs


@dataclass
class Emulation:
    """One installed emulated device type and what it replaced (restored by ``uninstall_emulated``)."""

    device_type: str
    device_package: str | None
    stream_attribute: str
    module: ModuleType
    package: ModuleType | None


_installed: dict[str, Emulation] = {}


def is_emulated(module: object) -> bool:
    from kvplane.testing.emulated_device import EMULATED_MARK

    return bool(getattr(module, EMULATED_MARK, False))


def why_not_emulable(device_type: str, device_package: str | None) -> str | None:
    """Why this device cannot be emulated here (a real device stack is present), or None."""
    import torch

    if device_package is not None:
        present = sys.modules.get(device_package)
        if present is not None and not is_emulated(present):
            return f"the real {device_package} is imported in this process; select the real backend to use it"
        if present is None and importlib.util.find_spec(device_package) is not None:
            return f"the real {device_package} is installed here; select the real backend to use the hardware"
    module = getattr(torch, device_type, None)
    if module is not None and not is_emulated(module):
        return (
            f"torch.{device_type} is real here (torch provides it); emulation only stands in for a device "
            f"package that is not installed"
        )
    return None


def install_emulated(
    device_type: str,
    *,
    device_package: str | None = None,
    stream_attribute: str | None = None,
    device_count: int = DEFAULT_DEVICE_COUNT,
) -> Emulation:
    """Install (once) an emulated ``device_type``; the ``BackendError`` says why when a real stack is here.

    ``stream_attribute`` is the raw-handle attribute of the device's ``Stream`` (default ``<device>_stream``,
    the convention of ``torch.cuda``, torch_npu and torch_mlu).
    """
    if device_type in _installed:
        return _installed[device_type]
    if device_count < 1:
        raise BackendError(f"install_emulated: device_count={device_count} must be >= 1")
    reason = why_not_emulable(device_type, device_package)
    if reason is not None:
        raise BackendError(f"cannot emulate {device_type}: {reason}")
    import torch

    from kvplane.testing.emulated_device import EMULATED_MARK, device_module

    attribute = stream_attribute or f"{device_type}_stream"
    module = device_module(device_type, attribute, device_count)
    package = None
    if device_package is not None:
        package = ModuleType(device_package, f"Emulated {device_package} (kvplane.testing): no hardware.")
        setattr(package, device_type, module)
        setattr(package, EMULATED_MARK, True)
        package.__version__ = "0+emulated"  # type: ignore[attr-defined]
        sys.modules[device_package] = package
    setattr(torch, device_type, module)
    sys.modules[f"torch.{device_type}"] = module
    _installed[device_type] = Emulation(device_type, device_package, attribute, module, package)
    return _installed[device_type]


def uninstall_emulated(device_type: str) -> None:
    """Remove an emulation and everything it put in place; a no-op when none is installed."""
    emulation = _installed.pop(device_type, None)
    if emulation is None:
        return
    import torch

    if getattr(torch, device_type, None) is emulation.module:
        delattr(torch, device_type)
    if sys.modules.get(f"torch.{device_type}") is emulation.module:
        del sys.modules[f"torch.{device_type}"]
    if emulation.device_package is not None and sys.modules.get(emulation.device_package) is emulation.package:
        del sys.modules[emulation.device_package]


@contextmanager
def emulated(
    device_type: str, *, device_package: str | None = None, stream_attribute: str | None = None
) -> Iterator[Emulation]:
    """An emulated device for the duration of a ``with`` block (removed after, if this block installed it)."""
    already = device_type in _installed
    emulation = install_emulated(device_type, device_package=device_package, stream_attribute=stream_attribute)
    try:
        yield emulation
    finally:
        if not already:
            uninstall_emulated(device_type)
