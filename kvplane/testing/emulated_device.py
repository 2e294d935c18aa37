"""The stand-in ``torch.<device>`` module of an emulated device: CPU memory behind the surface backends call.

``kvplane.testing.emulated.install_emulated`` builds one with ``device_module`` and puts it where the device
package would (``torch.npu``, ``torch.mlu``). It offers what ``AcceleratorBackend`` and engines call:
``is_available``, ``device_count``, ``set_device``, ``current_device``, ``device`` (a context manager),
``Stream`` (with the vendor's raw-handle attribute, e.g. ``npu_stream``), ``Event``, ``current_stream``,
``default_stream``, ``stream`` (a context manager), ``synchronize``.

The emulated vendor memcpy (``kvplane/_native/async_copy.c``) copies when it is called, so work is done by the
time it is enqueued: streams are always idle, events complete when recorded. Stream handles are distinct
numbers that are never dereferenced.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

EMULATED_MARK = "__kvplane_emulated__"
_handles = itertools.count(0x6B76_0000, 0x100)


class EmulatedStream:
    """A stream of an emulated device; subclassed per device to add the raw-handle attribute."""

    device_type_name = "emulated"

    def __init__(self, device: Any = None, priority: int = 0, *, stream_id: int = 0, **_: Any) -> None:
        self.device_index = _index(device)
        self.priority = priority
        self.stream_id = stream_id or next(_handles)  # the raw handle; rebuilding by stream_id finds the same

    @property
    def handle(self) -> int:
        return self.stream_id

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        event.synchronize()

    def wait_stream(self, stream: Any) -> None:
        stream.synchronize()

    def record_event(self, event: Any = None) -> Any:
        event = event if event is not None else EmulatedEvent()
        event.record(self)
        return event

    def __eq__(self, other: object) -> bool:
        return isinstance(other, EmulatedStream) and other.stream_id == self.stream_id

    def __hash__(self) -> int:
        return hash(self.stream_id)

    def __repr__(self) -> str:
        return f"<emulated {self.device_type_name} stream {self.stream_id:#x} on device {self.device_index}>"


class EmulatedEvent:
    """An event of an emulated device: complete once recorded, since enqueued work has already run."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self.enable_timing = enable_timing
        self._recorded_at: float | None = None

    def record(self, stream: Any = None) -> None:
        self._recorded_at = time.perf_counter()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def wait(self, stream: Any = None) -> None:
        return None

    def elapsed_time(self, end_event: EmulatedEvent) -> float:
        if self._recorded_at is None or end_event._recorded_at is None:
            raise RuntimeError("elapsed_time: both events must be recorded first")
        return (end_event._recorded_at - self._recorded_at) * 1000.0


def _index(device: Any) -> int:
    if device is None:
        return 0
    if isinstance(device, int):
        return device
    index = getattr(device, "index", None)  # torch.device
    if isinstance(index, int):
        return index
    if isinstance(device, str) and ":" in device:
        return int(device.rsplit(":", 1)[1])
    return 0


def device_module(device_type: str, stream_attribute: str, device_count: int) -> ModuleType:
    """A fresh stand-in for ``torch.<device_type>`` with ``device_count`` devices."""
    module = ModuleType(f"torch.{device_type}", f"Emulated {device_type}: CPU memory, kvplane.testing (no hardware).")
    stream_cls = type(
        "Stream",
        (EmulatedStream,),
        {stream_attribute: EmulatedStream.handle, "device_type_name": device_type, "__module__": module.__name__},
    )
    d = _Devices(device_type, device_count, stream_cls)
    functions = {
        "is_available": lambda: True,
        "is_initialized": lambda: True,
        "init": lambda: None,
        "device_count": lambda: device_count,
        "current_device": d.current_device,
        "set_device": d.set_device,
        "device": d.device,
        "current_stream": d.current_stream,
        "default_stream": d.default_stream,
        "stream": d.stream,
        "synchronize": lambda device=None: None,
        "get_device_name": lambda device=None: f"kvplane emulated {device_type} (CPU memory)",
        "Stream": stream_cls,
        "Event": EmulatedEvent,
        EMULATED_MARK: True,
    }
    for name, value in functions.items():
        setattr(module, name, value)
    return module


class _Devices:
    """The current device and stream of each thread (as in torch) and each device's default stream."""

    def __init__(self, device_type: str, device_count: int, stream_cls: type[EmulatedStream]) -> None:
        self.device_type, self.device_count, self.stream_cls = device_type, device_count, stream_cls
        self.state = threading.local()
        self.defaults: dict[int, Any] = {}

    def check(self, index: int) -> int:
        if not 0 <= index < self.device_count:
            raise RuntimeError(f"emulated {self.device_type}: device {index} does not exist ({self.device_count} "
                               f"emulated)")
        return index

    def current_device(self) -> int:
        return int(getattr(self.state, "device", 0))

    def set_device(self, device: Any) -> None:
        self.state.device = self.check(_index(device))

    def _streams(self) -> dict[int, Any]:
        streams: dict[int, Any] = getattr(self.state, "streams", {})
        self.state.streams = streams
        return streams

    def current_stream(self, device: Any = None) -> Any:
        index = self.check(_index(device) if device is not None else self.current_device())
        return self._streams().get(index) or self.default_stream(index)

    def default_stream(self, device: Any = None) -> Any:
        index = self.check(_index(device) if device is not None else self.current_device())
        return self.defaults.setdefault(index, self.stream_cls(index))

    @contextmanager
    def device(self, index: Any) -> Iterator[None]:
        previous = self.current_device()
        self.set_device(index)
        try:
            yield
        finally:
            self.state.device = previous

    @contextmanager
    def stream(self, s: Any) -> Iterator[None]:
        streams = self._streams()
        previous = streams.get(s.device_index)
        streams[s.device_index] = s
        try:
            yield
        finally:
            streams[s.device_index] = previous
