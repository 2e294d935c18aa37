"""Registration spans of real device caches fit the backend's alignment and region limit, and cover them."""

from __future__ import annotations

import itertools

import pytest

from kvplane.backend.base import Backend
from kvplane.conformance.helpers import SOURCE_BLOCKS, spec_for
from kvplane.descriptors import Region, SlotPart
from kvplane.errors import BackendError
from kvplane.kv.binding import allocate_cache, regions_from_tensors


@pytest.mark.parametrize("family", ["gqa", "mla"])
def test_spans_of_a_device_cache_are_aligned_disjoint_within_the_limit_and_cover_it(
    kvplane_backend: Backend, family: str
) -> None:
    layout = type(kvplane_backend).layouts[family]
    spec = spec_for(layout)
    # every layer its own allocation, as engines allocate them: regions are scattered over device memory
    cache = allocate_cache(spec, layout, SOURCE_BLOCKS, device=kvplane_backend.device())
    regions = regions_from_tensors(spec, cache, layout)
    spans = kvplane_backend.registration_spans(regions)
    align, limit = kvplane_backend.registration_alignment, kvplane_backend.max_registered_regions
    assert all(start % align == 0 and length % align == 0 and length > 0 for start, length in spans)
    assert limit is None or len(spans) <= limit
    assert all(a[0] + a[1] <= b[0] for a, b in itertools.pairwise(spans)), "spans must be sorted and disjoint"
    for r in regions:
        assert any(s <= r.addr and r.end <= s + n for s, n in spans), f"{r.layer_name}/{r.slot} is not covered"


def test_more_separate_regions_than_the_device_allows_is_an_error_naming_the_limit(kvplane_backend: Backend) -> None:
    limit = kvplane_backend.max_registered_regions
    step = 4 * kvplane_backend.registration_alignment + kvplane_backend.registration_merge_gap + 4096
    count = limit + 1 if limit is not None else 4096
    regions = [Region(0, i, f"layers.{i}", 0x10_0000_0000 + i * step, 1, 4096, 4096, 16, 1, 256,
                      (SlotPart("k", 0, 256),)) for i in range(count)]
    if limit is None:
        assert len(kvplane_backend.registration_spans(regions)) == count  # no cap: nothing is merged away
        return
    with pytest.raises(BackendError, match=rf"{count} memory regions to register, the device allows {limit}"):
        kvplane_backend.registration_spans(regions)
