"""The generic torch-accelerator backend shared by the cuda, npu and mlu backend packages.

Backend packages (``kvplane-cuda``, ``kvplane-ascend``, ``kvplane-mlu``) subclass ``AcceleratorBackend``
and set only device facts as class attributes; everything here goes through the device module
``torch.<torch_device_type>`` (``torch.cuda``, or what torch_npu and torch_mlu register), whose ``Stream`` and
``Event`` are subclasses of PyTorch's device-generic ``torch.Stream``/``torch.Event`` that also carry the raw
handle. No device name is tested anywhere in this file. Probing lives in ``probing`` (re-exported here).

Each backend owns its copy path. It either declares a C-callable async copy function, which the native loop
(``vendor_copy``) calls for every descriptor of a plan, or overrides ``_execute`` with its own:

- declared by class attributes: ``memcpy_library``, ``memcpy_symbol``, ``memcpy_signature`` (a calling
  convention the native loop knows, ``vendor_copy.SIGNATURES``), ``memcpy_kinds``, ``stream_handle_attribute``;
- or by overriding ``load_copy_function()``, which may return any ``CopyFunction``: a vendor function with a
  known signature, or the backend package's own function with the ``plan`` signature (``vendor_copy``), which
  is how a package brings a calling convention the core does not know, without editing the core.

Emulated devices are test doubles (``kvplane.testing``): subclasses that override ``device_module``,
``device``, ``probe`` and ``load_copy_function``; nothing here knows about them.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
import threading
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from types import ModuleType
from typing import TYPE_CHECKING, Any, ClassVar

from kvplane.backend.base import DIRECTIONS, Backend, Direction, Event, Probe, Stream
from kvplane.backend.gather import (
    CROSSOVERS,
    GATHER_ENV,
    SPAN,
    CopyKernel,
    Crossover,
    KernelPath,
    PinnedRanges,
    RouteName,
    best_seconds,
    crossover_from_env,
    measure,
)
from kvplane.backend.probing import probe_device_package
from kvplane.backend.vendor_copy import CopyFunction, copy_error, enqueue, load_copy_function
from kvplane.descriptors import CopyPlan
from kvplane.errors import BackendError

if TYPE_CHECKING:
    import torch

__all__ = ["AcceleratorBackend", "probe_device_package"]


class AcceleratorBackend(Backend):
    """A backend for any device torch exposes as ``torch.<torch_device_type>`` with the generic stream API.

    Subclasses set the device facts (``name``, ``torch_device_type``, ``collective_backend``,
    ``visible_devices_env``, ``device_package``, ``install_hint``, ``mooncake_protocol``,
    ``nixl_memory_type``, registration limits, ``layouts``, ``mooncake_env_defaults``, and the ``memcpy_*`` and
    ``stream_handle_attribute`` facts below) and override a primitive only where their device does it
    differently or faster. Constructing one touches no device: the device package and the device are reached
    only by ``probe()`` and by the stream, event, memory and copy primitives.
    """

    # -- how a plan reaches the device: the vendor's async memcpy, called from C for every descriptor -----
    memcpy_library: ClassVar[str] = ""  # the vendor runtime the device package has already loaded
    memcpy_symbol: ClassVar[str] = ""  # its async memcpy
    memcpy_signature: ClassVar[str] = ""  # a calling convention of kvplane.backend.vendor_copy.SIGNATURES
    memcpy_kinds: ClassVar[Mapping[str, int]] = {}  # direction -> the vendor's kind/direction code
    stream_handle_attribute: ClassVar[str] = ""  # the raw stream handle on the device module's Stream

    def __init__(self, device_index: int = 0) -> None:
        super().__init__(device_index)
        self._copy_fn: CopyFunction | None = None
        self._lock = threading.Lock()
        self.pinned = PinnedRanges()  # host memory alloc_host pinned, which a copy kernel may address
        self.copy_notes: list[str] = []  # what reports should say about the copy path (fallbacks taken)

    @classmethod
    def probe(cls) -> Probe:
        return probe_device_package(
            cls.device_package,
            cls.install_hint,
            device_type=cls.torch_device_type,
            visible_devices_env=cls.visible_devices_env,
        )

    def device_module(self) -> ModuleType:
        """``torch.<torch_device_type>``; a ``BackendError`` naming what to install when it is absent."""
        import torch

        if self.device_package is not None and self.device_package not in sys.modules:
            try:
                importlib.import_module(self.device_package)  # it registers torch.<device> on import
            except Exception as e:  # any failure, re-raised with the install hint
                raise BackendError(
                    f"{self.name}: importing {self.device_package} failed ({type(e).__name__}: {e}); "
                    f"{self.install_hint}"
                ) from e
        module = getattr(torch, self.torch_device_type, None)
        if not isinstance(module, ModuleType):
            raise BackendError(
                f"{self.name}: torch {torch.__version__} has no torch.{self.torch_device_type} module; "
                f"{self.install_hint}"
            )
        return module

    def device(self) -> torch.device:
        self.device_module()  # torch.device("npu") parses only once the device package has registered "npu"
        return super().device()

    def device_count(self) -> int:
        with self._device_errors("counting devices"):
            return int(self.device_module().device_count())

    def set_current_device(self) -> None:
        """Make this backend's device the calling thread's current one (Mooncake's ascend transport needs it
        before ``initialize``)."""
        with self._device_errors("setting the current device"):
            self.device_module().set_device(self.device_index)

    # -- streams and events: the device module's own types, which carry the raw handle ------------------
    def new_stream(self) -> Stream:
        with self._device_errors("creating a stream"):
            stream: Stream = self.device_module().Stream(device=self.device_index)
            return stream

    def current_stream(self) -> Stream:
        with self._device_errors("reading the current stream"):
            stream: Stream = self.device_module().current_stream(self.device_index)
            return stream

    def new_event(self) -> Event:
        with self._device_errors("creating an event"):
            event: Event = self.device_module().Event()
            return event

    def synchronize(self) -> None:
        with self._device_errors("synchronizing"):
            self.device_module().synchronize(self.device_index)

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

        # pinning goes through the device package's host allocator; host memory as device memory needs none
        addressable = pinned  # by the device: pinned memory, or host memory that is the device's memory
        pinned = pinned and self.device().type != "cpu"
        buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        if addressable:
            addr = int(buffer.data_ptr())
            self.pinned.add(addr, nbytes)
            # forgotten with the memory (the storage outlives the tensor while views of it live)
            weakref.finalize(buffer.untyped_storage(), self.pinned.remove, addr)
        return buffer

    def memcpy_libraries(self) -> tuple[str, ...]:
        """Library names to try for ``memcpy_symbol``, in order."""
        return (self.memcpy_library,)

    def load_copy_function(self) -> CopyFunction:
        """The C function plans run through: by default the declared ``memcpy_symbol`` of the first of
        ``memcpy_libraries()`` that loads, called with ``memcpy_signature``. Override it to hand the native loop
        another function (a batched one, the package's own ``plan`` function)."""
        return load_copy_function(
            self.memcpy_libraries(), self.memcpy_symbol, self.memcpy_signature, self.install_hint
        )

    def _copy_function(self) -> CopyFunction:
        """``load_copy_function()``, resolved once per backend instance."""
        if self._copy_fn is None:
            self._copy_fn = self.load_copy_function()
        return self._copy_fn

    def copy_path(self) -> str:
        """How plans run here, for reports: the function and library, and any fallback taken."""
        return "; ".join([self._copy_function().describe(), *self.copy_notes])

    def _execute(self, plan: CopyPlan, stream: Stream | None, *, direction: Direction | None = None) -> None:
        self.execute_route(plan, stream, direction=direction)

    def execute_route(
        self, plan: CopyPlan, stream: Stream | None, *, direction: Direction | None = None,
        route: RouteName = "auto",
    ) -> None:
        """``execute`` by a named route (``routes()``): ``auto`` picks as ``execute`` does; ``dma`` is the copy
        function, ``loop`` its per-descriptor fallback, ``staged`` and ``direct`` the copy kernel (``gather``)."""
        kind = self._memcpy_kind(direction)
        target = stream if stream is not None else self.current_stream()
        if route != "auto" and route not in self.routes():
            raise BackendError(f"{self.label}: route={route!r} is not one of this backend's {self.routes()}")
        with self._device_errors("enqueueing a copy plan"), self.device_module().device(self.device_index):
            path = self.kernel_path
            chosen = self.route_for(plan, direction) if route == "auto" else route
            if (chosen == "staged" or chosen == "direct") and path is not None:
                path.run(chosen, plan, direction or "", target, lambda p: self._dma(p, kind, target),
                         lambda n: self._staging(n, target))
            else:
                self._dma(plan, kind, target, loop=chosen == "loop")
        if stream is None:
            target.synchronize()

    def route_for(self, plan: CopyPlan, direction: Direction | None) -> RouteName:
        """The route ``execute`` takes for ``plan``."""
        path = self.kernel_path
        return path.route(plan, direction or "") if path is not None else "dma"

    def routes(self) -> tuple[RouteName, ...]:
        """The routes ``execute_route`` takes here."""
        names: list[RouteName] = ["auto", "dma"]
        if self._copy_function().fallback is not None:
            names.append("loop")
        if self.kernel_path is not None:
            names += ["staged", "direct"]
        return tuple(names)

    def _dma(self, plan: CopyPlan, kind: int, handle_of: Stream, *, loop: bool = False) -> None:
        """Enqueue ``plan`` through the copy function (``loop``: its per-descriptor fallback)."""
        function = self._copy_function()
        handle = self._stream_handle(handle_of)
        if function.fallback is not None and (handle == 0 or loop):
            function = function.fallback  # batched APIs refuse the legacy default stream (handle 0)
        failure = enqueue(function, plan, kind, handle)
        if failure is not None and function.fallback is not None:
            # a batch the driver refused: the per-descriptor loop re-copies it (plans never copy into
            # their own sources, so running a descriptor twice leaves the same bytes)
            fallback = function.fallback
            failure, function = enqueue(fallback, plan, kind, handle), fallback
            if failure is None:
                self._copy_fn = fallback
                self.copy_notes.append(f"batched copy refused by the driver; using {fallback.describe()}")
        if failure is not None:
            raise copy_error(self.label, function, plan, failure)

    # -- the copy kernel: small descriptors gathered on the device (kvplane.backend.gather) --------------
    def copy_kernel(self) -> CopyKernel | None:
        """This device's kernel copying every descriptor of a plan in one launch, or None (plans go by DMA
        only). A backend package returns its own (the cuda backend's is Triton); see docs/backends.md."""
        return None

    @functools.cached_property
    def kernel_path(self) -> KernelPath | None:
        """The copy kernel with its crossover, resolved once; None without a kernel or with the kernel off."""
        kernel = self.copy_kernel()
        fixed = crossover_from_env(os.environ.get(GATHER_ENV))
        if kernel is None or (fixed is not None and fixed.size == 0):
            return None
        return KernelPath(kernel, lambda: fixed or self.crossover(), self.pinned)

    def crossover(self) -> Crossover:
        """The measured crossover of DMA and the copy kernel on this device (cached per device name)."""
        path = self.kernel_path
        if path is None:
            return Crossover(0, 1, "no copy kernel")
        with self._lock:  # one measurement per process, whichever thread asks first
            return CROSSOVERS.get(f"{self.name}:{self._device_name()}", lambda: self._measure(path.kernel))

    def _measure(self, kernel: CopyKernel) -> Crossover:
        device, host = self.alloc_device(SPAN), self.alloc_host(SPAN)
        stream, event = self.new_stream(), self.new_event()
        kind = self._memcpy_kind("d2h")

        def by_dma(plan: CopyPlan) -> None:
            self._dma(plan, kind, stream)
            event.record(stream)
            event.synchronize()

        def by_kernel(plan: CopyPlan) -> None:
            kernel.launch(plan, stream)
            event.record(stream)
            event.synchronize()

        with self.device_module().device(self.device_index):
            return measure(best_seconds(by_dma, reps=5), best_seconds(by_kernel, reps=5), int(device.data_ptr()),
                           int(host.data_ptr()))

    def _device_name(self) -> str:
        try:
            return str(self.device_module().get_device_name(self.device_index))
        except Exception:  # noqa: BLE001 - a module without get_device_name: key by index alone
            return f"device{self.device_index}"

    def _staging(self, nbytes: int, stream: Stream) -> torch.Tensor:
        with self.device_module().stream(stream):  # the caching allocator reuses it only in this stream's order
            return self.alloc_device(nbytes)

    def _memcpy_kind(self, direction: Direction | None) -> int:
        if direction is None:
            raise BackendError(
                f"{self.label}: execute() needs direction=, one of {DIRECTIONS}, on an accelerator (some "
                f"vendors' async memcpy takes the copy kind, so every accelerator backend requires it); pass e.g. "
                f"direction='d2h' for a device -> host plan"
            )
        kind = self.memcpy_kinds.get(direction)
        if kind is None:
            raise BackendError(
                f"{self.label}: direction={direction!r} is not supported by {self.memcpy_symbol}; this backend "
                f"runs {sorted(self.memcpy_kinds)}"
            )
        return kind

    def _stream_handle(self, stream: Any) -> int:
        """The raw handle of ``stream``. Read right before enqueuing: torch_npu flushes its task queue to the
        stream when ``npu_stream`` is read, so work torch queued earlier reaches the device first."""
        attribute = self.stream_handle_attribute
        if not hasattr(stream, attribute) and hasattr(stream, "stream_id"):
            # a device-generic torch.Stream (torch.accelerator.current_stream()): the device's own type has the handle
            stream = self.device_module().Stream(
                stream_id=stream.stream_id, device_index=stream.device_index, device_type=stream.device_type
            )
        handle = getattr(stream, attribute, None)
        if not isinstance(handle, int):
            raise BackendError(
                f"{self.label}: execute() runs on streams of this backend (backend.new_stream(), "
                f"backend.current_stream()); {type(stream).__name__} has no {attribute!r} handle"
            )
        return handle
