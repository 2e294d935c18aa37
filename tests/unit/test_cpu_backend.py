"""The built-in cpu backend: plans executed byte-exactly, ordered worker streams, events, failures, spans.

Streams are exercised without timing: a gate task (a ``threading.Event`` the test releases) holds a stream
at a known point, so "not done yet" is a certainty, not a race.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from kvplane.backend import get_backend
from kvplane.backend.cpu.backend import CpuBackend
from kvplane.backend.cpu.memcpy import PARALLEL_MIN_BYTES
from kvplane.backend.cpu.streams import CpuEvent, HostStream, WorkerStream
from kvplane.descriptors import CopyPlan, Region, SlotPart
from kvplane.errors import BackendError, PlanError
from kvplane.kv.binding import allocate_cache, regions_from_tensors
from kvplane.kv.spec import KVSpec
from kvplane.plan import block_copy_plan

I64 = np.int64
NB_SRC, NB_DST, BS = 10, 8, 4
BLOCK_DIM = {"packed_kv": 0, "kv_first": 1, "block_kv": 0, "split_kv": 0, "mla_fused": 0, "mla_split": 0}


@pytest.fixture(scope="module")
def backend() -> CpuBackend:
    b = get_backend("cpu")
    assert isinstance(b, CpuBackend)
    return b


@pytest.fixture
def gate() -> Iterator[threading.Event]:
    """Released at teardown whatever happens, so no worker thread stays blocked."""
    event = threading.Event()
    yield event
    event.set()


def parts(value: object) -> tuple[torch.Tensor, ...]:
    return (value,) if isinstance(value, torch.Tensor) else tuple(value)  # type: ignore[arg-type]


def spec_for(layout: str) -> KVSpec:
    if layout.startswith("mla"):
        return KVSpec.mla(2, kv_lora_rank=16, rope_dim=8, tokens_per_block=BS)
    return KVSpec.gqa(2, 2, 8, tokens_per_block=BS)


def random_cache(spec: KVSpec, layout: str, nb: int) -> dict[str, object]:
    cache = allocate_cache(spec, layout, nb)
    for value in cache.values():
        for t in parts(value):
            t.copy_(torch.randn(t.shape))
    return cache


def as_bytes(cache: dict[str, object]) -> list[torch.Tensor]:
    return [t.view(torch.uint8).clone() for v in cache.values() for t in parts(v)]


def torch_copy(
    layout: str, src: dict, dst: dict, src_ids: np.ndarray, dst_ids: np.ndarray
) -> list[torch.Tensor]:
    """``dst[dst_ids] = src[src_ids]`` along the block dim, on clones: what the plan must produce."""
    dim = BLOCK_DIM[layout]
    out = []
    for name in dst:
        for s, d in zip(parts(src[name]), parts(dst[name])):
            want = d.clone()
            want.index_copy_(dim, torch.from_numpy(dst_ids), s.index_select(dim, torch.from_numpy(src_ids)))
            out.append(want.view(torch.uint8))
    return out


def setup_copy(layout: str, rng: np.random.Generator, n: int = 6):
    spec = spec_for(layout)
    src, dst = random_cache(spec, layout, NB_SRC), random_cache(spec, layout, NB_DST)
    src_ids = rng.integers(0, NB_SRC, size=n)
    dst_ids = rng.permutation(NB_DST)[:n]
    p = block_copy_plan(
        regions_from_tensors(spec, src, layout), src_ids, regions_from_tensors(spec, dst, layout), dst_ids
    )
    return src, dst, p, torch_copy(layout, src, dst, src_ids, dst_ids)


def assert_cache_equals(cache: dict, expected: list[torch.Tensor]) -> None:
    got = [t.view(torch.uint8) for v in cache.values() for t in parts(v)]
    assert len(got) == len(expected)
    for g, w in zip(got, expected):
        assert torch.equal(g, w)


def byte_plan(src: np.ndarray, dst: np.ndarray, descs: list[tuple[int, int, int]]) -> CopyPlan:
    s, d, n = (np.array(c, dtype=I64) for c in zip(*descs))
    return CopyPlan(s + src.ctypes.data, d + dst.ctypes.data, n)


def reference(src: np.ndarray, dst: np.ndarray, descs: list[tuple[int, int, int]]) -> np.ndarray:
    out = dst.copy()
    for s, d, n in descs:
        out[d : d + n] = src[s : s + n]
    return out


# -- device facts --------------------------------------------------------------------------------------------
def test_get_backend_cpu_gives_the_cpu_backend_with_its_device_facts(backend: CpuBackend) -> None:
    assert backend.name == "cpu" and backend.label == "cpu"
    assert backend.torch_device_type == "cpu" and backend.device() == torch.device("cpu")
    assert backend.is_accelerator is False
    assert backend.collective_backend == "gloo"
    assert backend.mooncake_protocol == "tcp" and backend.mooncake_location() == "cpu:0"
    assert backend.nixl_memory_type == "DRAM"
    assert CpuBackend.probe().available
    assert set(backend.layouts) == {"gqa", "mla", "index"}


# -- executing plans -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", sorted(BLOCK_DIM))
def test_scattered_blocks_copied_now_equal_torch_indexing(
    backend: CpuBackend, layout: str, rng: np.random.Generator
) -> None:
    _, dst, p, expected = setup_copy(layout, rng)
    backend.execute(p)
    assert_cache_equals(dst, expected)


def test_work_on_the_current_host_stream_is_done_on_return(
    backend: CpuBackend, rng: np.random.Generator
) -> None:
    _, dst, p, expected = setup_copy("packed_kv", rng)
    stream = backend.current_stream()
    backend.execute(p, stream)
    assert stream.query()
    assert_cache_equals(dst, expected)


@pytest.mark.parametrize("layout", ["packed_kv", "mla_split"])
def test_a_plan_on_a_worker_stream_is_done_once_an_event_after_it_completes(
    backend: CpuBackend, layout: str, rng: np.random.Generator
) -> None:
    _, dst, p, expected = setup_copy(layout, rng)
    stream = backend.new_stream()
    backend.execute(p, stream)
    event = backend.new_event()
    event.record(stream)
    event.synchronize()
    assert event.query()
    assert_cache_equals(dst, expected)
    stream.synchronize()
    assert stream.query()


def test_two_plans_on_one_stream_writing_the_same_blocks_leave_the_later_ones_bytes(
    backend: CpuBackend, gate: threading.Event, rng: np.random.Generator
) -> None:
    spec = spec_for("packed_kv")
    first, second = random_cache(spec, "packed_kv", NB_SRC), random_cache(spec, "packed_kv", NB_SRC)
    dst = random_cache(spec, "packed_kv", NB_DST)
    dst_regions = regions_from_tensors(spec, dst, "packed_kv")
    src_ids, dst_ids = rng.integers(0, NB_SRC, 5), rng.permutation(NB_DST)[:5]
    stream = backend.new_stream()
    stream.submit(gate.wait)  # hold the stream so both plans are queued before either runs
    for src in (first, second):
        backend.execute(
            block_copy_plan(regions_from_tensors(spec, src, "packed_kv"), src_ids, dst_regions, dst_ids),
            stream,
        )
    expected = torch_copy("packed_kv", second, dst, src_ids, dst_ids)
    gate.set()
    stream.synchronize()
    assert_cache_equals(dst, expected)


def test_an_event_is_pending_until_the_work_before_it_ran(
    backend: CpuBackend, gate: threading.Event, rng: np.random.Generator
) -> None:
    _, dst, p, expected = setup_copy("split_kv", rng)
    before = as_bytes(dst)
    stream = backend.new_stream()
    event = backend.new_event()
    assert event.query()  # never recorded: complete, as with torch.Event
    stream.submit(gate.wait)
    backend.execute(p, stream)
    event.record(stream)
    assert not event.query() and not stream.query()
    assert all(torch.equal(a, b) for a, b in zip(as_bytes(dst), before))  # nothing copied yet
    gate.set()
    event.synchronize()
    assert event.query()
    assert_cache_equals(dst, expected)


def test_an_event_recorded_on_the_host_stream_or_nothing_is_complete(backend: CpuBackend) -> None:
    for stream in (None, backend.current_stream()):
        event = backend.new_event()
        event.record(stream)
        assert event.query()
        event.synchronize()


def test_a_stream_waiting_on_an_event_runs_its_work_after_the_events_stream(
    backend: CpuBackend, gate: threading.Event
) -> None:
    src = np.arange(4096, dtype=np.uint8) % 251
    mid, dst = np.zeros_like(src), np.zeros_like(src)
    producer, consumer = backend.new_stream(), backend.new_stream()
    producer.submit(gate.wait)
    backend.execute(byte_plan(src, mid, [(0, 0, 4096)]), producer)
    ready = backend.new_event()
    ready.record(producer)
    consumer.wait_event(ready)
    backend.execute(
        CopyPlan(np.array([mid.ctypes.data], I64), np.array([dst.ctypes.data], I64), np.array([4096], I64)),
        consumer,
    )
    gate.set()
    consumer.synchronize()
    np.testing.assert_array_equal(dst, src)


def test_an_empty_plan_is_a_no_op_on_any_stream(backend: CpuBackend) -> None:
    stream = backend.new_stream()
    backend.execute(CopyPlan.empty(), stream)
    backend.execute(CopyPlan.empty())
    stream.synchronize()
    assert stream.query()


def test_execute_rejects_what_is_not_a_plan(backend: CpuBackend) -> None:
    with pytest.raises(PlanError, match=r"execute\(\) takes a CopyPlan, got tuple"):
        backend.execute((np.zeros(1, I64), np.zeros(1, I64), np.ones(1, I64)))  # type: ignore[arg-type]


def test_execute_on_a_stream_of_another_kind_raises_naming_it(backend: CpuBackend) -> None:
    class ForeignStream:
        pass

    src, dst = np.ones(8, np.uint8), np.zeros(8, np.uint8)
    with pytest.raises(BackendError, match=r"cannot run work on ForeignStream"):
        backend.execute(byte_plan(src, dst, [(0, 0, 8)]), ForeignStream())  # type: ignore[arg-type]
    assert not dst.any()


def test_an_event_cannot_be_recorded_on_a_stream_of_another_kind() -> None:
    with pytest.raises(BackendError, match=r"cannot be recorded on str"):
        CpuEvent().record("cuda:0")


def test_a_plan_built_from_column_views_of_one_table_executes(backend: CpuBackend) -> None:
    # (src, dst, length) rows in one (n, 3) table are a natural way to build a plan; its columns are
    # 1-D int64 arrays, which CopyPlan accepts, but they are strided views.
    src, dst = np.arange(64, dtype=np.uint8), np.zeros(64, np.uint8)
    table = np.array(
        [[src.ctypes.data, dst.ctypes.data, 8], [src.ctypes.data + 16, dst.ctypes.data + 32, 8]], I64
    )
    backend.execute(CopyPlan(table[:, 0], table[:, 1], table[:, 2]))
    np.testing.assert_array_equal(dst, reference(src, np.zeros(64, np.uint8), [(0, 0, 8), (16, 32, 8)]))


# -- large plans split over threads --------------------------------------------------------------------------
MiB = 1 << 20


@pytest.fixture(scope="module")
def big_src() -> np.ndarray:
    return np.random.default_rng(7).integers(0, 256, 13 * MiB + 12345, dtype=np.uint8)


@pytest.mark.parametrize("threads", [2, 3, 8])
def test_a_large_scattered_plan_split_over_threads_is_byte_exact(big_src: np.ndarray, threads: int) -> None:
    rng = np.random.default_rng(threads)
    size = big_src.size
    # one descriptor larger than any thread's slice, then 4099-byte chunks in shuffled order
    big = 7 * MiB + 3
    chunks = (size - big) // 4099
    order = rng.permutation(chunks)
    descs = [(0, size - big, big)] + [(big + 4099 * int(i), 4099 * j, 4099) for j, i in enumerate(order)]
    total = sum(n for _, _, n in descs)
    assert total > PARALLEL_MIN_BYTES and big > total // threads
    dst = np.zeros(size, np.uint8)
    want = reference(big_src, dst, descs)
    CpuBackend(copy_threads=threads).execute(byte_plan(big_src, dst, descs))
    np.testing.assert_array_equal(dst, want)


def test_a_single_descriptor_above_the_parallel_threshold_is_byte_exact(big_src: np.ndarray) -> None:
    n = 9 * MiB + 7
    dst = np.zeros(n + 13, np.uint8)
    CpuBackend(copy_threads=4).execute(byte_plan(big_src, dst, [(5, 13, n)]))
    assert not dst[:13].any()
    np.testing.assert_array_equal(dst[13:], big_src[5 : 5 + n])


def test_a_large_plan_on_a_worker_stream_is_byte_exact(backend: CpuBackend, big_src: np.ndarray) -> None:
    descs = [(MiB * i, MiB * (12 - i), MiB) for i in range(13)]
    dst = np.zeros(13 * MiB, np.uint8)
    stream = backend.new_stream()
    backend.execute(byte_plan(big_src, dst, descs), stream)
    stream.synchronize()
    np.testing.assert_array_equal(dst, reference(big_src, np.zeros(13 * MiB, np.uint8), descs))


# -- failures ------------------------------------------------------------------------------------------------
def test_a_failing_task_poisons_its_stream_and_synchronize_raises_backend_error(backend: CpuBackend) -> None:
    src, dst = np.ones(64, np.uint8), np.zeros(64, np.uint8)
    stream = backend.new_stream()

    def boom() -> None:
        raise RuntimeError("disk on fire")

    stream.submit(boom)
    backend.execute(byte_plan(src, dst, [(0, 0, 64)]), stream)  # queued after the failure: must not run
    with pytest.raises(
        BackendError, match=r"a task on this cpu stream failed: RuntimeError\('disk on fire'\)"
    ) as info:
        stream.synchronize()
    assert isinstance(info.value.__cause__, RuntimeError)
    assert not dst.any()
    assert stream.query()  # nothing left queued: it fails, it does not hang
    with pytest.raises(BackendError, match="disk on fire"):
        stream.synchronize()  # and it stays poisoned


def test_an_event_after_a_failed_task_raises_instead_of_hanging(backend: CpuBackend) -> None:
    stream = backend.new_stream()
    stream.submit(lambda: 1 / 0)
    event = backend.new_event()
    event.record(stream)
    with pytest.raises(BackendError, match="ZeroDivisionError"):
        event.synchronize()
    assert not event.query()


def test_streams_fail_independently(backend: CpuBackend) -> None:
    bad, good = backend.new_stream(), backend.new_stream()
    bad.submit(lambda: 1 / 0)
    src, dst = np.ones(16, np.uint8), np.zeros(16, np.uint8)
    backend.execute(byte_plan(src, dst, [(0, 0, 16)]), good)
    good.synchronize()
    assert dst.all()
    with pytest.raises(BackendError):
        bad.synchronize()


# -- host memory ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("nbytes", [0, -1])
def test_alloc_host_of_no_bytes_raises_naming_the_size(backend: CpuBackend, nbytes: int) -> None:
    with pytest.raises(BackendError, match=rf"alloc_host: nbytes={nbytes} must be > 0"):
        backend.alloc_host(nbytes)


@pytest.mark.parametrize("nbytes", [0, -5])
def test_alloc_device_of_no_bytes_raises_naming_the_size(backend: CpuBackend, nbytes: int) -> None:
    with pytest.raises(BackendError, match=rf"alloc_device: nbytes={nbytes} must be > 0"):
        backend.alloc_device(nbytes)


def test_alloc_host_gives_a_writable_uint8_tensor_of_that_size(backend: CpuBackend) -> None:
    buf = backend.alloc_host(1000)
    assert buf.dtype == torch.uint8 and buf.shape == (1000,) and buf.device.type == "cpu"
    buf.fill_(3)
    assert int(buf.sum()) == 3000
    assert backend.alloc_host(10, pinned=False).numel() == 10


def test_alloc_host_can_back_a_whole_kv_cache(backend: CpuBackend, rng: np.random.Generator) -> None:
    spec = spec_for("packed_kv")
    src = random_cache(spec, "packed_kv", NB_SRC)
    host = allocate_cache(spec, "packed_kv", NB_SRC, alloc=backend.alloc_host)
    ids = rng.permutation(NB_SRC)
    backend.execute(
        block_copy_plan(
            regions_from_tensors(spec, src, "packed_kv"),
            ids,
            regions_from_tensors(spec, host, "packed_kv"),
            ids,
        )
    )
    assert_cache_equals(host, as_bytes(src))


# -- registration spans --------------------------------------------------------------------------------------
def region(addr: int, num_blocks: int = 4, block_bytes: int = 100, stride: int | None = None) -> Region:
    return Region(
        0, 0, "layers.0", addr, num_blocks, stride or block_bytes, block_bytes, BS, 1, block_bytes // BS,
        (SlotPart("k", 0, block_bytes // BS),),
    )


def test_registration_spans_merge_adjacent_regions(backend: CpuBackend) -> None:
    assert backend.registration_spans([region(1000), region(1400), region(2000)]) == [
        (1000, 800),
        (2000, 400),
    ]


def test_registration_spans_sort_and_merge_overlapping_regions(backend: CpuBackend) -> None:
    spans = backend.registration_spans([region(5000), region(1000, stride=200), region(1100, stride=200)])
    assert spans == [(1000, 800), (5000, 400)]


def test_registration_spans_of_no_regions_are_empty(backend: CpuBackend) -> None:
    assert backend.registration_spans([]) == []


def test_a_packed_kv_cache_carved_from_one_buffer_registers_as_one_span(backend: CpuBackend) -> None:
    spec = spec_for("packed_kv")
    held: list[torch.Tensor] = []

    def alloc(n: int) -> torch.Tensor:
        held.append(backend.alloc_host(n))
        return held[-1]

    regions = regions_from_tensors(spec, allocate_cache(spec, "packed_kv", NB_SRC, alloc=alloc), "packed_kv")
    assert len(regions) == 2  # one per layer: K and V share each row
    assert backend.registration_spans(regions) == [(held[0].data_ptr(), held[0].numel())]


def test_a_kv_first_tensor_registers_k_and_v_as_one_span(backend: CpuBackend) -> None:
    spec = spec_for("kv_first")
    t = torch.zeros(2, NB_SRC, BS, 2, 8, dtype=torch.bfloat16)
    other = torch.zeros(2, NB_SRC, BS, 2, 8, dtype=torch.bfloat16)
    regions = regions_from_tensors(spec, {"layers.0": t, "layers.1": other}, "kv_first")
    spans = backend.registration_spans(regions[:2])
    assert spans == [(t.data_ptr(), t.numel() * t.element_size())]


class AlignedBackend(CpuBackend):
    registration_alignment = 256
    registration_merge_gap = 64
    max_registered_regions = 2


def test_registration_spans_widen_to_the_alignment_and_merge_within_the_gap() -> None:
    b = AlignedBackend()
    # [1000, 1400) -> [768, 1536); [1600, 1700) -> [1536, 1792): touching, merged
    assert b.registration_spans([region(1000), region(1600, num_blocks=1)]) == [(768, 1024)]
    # a gap of 256 > 64 stays apart
    assert b.registration_spans([region(0, 1, 256), region(512, 1, 256)]) == [(0, 256), (512, 256)]
    assert all(s % 256 == 0 and n % 256 == 0 for s, n in b.registration_spans([region(1000), region(9000)]))


def test_more_spans_than_the_device_allows_raise_naming_the_limit() -> None:
    regions = [region(10_000 * i, 1, 256) for i in range(3)]
    with pytest.raises(BackendError, match=r"cpu: 3 memory regions to register, the device allows 2"):
        AlignedBackend().registration_spans(regions)


def test_host_stream_runs_submitted_work_immediately() -> None:
    ran: list[int] = []
    HostStream().submit(lambda: ran.append(1))
    assert ran == [1]


def test_a_worker_stream_runs_tasks_in_submission_order(gate: threading.Event) -> None:
    stream = WorkerStream()
    seen: list[int] = []
    stream.submit(gate.wait)
    for i in range(50):
        stream.submit(lambda i=i: seen.append(i))
    assert seen == []
    gate.set()
    stream.synchronize()
    assert seen == list(range(50))


def test_a_closed_stream_finishes_its_queue_stops_its_thread_and_refuses_more_work() -> None:
    from kvplane.backend.cpu.streams import WorkerStream
    from kvplane.errors import BackendError

    stream = WorkerStream()
    ran: list[int] = []
    for i in range(3):
        stream.submit(lambda i=i: ran.append(i))
    stream.close()
    assert ran == [0, 1, 2]
    assert not stream.alive
    with pytest.raises(BackendError, match="closed"):
        stream.submit(lambda: None)
    stream.close()  # closing twice is harmless


def test_a_worker_stream_dropped_without_close_runs_its_queue_and_ends_its_thread() -> None:
    import gc

    from kvplane.backend.cpu.streams import WorkerStream

    name = "test-dropped-stream"  # its own thread, told apart from other tests' threads ending meanwhile

    def alive() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == name]

    stream = WorkerStream(name)
    ran: list[int] = []
    for i in range(3):
        stream.submit(lambda i=i: ran.append(i))
    stream.synchronize()
    assert alive()
    del stream  # an offload engine's copy streams are never closed: each one used to keep a thread for good
    gc.collect()
    for _ in range(200):
        if not alive():
            break
        threading.Event().wait(0.01)
    assert ran == [0, 1, 2]
    assert not alive()
