"""Registration spans on Ascend: 2 MiB-aligned, regions within 4 KiB merged, at most 256, as vllm-ascend.

Regions carry made-up addresses; computing spans never touches a device.
"""

from __future__ import annotations

import itertools

import pytest
from kvplane_ascend.backend import AscendBackend

from kvplane.descriptors import Region
from kvplane.errors import BackendError
from kvplane.testing import backend_package

MiB = 1 << 20
ALIGN = 2 * MiB


def region(addr: int, nbytes: int, layer: int = 0, slot: str = "k") -> Region:
    """One region of ``nbytes`` at ``addr``: 16 contiguous blocks."""
    return backend_package.region(addr, nbytes, layer=layer, slot=slot, num_blocks=16)


def test_spans_are_widened_to_2_mib_boundaries() -> None:
    spans = AscendBackend(0).registration_spans([region(0x10_0000_0000 + ALIGN + 4096, 64 * 1024)])
    assert spans == [(0x10_0000_0000 + ALIGN, ALIGN)]


def test_k_and_v_of_one_storage_within_4_kib_merge_into_one_span() -> None:
    base = 0x20_0000_0000
    k = region(base, 8 * MiB, slot="k")
    v = region(k.end + 4096, 8 * MiB, slot="v")
    spans = AscendBackend(0).registration_spans([v, k])
    assert len(spans) == 1
    start, length = spans[0]
    assert start <= k.addr and start + length >= v.end


def test_every_span_is_aligned_sorted_disjoint_and_covers_its_regions() -> None:
    regions = [region(0x30_0000_0000 + i * 64 * MiB + i * 12345, 3 * MiB, layer=i) for i in range(40)]
    spans = AscendBackend(0).registration_spans(regions)
    assert all(start % ALIGN == 0 and length % ALIGN == 0 for start, length in spans)
    assert all(a[0] + a[1] < b[0] for a, b in itertools.pairwise(spans))
    for r in regions:
        assert any(start <= r.addr and r.end <= start + length for start, length in spans)


def test_256_separate_regions_are_allowed() -> None:
    regions = [region(0x40_0000_0000 + i * 16 * MiB, MiB, layer=i) for i in range(256)]
    assert len(AscendBackend(0).registration_spans(regions)) == 256


def test_more_than_256_separate_regions_is_an_error_naming_the_limit() -> None:
    regions = [region(0x40_0000_0000 + i * 16 * MiB, MiB, layer=i) for i in range(257)]
    with pytest.raises(BackendError, match=r"257 memory regions to register, the device allows 256"):
        AscendBackend(0).registration_spans(regions)


def test_many_regions_packed_in_one_allocation_fit_under_the_cap() -> None:
    # 2 slots x 300 layers back to back, as one big KV tensor: far more regions than 256, one span.
    regions = [region(0x50_0000_0000 + i * MiB, MiB, layer=i // 2, slot="kv"[i % 2]) for i in range(600)]
    assert AscendBackend(0).registration_spans(regions) == [(0x50_0000_0000, 600 * MiB)]
