"""The copy-kernel path (``kvplane.backend.gather``): staging arithmetic, route choice, crossover, and every
route of an emulated accelerator moving random blocks of a real KV layout, bytes compared.

The kernel here is a reference (one ``memmove`` per descriptor, in this test only); the cuda backend's Triton
kernel runs the same checks under Triton's interpreter in ``test_triton_copy_kernel.py``.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvplane_ascend.backend import AscendBackend

from kvplane.backend import gather
from kvplane.backend.gather import (
    Crossover,
    Crossovers,
    PinnedRanges,
    choose,
    crossover_from_env,
    host_runs,
    measure,
    pieces,
    staged,
)
from kvplane.conformance.helpers import fill_random, mismatches
from kvplane.descriptors import CopyPlan
from kvplane.errors import BackendError
from kvplane.kv.binding import allocate_cache, regions_from_tensors
from kvplane.kv.spec import KVSpec
from kvplane.plan import block_copy_plan
from kvplane.testing.backends import emulated_backend
from kvplane.testing.emulated import uninstall_emulated

SMALL = Crossover(size=64 << 10, count=2, source="test")


class ReferenceKernel:
    """A copy kernel by the book: each descriptor ``memmove``d, counting launches."""

    name = "reference"

    def __init__(self) -> None:
        self.launches = 0

    def launch(self, plan: CopyPlan, stream: Any) -> None:
        self.launches += 1
        for s, d, n in zip(plan.src.tolist(), plan.dst.tolist(), plan.length.tolist()):
            ctypes.memmove(d, s, n)


def run_plan(plan: CopyPlan) -> None:
    ReferenceKernel().launch(plan, None)


def _plan(src: int, dst: int, src_slots: list[int], dst_slots: list[int], size: int) -> CopyPlan:
    n = len(src_slots)
    return CopyPlan(src + np.array(src_slots, np.int64) * size, dst + np.array(dst_slots, np.int64) * size,
                    np.full(n, size, np.int64))


@settings(max_examples=60, deadline=None)
@given(data=st.data(), direction=st.sampled_from(["d2h", "h2d"]))
def test_a_staged_plan_leaves_the_same_bytes_as_the_plan(data: st.DataObject, direction: str) -> None:
    slots, size = 16, 32
    n = data.draw(st.integers(1, slots))
    src_slots = data.draw(st.permutations(range(slots)))[:n]
    dst_slots = data.draw(st.permutations(range(slots)))[:n]
    src = np.random.default_rng(n).integers(0, 256, slots * size, dtype=np.uint8)
    want, got, staging = np.zeros_like(src), np.zeros_like(src), np.zeros(n * size, np.uint8)
    run_plan(_plan(src.ctypes.data, want.ctypes.data, src_slots, dst_slots, size))
    plan = _plan(src.ctypes.data, got.ctypes.data, src_slots, dst_slots, size)
    kernel, bulk = staged(plan, direction, staging.ctypes.data)
    for part in (kernel, bulk) if direction == "d2h" else (bulk, kernel):
        run_plan(part)
    assert np.array_equal(got, want)
    assert len(bulk) == host_runs(plan, direction) and bulk.total_bytes == plan.total_bytes


def test_contiguous_host_blocks_leave_in_one_descriptor() -> None:
    plan = _plan(0x10000, 0x900000, [7, 1, 4, 9], [0, 1, 2, 3], 4096)
    kernel, bulk = staged(plan, "d2h", 0x500000)
    assert len(bulk) == 1 and int(bulk.length[0]) == 4 * 4096 and int(bulk.dst[0]) == 0x900000
    assert kernel.dst.tolist() == [0x500000 + i * 4096 for i in range(4)]


def test_routes_follow_size_host_runs_and_pinned_memory() -> None:
    pinned = PinnedRanges()
    contiguous_host = _plan(0x10000, 0x900000, [7, 1, 4, 9], [0, 1, 2, 3], 4096)
    scattered_host = _plan(0x10000, 0x900000, [7, 1, 4, 9], [6, 0, 2, 4], 4096)
    assert choose(contiguous_host, "d2h", SMALL, pinned) == "staged"
    assert choose(scattered_host, "d2h", SMALL, pinned) == "dma"  # not pinned: the kernel may not touch it
    pinned.add(0x900000, 8 * 4096)
    assert choose(scattered_host, "d2h", SMALL, pinned) == "direct"
    assert choose(scattered_host, "d2h", Crossover(4096, 2, "test"), pinned) == "dma"  # at the crossover: DMA
    assert choose(scattered_host, "d2h", Crossover(64 << 10, 5, "test"), pinned) == "dma"  # too few descriptors
    assert choose(scattered_host, "d2d", SMALL, pinned) == "direct"
    assert choose(scattered_host, "h2h", SMALL, pinned) == "dma"
    pinned.remove(0x900000)
    assert not pinned.covers(scattered_host.dst, scattered_host.length)


def test_pinned_ranges_cover_only_whole_descriptors_inside_one_allocation() -> None:
    pinned = PinnedRanges()
    pinned.add(1000, 100)
    pinned.add(2000, 100)
    lengths = np.array([10, 10], np.int64)
    assert pinned.covers(np.array([1000, 2090], np.int64), lengths)
    assert not pinned.covers(np.array([1000, 2095], np.int64), lengths)  # runs past the end
    assert not pinned.covers(np.array([1095, 2000], np.int64), lengths)
    assert not pinned.covers(np.array([900, 2000], np.int64), lengths)  # before the first
    assert pinned.covers(np.zeros(0, np.int64), np.zeros(0, np.int64))


@settings(max_examples=50, deadline=None)
@given(lengths=st.lists(st.integers(1, 5000), min_size=1, max_size=40), limit=st.integers(1, 8000))
def test_pieces_keep_every_descriptor_in_order_within_the_limit(lengths: list[int], limit: int) -> None:
    n = len(lengths)
    plan = CopyPlan(np.arange(n, dtype=np.int64), np.arange(n, dtype=np.int64) + 100, np.array(lengths, np.int64))
    parts = pieces(plan, limit)
    assert np.concatenate([p.src for p in parts]).tolist() == plan.src.tolist()
    assert all(p.total_bytes <= limit or len(p) == 1 for p in parts)


def test_the_crossover_variable_is_parsed_once_and_names_its_fix() -> None:
    assert crossover_from_env(None) is None and crossover_from_env("") is None
    assert crossover_from_env("32768") == Crossover(32768, 1, "env")
    with pytest.raises(BackendError, match=r"KVPLANE_GATHER_CROSSOVER='16k' is not a byte count; set it"):
        crossover_from_env("16k")


def test_measure_finds_where_dma_catches_up_and_the_fewest_descriptors() -> None:
    """Modelled seconds, no clock: DMA pays per small descriptor, the kernel a launch plus a little per one."""

    def dma_s(plan: CopyPlan) -> float:
        return len(plan) * 2e-6 if int(plan.length[0]) < 32 << 10 else 0.0

    def kernel_s(plan: CopyPlan) -> float:
        return 3e-5 + len(plan) * 1e-7

    found = measure(dma_s, kernel_s, 0x1000, 0x2000, span=1 << 20)
    assert found.size == 32 << 10 and found.count == 16 and found.source == "measured"


def test_best_seconds_is_the_fastest_of_its_runs() -> None:
    from kvplane.backend.gather import best_seconds

    runs: list[int] = []
    seconds = best_seconds(lambda plan: runs.append(len(plan)), reps=4)(_plan(0, 0, [0, 1], [2, 3], 8))
    assert runs == [2, 2, 2, 2] and 0.0 <= seconds < float("inf")


def test_crossovers_are_measured_once_and_kept_in_the_cache_file(tmp_path: Path) -> None:
    calls: list[int] = []

    def measured() -> Crossover:
        calls.append(1)
        return Crossover(16384, 4, "measured")

    first = Crossovers(tmp_path).get("cuda:H100", measured)
    again = Crossovers(tmp_path).get("cuda:H100", measured)  # another process: read from the file
    assert first.size == again.size == 16384 and again.source == "cache" and calls == [1]
    assert Crossovers(tmp_path).get("cuda:H200", measured).source == "measured" and calls == [1, 1]


# -- an emulated accelerator with the reference kernel: every route, bytes compared -----------------------------


class KernelAscend(emulated_backend(AscendBackend)):  # type: ignore[misc]
    name = "npu-emulated-kernel"

    def __init__(self, index: int = 0) -> None:
        super().__init__(index)
        self.kernel = ReferenceKernel()

    def copy_kernel(self) -> ReferenceKernel:
        return self.kernel


@pytest.fixture
def backend(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[KernelAscend]:
    monkeypatch.setenv("KVPLANE_GATHER_CROSSOVER", str(64 << 10))
    yield KernelAscend(0)
    uninstall_emulated("npu")


def _caches(backend: KernelAscend, direction: str, host_ids: str) -> tuple[Any, ...]:
    spec = KVSpec.gqa(num_layers=3, heads=2, head_dim=64, tokens_per_block=16)
    layout = backend.layouts["gqa"]
    device = allocate_cache(spec, layout, 32, alloc=backend.alloc_device)
    host = allocate_cache(spec, layout, 32, alloc=backend.alloc_host)
    rng = np.random.default_rng(3)
    src_cache, dst_cache = (device, host) if direction == "d2h" else (host, device)
    fill_random(backend, spec, src_cache, layout, seed=5)
    src_ids = rng.choice(32, 9, replace=False).astype(np.int64)
    dst_ids = rng.choice(32, 9, replace=False).astype(np.int64) if host_ids == "scattered" else np.arange(9)
    if direction == "h2d":
        src_ids, dst_ids = dst_ids, src_ids
    plan = block_copy_plan(regions_from_tensors(spec, src_cache, layout), src_ids,
                           regions_from_tensors(spec, dst_cache, layout), dst_ids)
    return spec, layout, src_cache, src_ids, dst_cache, dst_ids, plan


@pytest.mark.parametrize("direction", ["d2h", "h2d"])
@pytest.mark.parametrize("route", ["auto", "dma", "staged", "direct"])
def test_every_route_moves_exactly_the_planned_blocks(backend: KernelAscend, direction: str, route: str) -> None:
    spec, layout, src, src_ids, dst, dst_ids, plan = _caches(backend, direction, "scattered")
    backend.execute_route(plan, backend.new_stream(), direction=direction, route=route)  # type: ignore[arg-type]
    assert mismatches(spec, layout, src, src_ids, dst, dst_ids) == []
    assert backend.kernel.launches == (0 if route == "dma" else 1 if route in ("direct", "auto") else 1)


def test_auto_stages_contiguous_host_blocks_and_goes_direct_to_scattered_pinned_ones(
    backend: KernelAscend, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVPLANE_GATHER_CROSSOVER", "16384")  # 4 KiB descriptors; runs of 36 KiB reach it
    routes: list[str] = []
    original = gather.KernelPath.route

    def spy(self: gather.KernelPath, plan: CopyPlan, direction: str) -> gather.Route:
        routes.append(original(self, plan, direction))
        return routes[-1]

    with pytest.MonkeyPatch.context() as m:
        m.setattr(gather.KernelPath, "route", spy)
        for host_ids in ("contiguous", "scattered"):
            *_, plan = _caches(backend, "d2h", host_ids)
            backend.execute(plan, backend.new_stream(), direction="d2h")
    assert routes == ["staged", "direct"]


def test_direct_refuses_host_memory_the_backend_did_not_pin(backend: KernelAscend) -> None:
    src, dst = backend.alloc_device(1 << 16), torch.zeros(1 << 16, dtype=torch.uint8)  # dst: not alloc_host's
    plan = _plan(int(src.data_ptr()), int(dst.data_ptr()), [0, 2, 4], [1, 3, 5], 4096)
    with pytest.raises(BackendError, match="route='direct' needs the host side of a d2h plan in pinned memory"):
        backend.execute_route(plan, backend.new_stream(), direction="d2h", route="direct")
    backend.execute(plan, backend.new_stream(), direction="d2h")  # auto: DMA, the kernel untouched
    assert backend.kernel.launches == 0 and torch.equal(dst[4096:8192], src[0:4096])


def test_the_crossover_variable_at_zero_turns_the_kernel_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPLANE_GATHER_CROSSOVER", "0")
    try:
        off = KernelAscend(0)
        assert off.routes() == ("auto", "dma")
    finally:
        uninstall_emulated("npu")


def test_descriptor_tables_reuse_a_pinned_slot_only_after_its_copy_is_done() -> None:
    from kvplane_cuda.gather import PinnedTables

    events: list[Any] = []

    class Event:
        def __init__(self) -> None:
            self.recorded = self.waited = 0
            events.append(self)

        def record(self) -> None:
            self.recorded += 1

        def synchronize(self) -> None:
            self.waited += 1

    tables = PinnedTables(alloc=lambda n: torch.zeros(n, dtype=torch.int64), new_event=Event)
    rng = np.random.default_rng(0)
    for round_ in range(PinnedTables.SLOTS + 1):
        n = 5000 if round_ == PinnedTables.SLOTS else 10
        columns = tuple(rng.integers(0, 1 << 40, n) for _ in range(3))
        table = tables.upload(columns, torch.device("cpu"))
        assert table.shape == (3, n) and np.array_equal(table.numpy(), np.stack(columns))
    assert [e.waited for e in events] == [1, 0, 0, 0, 0]  # slot 0 again: its earlier copy awaited, once
