"""Emulated accelerator backends: a real backend class run over CPU memory, named ``<name>-emulated``.

``emulated_backend(AscendBackend)`` is a subclass whose ``name`` is ``npu-emulated``, whose ``emulated`` fact is
True and which overrides the four places a device is reached: ``probe`` (declines where a real device stack
is present), ``device_module`` (a stand-in ``torch.<device>``, ``kvplane.testing.emulated``), ``device`` (host
memory) and ``load_copy_function`` (a memcpy-backed C function with the vendor's signature, so the backend's
own ``_execute`` and the native descriptor loop run unchanged). Nothing in the product knows about it.

Emulated backends plug in from outside, through the registry's ``add``: ``register_emulated(registry, "npu")``
adds the entry point ``npu-emulated = kvplane.testing.backends:plugins.npu``; test fixtures call it, and
``-p kvplane.testing.pytest_plugin`` calls it for a whole pytest session (``kvplane conformance --emulate``).
They are never auto-selected: only a name (``KVPLANE_DEVICE=npu-emulated``) picks one.

``host_stand_in(CudaBackend)`` is for a device torch provides itself (``torch.cuda`` on a CPU build), which cannot
be emulated behind a stand-in module: the cpu backend wearing the real backend's device facts (layouts, Mooncake
protocol, registration rules), also named ``<name>-emulated``. The cross-vendor P/D tests and bench pair it with an
emulated npu (a CUDA-shaped decode).
"""

from __future__ import annotations

import functools
from importlib.metadata import EntryPoint
from typing import TYPE_CHECKING, ClassVar

from kvplane.backend.accelerator import AcceleratorBackend
from kvplane.backend.base import Backend, Probe
from kvplane.backend.hookspecs import hookimpl
from kvplane.backend.registry import GROUP, BackendRegistry
from kvplane.backend.vendor_copy import CopyFunction, emulated_copy_function
from kvplane.errors import BackendError
from kvplane.testing.emulated import install_emulated, why_not_emulable

if TYPE_CHECKING:
    from types import ModuleType

    import torch

SUFFIX = "-emulated"


class EmulatedDevice(AcceleratorBackend):
    """What every emulated backend overrides; mixed in before the real backend class."""

    emulated = True
    emulates: ClassVar[str] = ""  # the real backend's name

    @classmethod
    def probe(cls) -> Probe:
        try:
            reason = why_not_emulable(cls.torch_device_type, cls.device_package)
        except Exception as e:  # noqa: BLE001 - probe() must not raise
            return Probe(False, f"checking for a real {cls.torch_device_type} stack raised {type(e).__name__}: {e}")
        if reason is not None:
            return Probe(False, f"cannot emulate {cls.emulates}: {reason}")
        return Probe(
            True,
            f"EMULATED: CPU memory behind a stand-in torch.{cls.torch_device_type}; exercises kvplane's "
            f"{cls.emulates} backend code, uses no {cls.emulates} hardware and claims no support for it",
        )

    def device_module(self) -> ModuleType:
        return install_emulated(
            self.torch_device_type,
            device_package=self.device_package,
            stream_attribute=self.stream_handle_attribute or None,
        ).module

    def device(self) -> torch.device:
        import torch

        self.device_module()
        return torch.device("cpu")  # an emulated device's memory is host memory

    def load_copy_function(self) -> CopyFunction:
        return emulated_copy_function(self.memcpy_signature, self.memcpy_symbol)


@functools.cache
def emulated_backend(base: type[AcceleratorBackend]) -> type[AcceleratorBackend]:
    """The emulated variant of ``base`` (one class per base, so ``isinstance`` and pickling by name agree)."""
    if not (isinstance(base, type) and issubclass(base, AcceleratorBackend)):
        raise BackendError(f"only accelerator backends can be emulated; {base!r} is not an AcceleratorBackend")
    attributes = {"name": base.name + SUFFIX, "emulates": base.name, "__module__": __name__}
    return type(f"Emulated{base.__name__}", (EmulatedDevice, base), attributes)


# the device facts a host stand-in wears: what the other side of a transfer and the planner see of a rank
STAND_IN_FACTS = ("layouts", "mooncake_protocol", "registration_alignment", "max_registered_regions",
                  "registration_merge_gap")


@functools.cache
def host_stand_in(base: type[Backend]) -> type[Backend]:
    """The cpu backend wearing ``base``'s device facts (layouts, Mooncake protocol, registration rules), named
    ``<name>-emulated``: for a device ``emulated_backend`` cannot stand in for because torch provides its module
    itself (``torch.cuda`` on a CPU build). Its memory, streams and copies are the cpu backend's, so it proves what
    a peer and the planner see of such a rank (a CUDA-shaped decode: packed caches, ``rdma``), never the device."""
    from kvplane.backend.cpu.backend import CpuBackend

    attributes = {fact: getattr(base, fact) for fact in STAND_IN_FACTS}
    attributes.update(name=base.name + SUFFIX, emulated=True, emulates=base.name, __module__=__name__)
    return type(f"HostStandIn{base.__name__}", (CpuBackend,), attributes)


class EmulatedPlugin:
    """The plugin behind ``<name>-emulated``: loads the installed backend ``name`` and returns its emulation."""

    def __init__(self, base_name: str) -> None:
        self.base_name = base_name

    @hookimpl
    def kvplane_backend(self) -> type[Backend]:
        registry = BackendRegistry()
        base = registry.load(self.base_name)
        if base is None:
            raise BackendError(f"cannot emulate {self.base_name}: {registry.error(self.base_name)}")
        if not issubclass(base, AcceleratorBackend):
            raise BackendError(f"cannot emulate {self.base_name}: it is not an accelerator backend")
        return emulated_backend(base)


class _Plugins:
    """``plugins.npu`` is the plugin of ``npu-emulated``: what the entry points added below name."""

    def __getattr__(self, base_name: str) -> EmulatedPlugin:
        if base_name.startswith("_"):
            raise AttributeError(base_name)
        return EmulatedPlugin(base_name)


plugins = _Plugins()


def entry_point(base_name: str) -> EntryPoint:
    return EntryPoint(base_name + SUFFIX, f"{__name__}:plugins.{base_name}", GROUP)


def register_emulated(registry: BackendRegistry, *base_names: str) -> list[str]:
    """Add ``<name>-emulated`` for each of ``base_names`` (default: every installed backend but cpu) to
    ``registry``; the names added."""
    names = base_names or tuple(n for n in registry.names() if n != "cpu" and not n.endswith(SUFFIX))
    known = {ep.name for ep in registry.entry_points()}
    for name in names:
        if name + SUFFIX not in known:
            registry.add(entry_point(name))
    return [name + SUFFIX for name in names]
