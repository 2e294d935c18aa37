"""Descriptor-size sweep (kind ``offload``): one plan of equal descriptors of 1-256 KiB, by every route the
backend has, against a contiguous ``copy_`` of the same bytes in the same run.

The device side is spread (every other slot, so nothing coalesces) and the host side packed, as an offload of
a request's scattered device blocks into fresh host blocks is. The row's own figure is the ``auto`` route (what
``execute`` picks); ``params["gbps_by_route"]`` has every route of ``AcceleratorBackend.routes()``: ``dma`` (the
backend's copy function, ``cudaMemcpyBatchAsync`` on CUDA 12.8+), ``loop`` (one async memcpy per descriptor),
``staged`` and ``direct`` (the copy kernel, ``kvplane.backend.gather``), each the median of ``MIN_REPS`` runs;
``ratio_by_route`` divides each by the contiguous copy's speed. A backend without routes (cpu) has ``auto`` only.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from kvplane.backend.accelerator import AcceleratorBackend
from kvplane.backend.base import Backend, Direction
from kvplane.backend.gather import RouteName
from kvplane.bench.results import BenchResult, make_result
from kvplane.bench.scenario import Scenario
from kvplane.bench.timing import MIN_REPS, interleave, timed
from kvplane.descriptors import CopyPlan

if TYPE_CHECKING:
    import torch

SIZES_KIB = (1, 4, 16, 64, 256)
BYTES, QUICK_BYTES = 64 << 20, 4 << 20  # moved per plan
MAX_DESCRIPTORS = 16384

_held: list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (backend, device, host, flat) reused


def release() -> None:
    _held.clear()


def _buffers(backend: Backend, nbytes: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if _held and _held[0][0] == backend.label and _held[0][2].numel() >= nbytes:
        return _held[0][1], _held[0][2], _held[0][3]
    _held.clear()
    device, host, flat = backend.alloc_device(2 * nbytes), backend.alloc_host(nbytes), backend.alloc_device(nbytes)
    _held.append((backend.label, device, host, flat))
    return device, host, flat


def run_sweep(backend: Backend, direction: Direction, size_kib: int, quick: bool) -> BenchResult:
    import torch

    size = size_kib << 10
    count = min(MAX_DESCRIPTORS, (QUICK_BYTES if quick else BYTES) // size)
    nbytes = count * size
    device, host, flat = _buffers(backend, nbytes)
    device.view(torch.int64)[: 2 * nbytes // 8].copy_(
        torch.arange(2 * nbytes // 8, dtype=torch.int64, device=device.device) * 0x9E3779B1)
    spread = int(device.data_ptr()) + np.arange(count, dtype=np.int64) * (2 * size)
    packed = int(host.data_ptr()) + np.arange(count, dtype=np.int64) * size
    lengths = np.full(count, size, np.int64)
    plan = CopyPlan(spread, packed, lengths) if direction == "d2h" else CopyPlan(packed, spread, lengths)
    stream, event = backend.new_stream(), backend.new_event()
    if direction == "h2d":
        host[:nbytes].copy_(device[: 2 * nbytes].view(count, 2 * size)[:, :size].reshape(-1).cpu())
    backend.synchronize()
    routes: tuple[RouteName, ...] = backend.routes() if isinstance(backend, AcceleratorBackend) else ("auto",)

    def by(route: RouteName) -> Callable[[], None]:
        def go() -> None:
            if isinstance(backend, AcceleratorBackend):
                backend.execute_route(plan, stream, direction=direction, route=route)
            else:
                backend.execute(plan, stream, direction=direction)
            event.record(stream)
            event.synchronize()

        return go

    by("auto")()
    blocks = device[: 2 * nbytes].view(count, 2 * size)[:, :size].reshape(-1).cpu()
    verified = torch.equal(blocks, host[:nbytes].cpu())
    src, dst = (flat, host) if direction == "d2h" else (host, flat)

    def raw() -> None:
        dst[:nbytes].copy_(src[:nbytes])
        backend.synchronize()

    samples = interleave(by("auto"), raw)
    gbps: dict[str, float] = {}
    for route in routes:
        if route != "auto":
            run = by(route)
            run()  # warm-up (a kernel's first launch compiles)
            gbps[route] = round(nbytes / statistics.median(timed(run) for _ in range(MIN_REPS)) / 1e9, 3)
    base = nbytes / samples.baseline_median / 1e9
    return make_result(scenario=f"sweep-{direction}-{size_kib}k", kind="offload", backend=backend.label,
                       transport="local", nbytes=nbytes, samples=samples, baseline="contiguous copy_",
                       verified=verified, descriptors=count,
                       params={
                           "direction": direction, "descriptor_bytes": size, "descriptors": count,
                           "gbps_by_route": gbps, "ratio_by_route": {k: round(v / base, 3) for k, v in gbps.items()},
                           "auto_route": route_of(backend, plan, direction),
                           "crossover": _crossover(backend),
                           "torch_device": str(backend.device()),
                       })


def route_of(backend: Backend, plan: CopyPlan, direction: Direction) -> str:
    """The route ``execute`` takes for ``plan`` here, for a row's params."""
    return backend.route_for(plan, direction) if isinstance(backend, AcceleratorBackend) else "execute"


def _crossover(backend: Backend) -> dict[str, object]:
    if not isinstance(backend, AcceleratorBackend) or backend.kernel_path is None:
        return {}
    found = backend.crossover()
    return {"size": found.size, "count": found.count, "source": found.source}


def scenario(direction: Direction, size_kib: int) -> Scenario:
    """A plan of ``size_kib`` KiB descriptors, ``direction`` d2h or h2d, by every route."""

    def run(backend: Backend, quick: bool) -> BenchResult:
        return run_sweep(backend, direction, size_kib, quick)

    params = {"direction": direction, "size_kib": size_kib}
    return Scenario(f"sweep-{direction}-{size_kib}k", "offload", run, params, release=release)
