"""Copy plans: validation, coalescing (which must never change what a plan copies), bounds, block plans."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplane.descriptors import CopyPlan
from kvplane.errors import PlanError
from kvplane.kv.binding import allocate_cache, regions_from_tensors
from kvplane.kv.spec import KVSpec
from kvplane.plan import block_copy_plan

I64 = np.int64


def plan(src: list[int], dst: list[int], length: list[int]) -> CopyPlan:
    return CopyPlan(np.array(src, dtype=I64), np.array(dst, dtype=I64), np.array(length, dtype=I64))


def run_in_order(p: CopyPlan) -> None:
    """The reference executor: one memmove per descriptor, in plan order."""
    for s, d, n in zip(p.src.tolist(), p.dst.tolist(), p.length.tolist()):
        ctypes.memmove(d, s, n)


def addr(a: np.ndarray) -> int:
    return int(a.ctypes.data)


# -- validation ----------------------------------------------------------------------------------------------
def test_a_plan_holds_three_equal_int64_arrays() -> None:
    p = plan([0, 100], [1000, 1100], [10, 20])
    assert len(p) == 2 and p.total_bytes == 30


def test_the_empty_plan_has_no_bytes() -> None:
    p = CopyPlan.empty()
    assert len(p) == 0 and p.total_bytes == 0
    assert all(a.dtype == I64 for a in (p.src, p.dst, p.length))


@pytest.mark.parametrize("field", ["src", "dst", "length"])
def test_a_wrong_dtype_raises_naming_the_field(field: str) -> None:
    arrays = {"src": np.zeros(2, I64), "dst": np.zeros(2, I64), "length": np.ones(2, I64)}
    arrays[field] = arrays[field].astype(np.int32)
    with pytest.raises(PlanError, match=rf"CopyPlan\.{field} must be a 1-D int64 numpy array"):
        CopyPlan(**arrays)


def test_a_wrong_dtype_message_names_the_dtype_it_got() -> None:
    # errors.py: "Every message names the field, the value it had, and how to fix it."
    with pytest.raises(PlanError, match=r"CopyPlan\.src .*int32"):
        CopyPlan(np.zeros(2, np.int32), np.zeros(2, I64), np.ones(2, I64))


def test_a_list_instead_of_an_array_raises_naming_the_field_and_type() -> None:
    with pytest.raises(PlanError, match=r"CopyPlan\.dst must be a 1-D int64 numpy array, got list"):
        CopyPlan(np.zeros(1, I64), [0], np.ones(1, I64))  # type: ignore[arg-type]


def test_a_two_dimensional_array_raises_naming_the_field() -> None:
    with pytest.raises(PlanError, match=r"CopyPlan\.src must be a 1-D"):
        CopyPlan(np.zeros((1, 2), I64), np.zeros(2, I64), np.ones(2, I64))


def test_unequal_lengths_raise_naming_every_length() -> None:
    with pytest.raises(PlanError, match=r"src=3, dst=2, length=3"):
        CopyPlan(np.zeros(3, I64), np.zeros(2, I64), np.ones(3, I64))


@pytest.mark.parametrize("bad", [0, -3])
def test_a_descriptor_of_no_bytes_or_fewer_raises_naming_the_length(bad: int) -> None:
    with pytest.raises(PlanError, match=rf"CopyPlan\.length holds {bad}; every descriptor must be > 0 bytes"):
        plan([0, 8], [0, 8], [8, bad])


def test_concat_joins_plans_in_order() -> None:
    a, b = plan([0], [100], [4]), plan([50, 60], [200, 300], [1, 2])
    c = CopyPlan.concat([a, b])
    assert (
        c.src.tolist() == [0, 50, 60] and c.dst.tolist() == [100, 200, 300] and c.length.tolist() == [4, 1, 2]
    )
    assert len(CopyPlan.concat([])) == 0


# -- coalescing ----------------------------------------------------------------------------------------------
def test_adjacent_runs_merge_into_one_descriptor() -> None:
    c = plan([1000, 1004, 1008], [5000, 5004, 5008], [4, 4, 4]).coalesced()
    assert (c.src.tolist(), c.dst.tolist(), c.length.tolist()) == ([1000], [5000], [12])


def test_runs_adjacent_on_one_side_only_stay_apart() -> None:
    p = plan([1000, 1004, 1008], [5000, 6004, 6008], [4, 4, 4])
    c = p.coalesced()
    assert (c.src.tolist(), c.dst.tolist(), c.length.tolist()) == ([1000, 1004], [5000, 6004], [4, 8])


def test_only_neighbours_in_plan_order_merge_and_sorting_by_destination_helps() -> None:
    p = plan([1004, 1000], [5004, 5000], [4, 4])
    assert len(p.coalesced()) == 2
    s = p.sorted_by_dst()
    assert s.dst.tolist() == [5000, 5004] and s.src.tolist() == [1000, 1004]
    assert len(s.coalesced()) == 1 and s.coalesced().total_bytes == 8


def test_a_plan_with_nothing_to_merge_is_returned_as_is() -> None:
    p = plan([0, 100], [0, 100], [10, 10])
    assert p.coalesced() is p
    assert CopyPlan.empty().coalesced().total_bytes == 0
    one = plan([0], [8], [8])
    assert one.coalesced() is one


SIZE = 512


@st.composite
def plans_with_runs(draw: st.DrawFn) -> list[tuple[int, int, int]]:
    """Descriptors as offsets into 512-byte buffers; many follow their predecessor on one or both sides."""
    out: list[tuple[int, int, int]] = []
    for _ in range(draw(st.integers(0, 40))):
        n = draw(st.integers(1, 24))
        follow = draw(st.sampled_from(["both", "src", "dst", "none"])) if out else "none"
        s = out[-1][0] + out[-1][2] if follow in ("both", "src") else draw(st.integers(0, SIZE - n))
        d = out[-1][1] + out[-1][2] if follow in ("both", "dst") else draw(st.integers(0, SIZE - n))
        if s + n > SIZE or d + n > SIZE:
            s, d = draw(st.integers(0, SIZE - n)), draw(st.integers(0, SIZE - n))
        out.append((s, d, n))
    return out


@settings(max_examples=150, deadline=None, database=None)
@given(plans_with_runs(), st.integers(0, 2**32 - 1))
def test_coalescing_never_changes_what_a_plan_copies(descs: list[tuple[int, int, int]], seed: int) -> None:
    src = np.random.default_rng(seed).integers(0, 256, SIZE, dtype=np.uint8)
    dst_a, dst_b = np.zeros(SIZE, np.uint8), np.zeros(SIZE, np.uint8)
    offsets = [list(col) for col in zip(*descs)] if descs else [[], [], []]

    def on(dst: np.ndarray) -> CopyPlan:
        return plan([addr(src) + s for s in offsets[0]], [addr(dst) + d for d in offsets[1]], offsets[2])

    original, coalesced = on(dst_a), on(dst_b).coalesced()
    assert coalesced.total_bytes == original.total_bytes
    assert len(coalesced) <= len(original)
    run_in_order(original)
    run_in_order(coalesced)
    np.testing.assert_array_equal(dst_a, dst_b)

    # fully merged: no neighbour follows on both sides any more, and merging again changes nothing
    follows = (coalesced.src[1:] == coalesced.src[:-1] + coalesced.length[:-1]) & (
        coalesced.dst[1:] == coalesced.dst[:-1] + coalesced.length[:-1]
    )
    assert not follows.any()
    again = coalesced.coalesced()
    assert again.src.tolist() == coalesced.src.tolist() and again.length.tolist() == coalesced.length.tolist()
    assert all(a.dtype == I64 for a in (coalesced.src, coalesced.dst, coalesced.length))


# -- bounds --------------------------------------------------------------------------------------------------
SPANS = [(1000, 1100), (2000, 2050)]  # (start, end)


def test_descriptors_inside_the_spans_pass() -> None:
    plan([1000, 1090, 2000], [0, 0, 0], [100, 10, 50]).check_within("src", SPANS)
    CopyPlan.empty().check_within("dst", SPANS)


@pytest.mark.parametrize(
    "start, length",
    [(1090, 11), (999, 2), (1500, 4), (3000, 1), (1050, 1000)],
    ids=["runs-past-the-end", "starts-before", "between-spans", "after-every-span", "across-both-spans"],
)
def test_a_descriptor_outside_every_span_raises_naming_its_index_and_side(start: int, length: int) -> None:
    p = plan([5, 6, 7], [1000, 2000, start], [8, 8, length])
    with pytest.raises(
        PlanError,
        match=rf"descriptor 2: dst range \[{start:#x}, \+{length}\) lies outside every registered region",
    ):
        p.check_within("dst", SPANS)


def test_the_two_sides_are_checked_separately() -> None:
    p = plan([1000], [5000], [10])
    p.check_within("src", SPANS)
    with pytest.raises(PlanError, match=r"descriptor 0: dst"):
        p.check_within("dst", SPANS)


# -- block copy plans between two caches ---------------------------------------------------------------------
SRC_NB, DST_NB, BS = 9, 7, 4
BLOCK_DIM = {"packed_kv": 0, "kv_first": 1, "block_kv": 0, "split_kv": 0, "mla_fused": 0, "mla_split": 0}


def spec_for(layout: str, heads: int = 2) -> KVSpec:
    if layout.startswith("mla"):
        return KVSpec.mla(3, kv_lora_rank=16, rope_dim=8, tokens_per_block=BS)
    return KVSpec.gqa(3, heads, 8, tokens_per_block=BS)


def parts(value: object) -> tuple[torch.Tensor, ...]:
    return (value,) if isinstance(value, torch.Tensor) else tuple(value)  # type: ignore[arg-type]


def caches(layout: str):
    spec = spec_for(layout)
    src, dst = allocate_cache(spec, layout, SRC_NB), allocate_cache(spec, layout, DST_NB)
    for value in src.values():
        for t in parts(value):
            t.copy_(torch.randn(t.shape))
    for value in dst.values():
        for t in parts(value):
            t.copy_(torch.randn(t.shape))
    return spec, src, dst, regions_from_tensors(spec, src, layout), regions_from_tensors(spec, dst, layout)


@pytest.mark.parametrize("layout", sorted(BLOCK_DIM))
def test_a_block_copy_plan_copies_exactly_what_torch_indexing_copies(
    layout: str, rng: np.random.Generator
) -> None:
    spec, src, dst, src_regions, dst_regions = caches(layout)
    src_ids = rng.integers(0, SRC_NB, size=5)
    dst_ids = rng.permutation(DST_NB)[:5]
    expected = {name: tuple(t.clone() for t in parts(v)) for name, v in dst.items()}
    dim = BLOCK_DIM[layout]
    for name in spec.layer_names:
        for want, s in zip(expected[name], parts(src[name])):
            want.index_copy_(dim, torch.from_numpy(dst_ids), s.index_select(dim, torch.from_numpy(src_ids)))

    p = block_copy_plan(src_regions, src_ids, dst_regions, dst_ids)
    assert p.total_bytes == 5 * sum(r.block_bytes for r in src_regions)
    p.check_within("src", [(r.addr, r.end) for r in src_regions])
    p.check_within("dst", [(r.addr, r.end) for r in dst_regions])
    run_in_order(p)

    for name in spec.layer_names:
        for got, want in zip(parts(dst[name]), expected[name]):
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_consecutive_block_ids_coalesce_to_one_descriptor_per_region() -> None:
    _, _, _, src_regions, dst_regions = caches("split_kv")
    p = block_copy_plan(src_regions, [2, 3, 4], dst_regions, [0, 1, 2])
    assert len(p) == len(src_regions)
    assert p.length.tolist() == [3 * r.block_bytes for r in src_regions]


def test_copying_a_whole_cache_carved_from_one_buffer_is_one_descriptor() -> None:
    spec = spec_for("packed_kv")
    bufs = [torch.empty(1, dtype=torch.uint8)]

    def alloc(n: int) -> torch.Tensor:
        bufs.append(torch.empty(n, dtype=torch.uint8))
        return bufs[-1]

    a = regions_from_tensors(spec, allocate_cache(spec, "packed_kv", SRC_NB, alloc=alloc), "packed_kv")
    b = regions_from_tensors(spec, allocate_cache(spec, "packed_kv", SRC_NB, alloc=alloc), "packed_kv")
    p = block_copy_plan(a, np.arange(SRC_NB), b, np.arange(SRC_NB))
    assert len(p) == 1
    assert (int(p.src[0]), int(p.dst[0]), p.total_bytes) == (
        bufs[1].data_ptr(),
        bufs[2].data_ptr(),
        bufs[1].numel(),
    )


def test_no_block_ids_give_an_empty_plan() -> None:
    _, _, _, src_regions, dst_regions = caches("packed_kv")
    assert len(block_copy_plan(src_regions, [], dst_regions, [])) == 0


def test_unequal_block_id_counts_raise_naming_both_counts() -> None:
    _, _, _, src_regions, dst_regions = caches("packed_kv")
    with pytest.raises(PlanError, match=r"3 source block ids but 2 destination ids"):
        block_copy_plan(src_regions, [0, 1, 2], dst_regions, [0, 1])


def test_unequal_region_counts_raise_naming_both_counts() -> None:
    _, _, _, src_regions, dst_regions = caches("packed_kv")
    with pytest.raises(
        PlanError, match=rf"{len(src_regions)} source regions but {len(dst_regions) - 1} destination"
    ):
        block_copy_plan(src_regions, [0], dst_regions[:-1], [0])


def test_regions_whose_blocks_differ_in_size_raise_naming_layer_slot_and_sizes() -> None:
    _, _, _, src_regions, _ = caches("split_kv")
    wide = spec_for("split_kv", heads=4)
    dst_regions = regions_from_tensors(wide, allocate_cache(wide, "split_kv", DST_NB), "split_kv")
    a, b = src_regions[0].block_bytes, dst_regions[0].block_bytes
    with pytest.raises(PlanError, match=rf"layer 'layers\.0' slot 'k': blocks differ \({a} B NHD rows .* vs {b} B"):
        block_copy_plan(src_regions, [0], dst_regions, [0])


@pytest.mark.parametrize("side", ["src", "dst"])
def test_an_out_of_range_block_id_raises_naming_it(side: str) -> None:
    _, _, _, src_regions, dst_regions = caches("packed_kv")
    src_ids, dst_ids = [0, 1], [0, 1]
    bad = SRC_NB if side == "src" else DST_NB
    (src_ids if side == "src" else dst_ids)[1] = bad
    with pytest.raises(PlanError, match=rf"block id {bad} is out of range for layer 'layers\.0'"):
        block_copy_plan(src_regions, src_ids, dst_regions, dst_ids)
