"""The generic torch-accelerator backend shared by the cuda, npu and mlu backend packages.

Backend packages (``kvplane-cuda``, ``kvplane-ascend``, ``kvplane-mlu``) subclass ``AcceleratorBackend``
and set only device facts as class attributes; everything here goes through PyTorch's device-generic API
(``torch.Stream``, ``torch.Event``, ``torch.accelerator``) and the device module
``torch.<torch_device_type>``, which torch_npu and torch_mlu fill in. No device name is tested anywhere in
this file.

``probe_device_package`` is what each backend's ``probe()`` calls: it imports the device package only when
called (never when this module or a plugin module is imported) and answers with a reason instead of raising.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import TYPE_CHECKING

from kvplane.backend.base import Backend, Event, Probe, Stream
from kvplane.errors import BackendError
from kvplane.plan.descriptors import CopyPlan

if TYPE_CHECKING:
    import torch


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


class AcceleratorBackend(Backend):
    """A backend for any device torch exposes as ``torch.<torch_device_type>`` with the generic stream API.

    Subclasses set the device facts (``name``, ``torch_device_type``, ``collective_backend``,
    ``visible_devices_env``, ``device_package``, ``install_hint``, ``mooncake_protocol``,
    ``nixl_memory_type``, registration limits, ``layouts``, ``mooncake_env_defaults``) and override a
    primitive only where their device does it differently or faster. Constructing one touches no device:
    the device package and the device are reached only by ``probe()`` and by the stream, event and memory
    primitives.

    Not implemented yet: ``_execute`` (running a ``CopyPlan`` of raw address arrays on a stream). Plan
    execution for these backends lands with the accelerator-backends work; until then ``execute()`` raises
    ``BackendError`` naming the backend, so nothing silently falls back to a slow or wrong path.
    """

    # Environment variables the backend's Mooncake transport reads before ``TransferEngine.initialize``;
    # a transport sets each one that the user has not set. Empty unless the device's transport needs some.

    @classmethod
    def probe(cls) -> Probe:
        return probe_device_package(
            cls.device_package,
            cls.install_hint,
            device_type=cls.torch_device_type,
            visible_devices_env=cls.visible_devices_env,
        )

    @classmethod
    def device_module(cls) -> ModuleType:
        """``torch.<torch_device_type>``; a ``BackendError`` naming what to install when it is absent."""
        import torch

        if cls.device_package is not None and cls.device_package not in sys.modules:
            try:
                importlib.import_module(cls.device_package)  # it registers torch.<device> on import
            except Exception as e:  # any failure, re-raised with the install hint
                raise BackendError(
                    f"{cls.name}: importing {cls.device_package} failed ({type(e).__name__}: {e}); "
                    f"{cls.install_hint}"
                ) from e
        module = getattr(torch, cls.torch_device_type, None)
        if not isinstance(module, ModuleType):
            raise BackendError(
                f"{cls.name}: torch {torch.__version__} has no torch.{cls.torch_device_type} module; "
                f"{cls.install_hint}"
            )
        return module

    def device(self) -> torch.device:
        self.device_module()  # torch.device("npu") parses only once the device package has registered "npu"
        return super().device()

    def set_current_device(self) -> None:
        """Make this backend's device the calling thread's current one (Mooncake's ascend transport needs it
        before ``initialize``)."""
        with self._device_errors("setting the current device"):
            self.device_module().set_device(self.device_index)

    # -- streams and events -------------------------------------------------------------------------------
    def new_stream(self) -> Stream:
        import torch

        with self._device_errors("creating a stream"):
            return torch.Stream(self.device())

    def current_stream(self) -> Stream:
        import torch

        with self._device_errors("reading the current stream"):
            if self._is_current_accelerator():
                return torch.accelerator.current_stream(self.device_index)
            stream: Stream = self.device_module().current_stream(self.device_index)
            return stream

    def new_event(self) -> Event:
        import torch

        with self._device_errors("creating an event"):
            return torch.Event(self.device())

    def synchronize(self) -> None:
        import torch

        with self._device_errors("synchronizing"):
            if self._is_current_accelerator():
                torch.accelerator.synchronize(self.device_index)
            else:
                self.device_module().synchronize(self.device_index)

    def _is_current_accelerator(self) -> bool:
        import torch

        self.device_module()  # torch.accelerator only knows the device once its package is imported
        current = torch.accelerator.current_accelerator()
        return current is not None and current.type == self.torch_device_type

    @contextmanager
    def _device_errors(self, what: str) -> Iterator[None]:
        """Turn what torch raises for a device it cannot reach into a ``BackendError`` naming the device."""
        try:
            yield
        except BackendError:
            raise
        # torch.cuda reports a torch built without CUDA with AssertionError or a missing torch._C attribute
        except (RuntimeError, AssertionError, AttributeError) as e:
            device = f"{self.torch_device_type}:{self.device_index}"
            raise BackendError(f"{self.label}: {what} on {device} failed: {type(e).__name__}: {e}") from e

    # -- memory and copies --------------------------------------------------------------------------------
    def _alloc_host(self, nbytes: int, pinned: bool) -> torch.Tensor:
        import torch

        if pinned:
            self.device_module()  # pinning goes through the device package's host allocator
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)

    def _execute(self, plan: CopyPlan, stream: Stream | None) -> None:
        raise BackendError(
            f"{self.label}: executing a copy plan ({len(plan)} descriptors, {plan.total_bytes} B) is not "
            f"implemented for the {self.name!r} backend yet; plan execution for this backend lands with the "
            f"accelerator-backends work"
        )
