"""Plans for every layout kvplane knows, with random block ids, D2H, H2D and D2D: bytes compared with torch.

Each plan copies random blocks of a cache with random bytes into random blocks of a zeroed cache; the moved
blocks must equal the source blocks (torch indexing is the reference) and no other block may change.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvplane.backend.base import Backend, Direction
from kvplane.conformance.helpers import (
    DESTINATION_BLOCKS,
    MOVED_BLOCKS,
    SOURCE_BLOCKS,
    cache_in,
    fill_random,
    memories,
    mismatches,
    plan_between,
    random_ids,
    spec_for,
)
from kvplane.kv.layouts import LAYOUTS

DIRECTIONS: list[Direction] = ["d2h", "h2d", "d2d"]


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_plan_moves_exactly_the_planned_blocks(kvplane_backend: Backend, layout: str, direction: Direction) -> None:
    seed = sorted(LAYOUTS).index(layout) * 10 + DIRECTIONS.index(direction)
    rng = np.random.default_rng(seed)
    spec = spec_for(layout)
    src_memory, dst_memory = memories(direction)
    src = cache_in(kvplane_backend, src_memory, spec, layout, SOURCE_BLOCKS)
    dst = cache_in(kvplane_backend, dst_memory, spec, layout, DESTINATION_BLOCKS)
    fill_random(kvplane_backend, spec, src, layout, seed)
    src_ids, dst_ids = random_ids(rng, SOURCE_BLOCKS, MOVED_BLOCKS), random_ids(rng, DESTINATION_BLOCKS, MOVED_BLOCKS)
    plan = plan_between(spec, layout, src, src_ids, dst, dst_ids)
    stream, done = kvplane_backend.new_stream(), kvplane_backend.new_event()
    kvplane_backend.execute(plan, stream, direction=direction)
    done.record(stream)
    done.synchronize()
    assert mismatches(spec, layout, src, src_ids, dst, dst_ids) == []


@pytest.mark.parametrize("direction", ["d2h", "h2d"])
@pytest.mark.parametrize("family", ["gqa", "mla"])
def test_every_copy_route_moves_exactly_the_planned_blocks(
    kvplane_backend: Backend, family: str, direction: Direction
) -> None:
    """Each route the backend offers (``AcceleratorBackend.routes()``: the copy function, its per-descriptor
    loop, the copy kernel staged and direct), forced in turn over this backend's own layout of the family; a
    backend without routes runs its one path."""
    routes = [r for r in getattr(kvplane_backend, "routes", lambda: ("auto",))() if r != "auto"] or ["auto"]
    layout = kvplane_backend.layouts[family]
    spec = spec_for(layout)
    src_memory, dst_memory = memories(direction)
    src = cache_in(kvplane_backend, src_memory, spec, layout, SOURCE_BLOCKS)
    bad: dict[str, list[str]] = {}
    for i, route in enumerate(routes):
        seed = 100 + 10 * i + (direction == "h2d")
        rng = np.random.default_rng(seed)
        dst = cache_in(kvplane_backend, dst_memory, spec, layout, DESTINATION_BLOCKS)
        fill_random(kvplane_backend, spec, src, layout, seed)
        src_ids = random_ids(rng, SOURCE_BLOCKS, MOVED_BLOCKS)
        dst_ids = random_ids(rng, DESTINATION_BLOCKS, MOVED_BLOCKS)
        plan = plan_between(spec, layout, src, src_ids, dst, dst_ids)
        stream, done = kvplane_backend.new_stream(), kvplane_backend.new_event()
        if route == "auto":
            kvplane_backend.execute(plan, stream, direction=direction)
        else:
            kvplane_backend.execute_route(plan, stream, direction=direction, route=route)  # type: ignore[attr-defined]
        done.record(stream)
        done.synchronize()
        bad[route] = mismatches(spec, layout, src, src_ids, dst, dst_ids)
    assert {r: m for r, m in bad.items() if m} == {}, f"routes run: {routes}"
