"""The Backend interface: device facts as class attributes plus the few primitives kvplane needs.

Public methods check their input and format errors; a backend fills the ``_``-prefixed primitives and
overrides only what its device does differently or faster. Core code reads the attributes (collective name,
Mooncake protocol, NIXL memory type, alignment) and never branches on a device name.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol, get_args

from kvplane.descriptors import CopyPlan, Region
from kvplane.errors import BackendError, PlanError

if TYPE_CHECKING:
    import torch


# Which memories a plan copies between: h(ost), d(evice). Accelerator vendors' async memcpy takes the kind
# (aclrtMemcpyAsync, cnrtMemcpyAsync_V2), so accelerator backends require it; the cpu backend ignores it.
Direction = Literal["h2d", "d2h", "d2d", "h2h"]
DIRECTIONS: tuple[Direction, ...] = get_args(Direction)


@dataclass(frozen=True)
class Probe:
    """Whether a backend can run here, and why not when it cannot."""

    available: bool
    reason: str = ""


class Stream(Protocol):
    """An in-order queue of device work (``torch.Stream`` on accelerators, an ordered worker on cpu)."""

    def synchronize(self) -> None: ...
    def wait_event(self, event: Any) -> None: ...
    def query(self) -> bool: ...


class Event(Protocol):
    """A point in a stream: done once all work submitted before ``record`` has run."""

    def record(self, stream: Any = None) -> None: ...
    def synchronize(self) -> None: ...
    def query(self) -> bool: ...


class Backend(ABC):
    # -- device facts -------------------------------------------------------------------------------------
    name: ClassVar[str]  # what KVPLANE_DEVICE says: cpu, cuda, npu, mlu
    torch_device_type: ClassVar[str]
    is_accelerator: ClassVar[bool] = True
    collective_backend: ClassVar[str]  # torch.distributed backend: gloo, nccl, hccl, cncl
    visible_devices_env: ClassVar[str | None] = None
    device_package: ClassVar[str | None] = None  # the module the device needs imported (torch_npu...)
    install_hint: ClassVar[str] = ""
    mooncake_protocol: ClassVar[str]  # tcp, rdma, ascend
    nixl_memory_type: ClassVar[str]  # DRAM or VRAM
    registration_alignment: ClassVar[int] = 1
    max_registered_regions: ClassVar[int | None] = None
    registration_merge_gap: ClassVar[int] = 0
    layouts: ClassVar[dict[str, str]]  # family -> the layout this device's engines use
    mooncake_env_defaults: ClassVar[Mapping[str, str]] = {}  # set before Mooncake's initialize, if unset
    nixl_env_defaults: ClassVar[Mapping[str, str]] = {}  # set while a NIXL agent starts (UCX reads it then), if unset
    # A test double (kvplane.testing's emulated devices, a test suite's fakes): its name says "emulated" too
    emulated: ClassVar[bool] = False

    def __init__(self, device_index: int = 0) -> None:
        self.device_index = device_index

    # -- discovery ----------------------------------------------------------------------------------------
    @classmethod
    @abstractmethod
    def probe(cls) -> Probe:
        """Whether this backend can run here. Must not raise, and must not import a missing device package."""

    @property
    def label(self) -> str:
        """How reports name this backend: its name, which for an emulated device says "emulated"."""
        return self.name

    # -- devices and memory -------------------------------------------------------------------------------
    def device(self) -> torch.device:
        import torch

        return torch.device(self.torch_device_type, self.device_index)

    def mooncake_location(self) -> str:
        """The location string Mooncake's ``register_memory`` takes for this device's memory."""
        return f"{self.torch_device_type}:{self.device_index}"

    def alloc_host(self, nbytes: int, *, pinned: bool = True) -> torch.Tensor:
        """Host memory as a uint8 tensor, pinned for DMA where the device supports it."""
        if nbytes <= 0:
            raise BackendError(f"alloc_host: nbytes={nbytes} must be > 0")
        try:
            return self._alloc_host(nbytes, pinned)
        except BackendError:
            raise
        except (RuntimeError, MemoryError, AssertionError) as e:  # torch.cuda raises AssertionError if absent
            raise BackendError(f"{self.label}: allocating {nbytes} B of host memory failed: {e}") from e

    def alloc_device(self, nbytes: int) -> torch.Tensor:
        """Device memory as a uint8 tensor."""
        if nbytes <= 0:
            raise BackendError(f"alloc_device: nbytes={nbytes} must be > 0")
        import torch

        try:
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device())
        except BackendError:
            raise
        except (RuntimeError, MemoryError, AssertionError) as e:
            raise BackendError(f"{self.label}: allocating {nbytes} B of device memory failed: {e}") from e

    # -- streams and copies -------------------------------------------------------------------------------
    @abstractmethod
    def new_stream(self) -> Stream:
        """A fresh copy stream."""

    @abstractmethod
    def current_stream(self) -> Stream:
        """The stream compute runs on now (what ``save_layer`` records its event on)."""

    @abstractmethod
    def new_event(self) -> Event:
        """An event that can be recorded on this backend's streams."""

    def execute(self, plan: CopyPlan, stream: Stream | None = None, *, direction: Direction | None = None) -> None:
        """Enqueue every descriptor of ``plan`` on ``stream`` (None: run now and return when done).

        ``direction`` says which memories the plan copies between; accelerator backends require it.
        """
        if not isinstance(plan, CopyPlan):
            raise PlanError(f"execute() takes a CopyPlan, got {type(plan).__name__}")
        if direction is not None and direction not in DIRECTIONS:
            raise PlanError(f"execute(direction={direction!r}) is not a direction; use one of {DIRECTIONS}")
        if len(plan):
            self._execute(plan, stream, direction=direction)

    def execute_parts(
        self, plan: CopyPlan, bounds: Sequence[int], stream: Stream, *, direction: Direction | None = None
    ) -> list[Event]:
        """Enqueue descriptors ``[bounds[i], bounds[i + 1])`` of ``plan`` in order (one part per layer, bounds
        increasing), each followed by an event; returns the events. A backend may run all parts as one task
        (the cpu backend does)."""
        self._check_parts(plan, bounds, direction)
        events = []
        for a, b in zip(bounds[:-1], bounds[1:]):
            if b > a:
                self._execute(CopyPlan(plan.src[a:b], plan.dst[a:b], plan.length[a:b]), stream, direction=direction)
            event = self.new_event()
            event.record(stream)
            events.append(event)
        return events

    def _check_parts(self, plan: CopyPlan, bounds: Sequence[int], direction: Direction | None) -> None:
        if not isinstance(plan, CopyPlan):
            raise PlanError(f"execute_parts() takes a CopyPlan, got {type(plan).__name__}")
        if direction is not None and direction not in DIRECTIONS:
            raise PlanError(f"execute_parts(direction={direction!r}) is not a direction; use one of {DIRECTIONS}")
        if len(bounds) and (bounds[0] < 0 or bounds[-1] > len(plan)):
            raise PlanError(
                f"execute_parts bounds run {bounds[0]}..{bounds[-1]}, the plan has {len(plan)} descriptors; "
                f"pass increasing bounds within 0..len(plan)"
            )

    @abstractmethod
    def _execute(self, plan: CopyPlan, stream: Stream | None, *, direction: Direction | None = None) -> None: ...

    @abstractmethod
    def _alloc_host(self, nbytes: int, pinned: bool) -> torch.Tensor: ...

    def synchronize(self) -> None:
        """Wait for all work this backend has queued."""

    # -- registration -------------------------------------------------------------------------------------
    def registration_spans(self, regions: Sequence[Region]) -> list[tuple[int, int]]:
        """``(addr, length)`` ranges to register with a transfer engine: merged, aligned and capped.

        Spans closer than ``registration_merge_gap`` merge; each is widened to ``registration_alignment``.
        More than ``max_registered_regions`` left is an error naming the limit.
        """
        if not regions:
            return []
        gap, align = self.registration_merge_gap, self.registration_alignment
        merged: list[list[int]] = []
        for start, end in sorted((r.addr, r.end) for r in regions):
            if merged and start <= merged[-1][1] + gap:  # close neighbours first, as vllm-ascend does
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        aligned: list[list[int]] = []
        for start, end in merged:  # then widen to the alignment, merging what now overlaps
            start, end = (start // align) * align, -(-end // align) * align
            if aligned and start <= aligned[-1][1]:
                aligned[-1][1] = max(aligned[-1][1], end)
            else:
                aligned.append([start, end])
        merged = aligned
        limit = self.max_registered_regions
        if limit is not None and len(merged) > limit:
            raise BackendError(
                f"{self.label}: {len(merged)} memory regions to register, the device allows {limit}; "
                f"allocate the KV cache in fewer, larger tensors"
            )
        return [(s, e - s) for s, e in merged]
