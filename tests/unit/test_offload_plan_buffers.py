"""Plan memory reused across requests (``PlanBuffers``): a plan's array is handed to a later plan only once the
engine gave it back after its copies completed, so a copy still held on its stream never sees another request's
descriptors, and stores and loads one after another land byte for byte."""

from __future__ import annotations

import numpy as np
import pytest
from offload_fakes import GatedCpu, Harness, small_spec

import kvplane.flows.offload.layer_plans as layer_plans
from kvplane.blocks import block_hashes
from kvplane.descriptors import CopyPlan
from kvplane.flows.offload.layer_plans import PlanBuffers

needs_native = pytest.mark.skipif(layer_plans._native is None, reason="the C extension is not built")


def plan_over(out: np.ndarray, count: int) -> CopyPlan:
    out[:, :count] = 1
    return CopyPlan(out[0, :count], out[1, :count], out[2, :count])


def test_a_given_back_array_is_reused_once_and_foreign_or_repeated_plans_are_not_kept() -> None:
    buffers = PlanBuffers(keep=2)
    first = buffers.take(10)
    assert first.shape == (3, 10)
    plan = plan_over(first, 7)
    buffers.give_back(plan)
    buffers.give_back(plan)  # twice: kept once, or two later plans would share one array
    assert buffers.take(8) is first
    assert buffers.take(8) is not first
    buffers.give_back(CopyPlan(np.ones(4, np.int64), np.ones(4, np.int64), np.ones(4, np.int64)))
    assert buffers.take(4) is not first
    buffers.give_back(plan)
    assert buffers.take(11) is not first  # too narrow for 11 descriptors: a new array
    assert buffers.take(10) is first


def test_spare_arrays_are_bounded_in_count_and_bytes() -> None:
    buffers = PlanBuffers(keep=1, max_bytes=3 * 8 * 100)
    a, b, big = buffers.take(10), buffers.take(10), buffers.take(200)
    for out in (a, b, big):
        buffers.give_back(plan_over(out, 5))
    assert buffers.take(1) is a
    assert buffers.take(1) is not b


@needs_native
def test_a_plan_whose_copy_is_still_held_is_not_reused_and_both_stores_land_byte_exactly() -> None:
    backend = GatedCpu()
    h = Harness(small_spec(layers=2), host_blocks=8, backend=backend)
    first, second = block_hashes(list(range(4)), 2), block_hashes(list(range(100, 104)), 2)
    for blk, x in zip([1, 2, 3, 4], [*first, *second]):
        h.write(blk, x)
    backend.calls = 0
    gate = backend.gate(0)  # the first store's copy waits on its stream
    h.engine.start_store("a", first, [1, 2])
    for name in h.spec.layer_names:
        h.engine.save_layer(name)
    h.engine.start_store("b", second, [3, 4])
    plan_a, plan_b = h.engine._saving["a"].plans[0][0], h.engine._open["b"].plans[0][0]
    assert plan_a.src.base is not plan_b.src.base
    gate.set()
    for name in h.spec.layer_names:
        h.engine.save_layer(name)
    h.engine.wait_for_save()
    assert h.engine.get_finished()[0] == {"a", "b"}
    h.zero([1, 2, 3, 4])
    assert h.load("la", first, [10, 11]) == 4
    assert h.load("lb", second, [12, 13]) == 4
    assert all(h.holds(d, x) for d, x in zip([10, 11, 12, 13], [*first, *second]))


@needs_native
def test_requests_one_after_another_reuse_plan_memory_and_round_trip() -> None:
    h = Harness(small_spec(layers=3), host_blocks=4)
    seen = set()
    for r in range(6):
        hashes = block_hashes(list(range(r * 10, r * 10 + 4)), 2)
        device, target = [1 + 2 * (r % 3), 2 + 2 * (r % 3)], [20 + r, 30 + r]
        for blk, x in zip(device, hashes):
            h.write(blk, x)
        h.store(f"s{r}", hashes, device)
        plans = h.engine.copier._buffers._spare
        seen.update(id(p) for p in plans)
        assert h.load(f"l{r}", hashes, target) == 4
        assert all(h.holds(d, x) for d, x in zip(target, hashes))
        assert h.engine.host_blocks_in_use() == 0
    assert len(seen) <= 2  # one array for the stores' plans and one for the loads', handed round
