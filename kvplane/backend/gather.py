"""Device-side gather and scatter: a plan of many small descriptors as one kernel launch instead of one DMA each.

A copy engine moves small descriptors slowly (``cudaMemcpyBatchAsync``: 4-7 GB/s under 28 KiB on an H100, 40-52
GB/s above), while a copy kernel reads and writes at memory speed whatever the pieces. A backend with such a
kernel returns a ``CopyKernel`` from ``AcceleratorBackend.copy_kernel()``; this module decides per plan how to
use it, and knows no device:

- ``staged``: the device side of a d2h plan is gathered by the kernel into a staging buffer on the device, in
  plan order, which leaves in one DMA per run of contiguous host bytes; h2d is the reverse (host runs land in
  staging, the kernel scatters them). The kernel touches device memory only, so any host memory works.
- ``direct``: the kernel reads or writes the host side itself (unified addressing), one launch for the whole
  plan. Taken when the host side does not coalesce into runs of the crossover size and every host byte lies in
  pinned memory this backend allocated (``PinnedRanges``), which the device can address; never for other host
  memory (that is staged when its side coalesces at all, else left to DMA).
- ``dma``: the backend's own copy function, for plans whose descriptors are at or above the crossover.

The crossover is the descriptor size from which DMA is at least as fast as the kernel, and the fewest
descriptors for which the kernel pays its launch: ``measure`` finds both on this device at first use, and
``Crossovers`` caches them per process and in a file (``KVPLANE_CACHE_DIR``, default ``~/.cache/kvplane``).
``KVPLANE_GATHER_CROSSOVER=<bytes>`` fixes the size instead (``0`` turns the kernel path off).
"""

from __future__ import annotations

import collections
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np

from kvplane.descriptors import CopyPlan, Int64Array, inside
from kvplane.errors import BackendError

Route = Literal["dma", "staged", "direct"]
RouteName = Literal["auto", "dma", "loop", "staged", "direct"]  # what AcceleratorBackend.execute_route takes
STAGING_MAX = 256 << 20  # staging bytes per piece: larger plans go through it in pieces, in stream order
GATHER_ENV = "KVPLANE_GATHER_CROSSOVER"
SIZES = tuple(1 << s for s in range(10, 19))  # 1 KiB .. 256 KiB, what ``measure`` tries
COUNTS = (1, 2, 4, 8, 16, 32, 64)
PROBE_SIZE = 4 << 10
SPAN = 64 << 20  # bytes of device and host memory ``measure`` borrows
# where DMA wins at no measured size, the kernel still stops at twice the largest: a kernel takes SMs from the
# model's compute, a copy engine does not, and past 256 KiB DMA runs near its peak anyway
BEYOND = 2 * SIZES[-1]


class CopyKernel(Protocol):
    """A backend's device-side copy: every descriptor of a plan in one launch on ``stream``. Addresses are
    device memory, or host memory the device can address (pinned, under unified addressing)."""

    name: str

    def launch(self, plan: CopyPlan, stream: Any) -> None: ...


@dataclass(frozen=True)
class Crossover:
    """Below ``size`` mean bytes per descriptor, and from ``count`` descriptors on, the kernel is faster."""

    size: int
    count: int
    source: str  # measured, cache, env

    def wants_kernel(self, plan: CopyPlan) -> bool:
        n = len(plan)
        return n >= self.count and self.size > 0 and plan.total_bytes < self.size * n


class PinnedRanges:
    """Host allocations the device can address, by start address; a query is one ``searchsorted``.

    ``remove`` may run inside a garbage collection (a finalizer) on any thread, even one inside ``add``: it only
    queues the address, and the next ``add`` or ``covers`` drops it under the lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: dict[int, int] = {}
        self._gone: collections.deque[int] = collections.deque()
        self._arrays = (np.zeros(0, np.int64), np.zeros(0, np.int64))  # (starts, ends), swapped as one

    def add(self, addr: int, nbytes: int) -> None:
        with self._lock:
            self._drop_gone()
            self._spans[addr] = nbytes
            self._index()

    def remove(self, addr: int) -> None:
        self._gone.append(addr)

    def _drop_gone(self) -> None:
        changed = False
        while self._gone:
            changed |= self._spans.pop(self._gone.popleft(), None) is not None
        if changed:
            self._index()

    def _index(self) -> None:
        starts = sorted(self._spans)
        self._arrays = (np.array(starts, np.int64), np.array([s + self._spans[s] for s in starts], np.int64))

    def covers(self, addrs: Int64Array, lengths: Int64Array) -> bool:
        """Every ``[addr, addr + length)`` lies inside one recorded allocation."""
        if self._gone:
            with self._lock:
                self._drop_gone()
        return bool(inside(addrs, lengths, *self._arrays).all())


def host_runs(plan: CopyPlan, direction: str) -> int:
    """How many runs of byte-contiguous descriptors the host side has: the DMAs a staged plan leaves in."""
    host = host_side(plan, direction)
    return int(np.count_nonzero(host[1:] != host[:-1] + plan.length[:-1])) + 1 if len(plan) else 0


def host_side(plan: CopyPlan, direction: str) -> Int64Array:
    return plan.dst if direction == "d2h" else plan.src


def staged(plan: CopyPlan, direction: str, base: int) -> tuple[CopyPlan, CopyPlan]:
    """``(kernel, bulk)`` for a plan through a staging buffer at ``base`` holding its bytes in plan order: d2h
    runs the kernel (device -> staging) then bulk (staging -> host runs); h2d runs bulk then the kernel."""
    offsets = base + np.cumsum(plan.length) - plan.length  # staging is contiguous: runs follow the host side
    if direction == "d2h":
        return CopyPlan(plan.src, offsets, plan.length), CopyPlan(offsets, plan.dst, plan.length).coalesced()
    return CopyPlan(offsets, plan.dst, plan.length), CopyPlan(plan.src, offsets, plan.length).coalesced()


def choose(plan: CopyPlan, direction: str, crossover: Crossover, pinned: PinnedRanges) -> Route:
    """The route for ``plan``: DMA for big descriptors; else staged where the host side coalesces into runs DMA
    moves at full speed; else direct where the host side is pinned memory; else staged where it coalesces at
    all (fewer DMAs than the plan); else DMA."""
    if direction not in ("d2h", "h2d"):
        return "direct" if direction == "d2d" and crossover.wants_kernel(plan) else "dma"
    if not crossover.wants_kernel(plan):
        return "dma"
    runs = host_runs(plan, direction)
    if runs * crossover.size <= plan.total_bytes:
        return "staged"
    if pinned.covers(host_side(plan, direction), plan.length):
        return "direct"
    return "staged" if runs < len(plan) else "dma"


def pieces(plan: CopyPlan, limit: int = STAGING_MAX) -> list[CopyPlan]:
    """``plan`` cut, between descriptors, into pieces of at most ``limit`` bytes (one descriptor may exceed it)."""
    if plan.total_bytes <= limit:
        return [plan]
    ends = np.cumsum(plan.length)
    bounds, start = [0], 0
    while start < len(plan):  # one turn per piece: the most descriptors that fit, at least one
        before = int(ends[start - 1]) if start else 0
        start = max(start + 1, int(np.searchsorted(ends, before + limit, side="right")))
        bounds.append(start)
    return [CopyPlan(plan.src[a:b], plan.dst[a:b], plan.length[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]


def crossover_from_env(value: str | None) -> Crossover | None:
    """``KVPLANE_GATHER_CROSSOVER`` parsed once: bytes, 0 for never; None when unset."""
    if value is None or value.strip() == "":
        return None
    try:
        size = int(value)
    except ValueError:
        size = -1
    if size < 0:
        raise BackendError(f"{GATHER_ENV}={value!r} is not a byte count; set it to an integer >= 0 (0: no copy kernel)")
    return Crossover(size, 1, "env")


def best_seconds(run: Callable[[CopyPlan], None], reps: int = 3) -> Callable[[CopyPlan], float]:
    """``run`` timed: the fastest of ``reps`` wall-clock runs of a plan (``run`` returns once its copy is done)."""

    def seconds(plan: CopyPlan) -> float:
        best = float("inf")
        for _ in range(reps):
            start = time.perf_counter()
            run(plan)
            best = min(best, time.perf_counter() - start)
        return best

    return seconds


def spread_plan(src: int, dst: int, size: int, count: int) -> CopyPlan:
    """``count`` descriptors of ``size`` bytes at every other slot on both sides: nothing coalesces."""
    at = np.arange(count, dtype=np.int64) * (2 * size)
    return CopyPlan(src + at, dst + at, np.full(count, size, np.int64))


def measure(
    dma_s: Callable[[CopyPlan], float], kernel_s: Callable[[CopyPlan], float], device_addr: int, host_addr: int,
    span: int = SPAN,
) -> Crossover:
    """The crossover from the seconds d2h plans of spread descriptors take by DMA and by the kernel
    (``best_seconds`` on a device): ``size`` is the smallest of ``SIZES`` where DMA is not slower, ``count`` the
    fewest descriptors of ``PROBE_SIZE`` bytes for which the kernel is faster."""
    size = BEYOND
    for s in SIZES:
        plan = spread_plan(device_addr, host_addr, s, min(4096, span // (2 * s)))
        kernel_s(plan)  # a first launch compiles
        if dma_s(plan) <= kernel_s(plan):
            size = s
            break
    count = COUNTS[-1] + 1
    for n in COUNTS:
        plan = spread_plan(device_addr, host_addr, PROBE_SIZE, n)
        if kernel_s(plan) < dma_s(plan):
            count = n
            break
    return Crossover(size, count, "measured")


class Crossovers:
    """Measured crossovers by device key, kept for the process and in ``<cache dir>/copy-crossover.json``."""

    def __init__(self, directory: Path | None = None) -> None:
        self.directory = directory
        self._known: dict[str, Crossover] = {}

    @property
    def path(self) -> Path:
        root = self.directory or Path(os.environ.get("KVPLANE_CACHE_DIR") or Path.home() / ".cache" / "kvplane")
        return root / "copy-crossover.json"

    def get(self, key: str, measure_now: Callable[[], Crossover]) -> Crossover:
        if key in self._known:
            return self._known[key]
        stored = self._read().get(key)
        if isinstance(stored, dict) and {"size", "count"} <= stored.keys():
            found = Crossover(int(stored["size"]), int(stored["count"]), "cache")
        else:
            found = measure_now()
            self._write(key, found)
        self._known[key] = found
        return found

    def _read(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def _write(self, key: str, found: Crossover) -> None:
        data = self._read()
        data[key] = {k: v for k, v in asdict(found).items() if k != "source"}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
            tmp.replace(self.path)
        except OSError:
            pass  # a read-only home: measured again by the next process, nothing else lost


class KernelPath:
    """A backend's copy kernel with its crossover and pinned ranges: routes plans and runs the kernel routes."""

    def __init__(self, kernel: CopyKernel, crossover: Callable[[], Crossover], pinned: PinnedRanges) -> None:
        self.kernel, self._crossover, self.pinned = kernel, crossover, pinned

    def route(self, plan: CopyPlan, direction: str) -> Route:
        return choose(plan, direction, self._crossover(), self.pinned)

    def run(
        self, route: Route, plan: CopyPlan, direction: str, stream: Any, dma: Callable[[CopyPlan], None],
        staging: Callable[[int], Any],
    ) -> None:
        """Enqueue ``plan`` by ``route`` (``staged`` or ``direct``) on ``stream``; ``dma`` enqueues a plan by the
        backend's copy function, ``staging(n)`` gives ``n`` bytes of device memory ordered on ``stream``."""
        if route == "direct":
            if direction in ("d2h", "h2d") and not self.pinned.covers(host_side(plan, direction), plan.length):
                raise BackendError(
                    f"route='direct' needs the host side of a {direction} plan in pinned memory from this "
                    f"backend's alloc_host (the kernel addresses it); use route='staged' or 'auto' for other memory"
                )
            self.kernel.launch(plan, stream)
            return
        if route != "staged" or direction not in ("d2h", "h2d"):
            raise BackendError(f"route={route!r} for direction={direction!r}: the kernel path runs staged "
                               f"(d2h, h2d) or direct plans")
        for piece in pieces(plan):
            buffer = staging(piece.total_bytes)  # dropped after enqueueing: reused only in this stream's order
            kernel_plan, bulk = staged(piece, direction, int(buffer.data_ptr()))
            if direction == "d2h":
                self.kernel.launch(kernel_plan, stream)
                dma(bulk)
            else:
                dma(bulk)
                self.kernel.launch(kernel_plan, stream)


CROSSOVERS = Crossovers()
