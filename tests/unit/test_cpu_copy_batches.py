"""The cpu backend's batched copies: the persistent memcpy pool, copying a range of a plan, and a batch of
layers as one task whose per-layer events complete in order."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from kvplane.backend.cpu.backend import CpuBackend
from kvplane.backend.cpu.memcpy import copy_plan
from kvplane.descriptors import CopyPlan
from kvplane.errors import PlanError

MiB = 1 << 20


def byte_plan(src: np.ndarray, dst: np.ndarray, descs: list[tuple[int, int, int]]) -> CopyPlan:
    s, d = src.ctypes.data, dst.ctypes.data
    return CopyPlan(
        np.array([s + a for a, _, _ in descs], np.int64),
        np.array([d + b for _, b, _ in descs], np.int64),
        np.array([n for _, _, n in descs], np.int64),
    )


def native_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def test_large_copies_reuse_a_fixed_pool_of_threads() -> None:
    src = np.random.default_rng(0).integers(0, 255, 24 * MiB, dtype=np.uint8)
    dst = np.zeros_like(src)
    plan = byte_plan(src, dst, [(0, 0, src.size)])
    copy_plan(plan, 4)
    after_first = native_threads()
    for _ in range(30):
        copy_plan(plan, 4)
    assert native_threads() == after_first  # no thread is created per call
    np.testing.assert_array_equal(dst, src)


def test_a_range_of_a_plan_copies_only_those_descriptors() -> None:
    src = np.arange(64, dtype=np.uint8)
    dst = np.zeros(64, np.uint8)
    plan = byte_plan(src, dst, [(0, 0, 8), (8, 8, 8), (16, 16, 8), (24, 24, 8)])
    copy_plan(plan, 1, 1, 3)
    assert not dst[:8].any() and not dst[24:].any()
    np.testing.assert_array_equal(dst[8:24], src[8:24])


def test_a_range_outside_the_plan_is_an_error_naming_it() -> None:
    src, dst = np.ones(8, np.uint8), np.zeros(8, np.uint8)
    with pytest.raises(ValueError, match=r"range \[0, 2\) is outside the plan's 1 descriptors"):
        copy_plan(byte_plan(src, dst, [(0, 0, 8)]), 1, 0, 2)


def test_copies_from_two_streams_at_once_are_byte_exact() -> None:
    rng = np.random.default_rng(1)
    srcs = [rng.integers(0, 255, 12 * MiB, dtype=np.uint8) for _ in range(2)]
    dsts = [np.zeros_like(s) for s in srcs]
    plans = [byte_plan(s, d, [(0, 0, s.size)]) for s, d in zip(srcs, dsts)]
    threads = [threading.Thread(target=lambda p=p: [copy_plan(p, 2) for _ in range(5)]) for p in plans]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for s, d in zip(srcs, dsts):
        np.testing.assert_array_equal(d, s)


def test_execute_parts_is_one_task_whose_layer_events_complete_in_order() -> None:
    backend = CpuBackend(copy_threads=1)
    stream = backend.new_stream()
    gate = threading.Event()
    stream.submit(lambda: None if gate.wait(30) else None)
    src = np.arange(48, dtype=np.uint8)
    dst = np.zeros(48, np.uint8)
    plan = byte_plan(src, dst, [(0, 0, 16), (16, 16, 16), (32, 32, 16)])
    events = backend.execute_parts(plan, [0, 1, 1, 3], stream, direction="h2d")  # the middle layer is empty
    assert len(events) == 3 and not any(e.query() for e in events)
    gate.set()
    events[0].synchronize()
    events[2].synchronize()
    assert all(e.query() for e in events)
    np.testing.assert_array_equal(dst, src)


def test_execute_parts_on_the_host_stream_runs_each_part_now() -> None:
    backend = CpuBackend(copy_threads=1)
    src, dst = np.arange(32, dtype=np.uint8), np.zeros(32, np.uint8)
    plan = byte_plan(src, dst, [(0, 0, 16), (16, 16, 16)])
    events = backend.execute_parts(plan, [0, 1, 2], backend.current_stream())
    assert all(e.query() for e in events)
    np.testing.assert_array_equal(dst, src)


def test_execute_parts_rejects_bounds_past_the_plan() -> None:
    backend = CpuBackend(copy_threads=1)
    src, dst = np.ones(8, np.uint8), np.zeros(8, np.uint8)
    with pytest.raises(PlanError, match=r"bounds run 0\.\.2, the plan has 1 descriptors"):
        backend.execute_parts(byte_plan(src, dst, [(0, 0, 8)]), [0, 2], backend.new_stream())


def test_a_failed_part_poisons_the_stream_and_later_events_never_complete() -> None:
    backend = CpuBackend(copy_threads=1)
    stream = backend.new_stream()
    src, dst = np.arange(16, dtype=np.uint8), np.zeros(16, np.uint8)
    plan = byte_plan(src, dst, [(0, 0, 8), (8, 8, 8)])
    calls: list[int] = []

    def step(a: int, b: int) -> None:
        calls.append(a)
        if a == 1:
            raise OSError("disk on fire")

    events = stream.submit_parts(step, [0, 1, 2])
    from kvplane.errors import BackendError

    with pytest.raises(BackendError, match="disk on fire"):
        events[1].synchronize()
    assert events[0].query() and not events[1].query()
    assert calls == [0, 1]
    del plan


@pytest.mark.parametrize("threads", [1, 3])
def test_scattered_descriptors_of_mixed_sizes_and_alignments_are_byte_exact(threads: int) -> None:
    """The copy prefetches ahead across descriptor ends and stops at its slice's end: every size around a cache
    line, a page and the prefetch distance, odd addresses, shuffled, over the parallel threshold."""
    rng = np.random.default_rng(7)
    sizes = [1, 63, 64, 65, 4095, 4096, 4097, 16 << 10, (16 << 10) + 3, 18 << 10, 100_003, 3 * MiB + 5]
    lengths = [sizes[i % len(sizes)] for i in range(260)]
    total = sum(lengths)
    assert total > 8 * MiB  # split over the pool when threads > 1
    src = rng.integers(0, 255, total + 4096, dtype=np.uint8)
    dst = np.zeros(total + 4096, np.uint8)
    src_at = np.cumsum([0, *lengths[:-1]]) + 3  # odd starts
    order = rng.permutation(len(lengths))  # the destination order is a shuffle of the source order
    dst_at = np.empty(len(lengths), np.int64)
    dst_at[order] = np.cumsum([0, *[lengths[i] for i in order[:-1]]]) + 5
    copy_plan(byte_plan(src, dst, list(zip(src_at.tolist(), dst_at.tolist(), lengths))), threads)
    expected = np.zeros_like(dst)
    for a, b, n in zip(src_at, dst_at, lengths):
        expected[b : b + n] = src[a : a + n]
    np.testing.assert_array_equal(dst, expected)
