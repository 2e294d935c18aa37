"""Copy bandwidth of scattered KV blocks against a contiguous ``copy_`` of the same bytes: reported, never asserted.

The cache has the Qwen3-0.6B shape in the backend's own layout, twice the moved blocks, and the moved blocks
are a random subset on both sides, as a real block table is. Both copies alternate in one process.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvplane.backend.base import Backend, Direction
from kvplane.bench.timing import alternate
from kvplane.conformance.helpers import cache_in, fill_random, memories, mismatches, plan_between, random_ids
from kvplane.conformance.report import BandwidthResult, ConformanceReport
from kvplane.kv.spec import KVSpec

REPS = 3


@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_copy_bandwidth_is_reported_against_a_contiguous_copy(
    kvplane_backend: Backend, kvplane_report: ConformanceReport, kvplane_bandwidth_bytes: int, direction: Direction
) -> None:
    spec = KVSpec.gqa(28, 8, 128, tokens_per_block=16)  # Qwen3-0.6B: 114,688 B per token
    layout = type(kvplane_backend).layouts["gqa"]
    blocks = max(1, kvplane_bandwidth_bytes // (spec.bytes_per_token * 16))
    src_memory, dst_memory = memories(direction)
    src = cache_in(kvplane_backend, src_memory, spec, layout, 2 * blocks)
    dst = cache_in(kvplane_backend, dst_memory, spec, layout, 2 * blocks)
    fill_random(kvplane_backend, spec, src, layout, seed=5)
    rng = np.random.default_rng(5)
    src_ids, dst_ids = random_ids(rng, 2 * blocks, blocks), random_ids(rng, 2 * blocks, blocks)
    plan = plan_between(spec, layout, src, src_ids, dst, dst_ids)
    stream, done = kvplane_backend.new_stream(), kvplane_backend.new_event()
    alloc = {"device": kvplane_backend.alloc_device, "host": kvplane_backend.alloc_host}
    flat_src, flat_dst = alloc[src_memory](plan.total_bytes), alloc[dst_memory](plan.total_bytes)

    def scattered() -> None:
        kvplane_backend.execute(plan, stream, direction=direction)
        done.record(stream)
        done.synchronize()

    def contiguous() -> None:
        flat_dst.copy_(flat_src, non_blocking=True)
        kvplane_backend.synchronize()

    scattered()
    assert mismatches(spec, layout, src, src_ids, dst, dst_ids) == []
    seconds, baseline = alternate(scattered, contiguous, REPS)
    result = BandwidthResult(direction, plan.total_bytes, len(plan), plan.total_bytes / seconds / 1e9,
                             plan.total_bytes / baseline / 1e9)
    kvplane_report.bandwidth.append(result)
    print(f"{kvplane_backend.label} {direction}: {result.gbps:.2f} GB/s scattered vs {result.baseline_gbps:.2f} "
          f"GB/s contiguous copy_ (ratio {result.ratio:.2f}, {len(plan)} descriptors)")
