"""The cpu backend: host memory is its "device", copies are real memcpy on ordered worker streams.

``execute_parts`` hands a whole batch of layers to the copy stream as one task that completes each layer's
event itself, copying each layer's range of the one plan in place (no per-layer plan, task or thread).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

from kvplane.backend.base import Backend, Direction, Event, Probe, Stream
from kvplane.backend.cpu import huge_pages
from kvplane.backend.cpu.memcpy import copy_plan, default_threads
from kvplane.backend.cpu.streams import CpuEvent, HostStream, WorkerStream
from kvplane.descriptors import CopyPlan
from kvplane.errors import BackendError

if TYPE_CHECKING:
    import torch


class CpuBackend(Backend):
    name = "cpu"
    torch_device_type = "cpu"
    is_accelerator = False
    collective_backend = "gloo"
    mooncake_protocol = "tcp"
    nixl_memory_type = "DRAM"
    layouts: ClassVar[dict[str, str]] = {"gqa": "packed_kv", "mla": "mla_fused", "index": "index"}
    huge_pages_min_bytes: ClassVar[int] = 8 << 20  # buffers this big ask for 2 MiB pages (huge_pages.py)

    def __init__(self, device_index: int = 0, *, copy_threads: int | None = None) -> None:
        super().__init__(device_index)
        self.copy_threads = copy_threads or default_threads()
        self._host_stream = HostStream()

    @classmethod
    def probe(cls) -> Probe:
        return Probe(True, "host memory, always available")

    def device(self) -> torch.device:
        import torch

        return torch.device("cpu")

    def mooncake_location(self) -> str:
        return "cpu:0"

    def new_stream(self) -> Stream:
        return WorkerStream()

    def current_stream(self) -> Stream:
        return self._host_stream

    def new_event(self) -> CpuEvent:
        return CpuEvent()

    def _alloc_host(self, nbytes: int, pinned: bool) -> torch.Tensor:
        import torch

        big = huge_pages.alloc(nbytes, self.huge_pages_min_bytes)
        return big if big is not None else torch.empty(nbytes, dtype=torch.uint8)  # nothing to pin without a device

    def alloc_device(self, nbytes: int) -> torch.Tensor:
        big = huge_pages.alloc(nbytes, self.huge_pages_min_bytes)
        return big if big is not None else super().alloc_device(nbytes)

    def _copy(self, plan: CopyPlan, begin: int = 0, end: int = -1) -> None:
        copy_plan(plan, self.copy_threads, begin, end)  # every copy is a host memcpy here, whatever direction

    def _execute(self, plan: CopyPlan, stream: Stream | None, *, direction: Direction | None = None) -> None:
        if stream is None or isinstance(stream, HostStream):
            self._copy(plan)
        elif isinstance(stream, WorkerStream):
            stream.submit(lambda: self._copy(plan))
        else:
            raise BackendError(f"the cpu backend cannot run work on {type(stream).__name__}")

    def execute_parts(
        self, plan: CopyPlan, bounds: Sequence[int], stream: Stream, *, direction: Direction | None = None
    ) -> list[Event]:
        if not isinstance(stream, WorkerStream):
            return super().execute_parts(plan, bounds, stream, direction=direction)
        self._check_parts(plan, bounds, direction)
        return list(stream.submit_parts(lambda a, b: self._copy(plan, a, b) if b > a else None, bounds))
