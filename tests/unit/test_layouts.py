"""Layouts and binding: engine tensors -> regions, checked against plain torch indexing.

Every layout in ``LAYOUTS`` has a case below, so a region's address arithmetic is compared with what torch itself
says block ``i`` of each slot is (a view in memory order, indexed by block). vllm-ascend's shapes are built with
explicit torch calls; vLLM's shapes come from kvplane's own layout specs here, and tests/vllm/test_vllm_layouts.py
checks every attention backend of the installed vLLM with tensors built by vLLM's own shape functions.
"""

from __future__ import annotations

import ctypes
import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from kvplane.errors import LayoutError, PlanError, SpecError
from kvplane.kv.binding import (
    allocate_cache,
    check_whole_allocations,
    layouts_by_family,
    regions_from_tensors,
)
from kvplane.kv.layouts import LAYOUTS, get_layout
from kvplane.kv.spec import KVGroup, KVSpec, LayerSpec, SlotSpec

NB, BS, H, D = 7, 4, 2, 8  # blocks, tokens per block, heads, head dim: small on purpose
RANK, ROPE, IDX = 16, 8, 12  # MLA kv_lora_rank, rope dim, indexer dim
NUM_LAYERS = 3


# -- specs ---------------------------------------------------------------------------------------------------
def gqa_spec(dtype: str = "bfloat16") -> KVSpec:
    return KVSpec.gqa(NUM_LAYERS, H, D, dtype=dtype, tokens_per_block=BS)


def mla_spec(dtype: str = "bfloat16") -> KVSpec:
    return KVSpec.mla(NUM_LAYERS, kv_lora_rank=RANK, rope_dim=ROPE, dtype=dtype, tokens_per_block=BS)


def mla_index_spec(dtype: str = "bfloat16") -> KVSpec:
    slots = (
        SlotSpec("kv_c", 1, RANK, dtype),
        SlotSpec("k_pe", 1, ROPE, dtype),
        SlotSpec("index", 1, IDX, dtype),
    )
    layers = tuple(LayerSpec(f"layers.{i}", i, 0, slots) for i in range(NUM_LAYERS))
    return KVSpec(groups=(KVGroup(0, BS),), layers=layers)


def index_spec(dtype: str = "bfloat16", heads: int = 1, head_dim: int = IDX) -> KVSpec:
    slots = (SlotSpec("index", heads, head_dim, dtype),)
    layers = tuple(LayerSpec(f"layers.{i}", i, 0, slots) for i in range(NUM_LAYERS))
    return KVSpec(groups=(KVGroup(0, BS),), layers=layers)


def rand(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(shape).to(dtype)


# -- one case per layout shape -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    id: str
    layout: str
    spec: Callable[[str], KVSpec]
    # explicit torch allocation of one layer: (num_blocks, tokens_per_block, dtype) -> engine value
    make: Callable[[int, int, torch.dtype], object]
    # plain-torch view of each slot, dim 0 = blocks: value -> [(slot, tensor, heads, head_elems)]
    views: Callable[[object], list[tuple[str, torch.Tensor, int, int]]]
    block_dim: int = 0  # which dim of the engine tensors indexes blocks
    order: str = "NHD"


def spec_layout(name: str, order: str = "NHD") -> Callable[[int, int, torch.dtype], object]:
    """Random tensors of one layer as kvplane's own layout spec allocates them (checked against vLLM's own shape
    functions in tests/vllm/test_vllm_layouts.py; this file checks the stride arithmetic against torch)."""

    def make(nb: int, bs: int, dt: torch.dtype) -> object:
        spec = {"gqa": gqa_spec, "mla": mla_spec, "index": index_spec}[get_layout(name).family]
        layer = spec(str(dt).removeprefix("torch.")).layers[0]
        value = get_layout(name).allocate(layer, nb, bs, order=order)
        for t in tensors_of(value):
            t.copy_(torch.randn(t.shape).to(dt))
        return value

    return make


CASES = [
    Case(
        "packed_kv_nhd",
        "packed_kv",
        gqa_spec,
        spec_layout("packed_kv", "NHD"),
        lambda t: [("k+v", t.permute(0, 2, 1, 3), H, 2 * D)],  # memory (nb, bs, h, 2d)
    ),
    Case(
        "packed_kv_hnd",
        "packed_kv",
        gqa_spec,
        spec_layout("packed_kv", "HND"),
        lambda t: [("k+v", t, H, 2 * D)],  # memory (nb, h, bs, 2d)
        order="HND",
    ),
    Case(
        "kv_first",
        "kv_first",
        gqa_spec,
        spec_layout("kv_first"),
        lambda t: [("k", t[0], H, D), ("v", t[1], H, D)],
        block_dim=1,
    ),
    Case(
        "block_kv",
        "block_kv",
        gqa_spec,
        spec_layout("block_kv"),
        lambda t: [("k", t[:, 0], H, D), ("v", t[:, 1], H, D)],
    ),
    Case(
        "split_kv",
        "split_kv",
        gqa_spec,
        lambda nb, bs, dt: (rand((nb, bs, H, D), dt), rand((nb, bs, H, D), dt)),
        lambda kv: [("k", kv[0], H, D), ("v", kv[1], H, D)],
    ),
    Case(
        "mla_fused",
        "mla_fused",
        mla_spec,
        spec_layout("mla_fused"),
        lambda t: [("kv_c+k_pe", t, 1, RANK + ROPE)],
    ),
    Case(
        "mla_heads",
        "mla_heads",
        mla_spec,
        spec_layout("mla_heads"),
        lambda t: [("kv_c+k_pe", t[:, 0], 1, RANK + ROPE)],
    ),
    Case(
        "mla_split",
        "mla_split",
        mla_spec,
        lambda nb, bs, dt: (rand((nb, bs, 1, RANK), dt), rand((nb, bs, 1, ROPE), dt)),
        lambda v: [("kv_c", v[0], 1, RANK), ("k_pe", v[1], 1, ROPE)],
    ),
    Case(
        "mla_split+index",
        "mla_split",
        mla_index_spec,
        lambda nb, bs, dt: (
            rand((nb, bs, 1, RANK), dt),
            rand((nb, bs, 1, ROPE), dt),
            rand((nb, bs, 1, IDX), dt),
        ),
        lambda v: [("kv_c", v[0], 1, RANK), ("k_pe", v[1], 1, ROPE), ("index", v[2], 1, IDX)],
    ),
    Case(
        "index",
        "index",
        index_spec,
        spec_layout("index"),
        lambda t: [("index", t, 1, IDX)],
    ),
]
CASE_IDS = [c.id for c in CASES]


def case_named(name: str) -> Case:
    return next(c for c in CASES if c.id == name)


def tensors_of(value: object) -> tuple[torch.Tensor, ...]:
    return (value,) if isinstance(value, torch.Tensor) else tuple(value)  # type: ignore[arg-type]


def build(case: Case, dtype: torch.dtype = torch.bfloat16, nb: int = NB):
    spec = case.spec(str(dtype).removeprefix("torch."))
    tensors = {
        layer.name: case.make(nb, spec.group(layer.group_id).tokens_per_block, dtype) for layer in spec.layers
    }
    regions = regions_from_tensors(spec, tensors, case.layout)
    expected = [(layer, *view) for layer in spec.layers for view in case.views(tensors[layer.name])]
    return spec, tensors, regions, expected


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


# -- the registry --------------------------------------------------------------------------------------------
def test_every_registered_layout_has_a_case_here() -> None:
    assert set(LAYOUTS) == {c.layout for c in CASES}


def test_get_layout_of_an_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(LayoutError, match=r"layout='nhd_fused' is unknown.*packed_kv"):
        get_layout("nhd_fused")


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_layout_registry_is_keyed_by_each_layouts_own_name(name: str) -> None:
    assert get_layout(name).name == name
    assert get_layout(name).family in {"gqa", "mla", "index"}


# -- addresses, sizes and bytes against torch ----------------------------------------------------------------
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_region_block_addrs_equal_torch_data_ptr_of_each_block(case: Case, rng: np.random.Generator) -> None:
    _, _, regions, expected = build(case)
    assert len(regions) == len(expected)
    ids = rng.integers(0, NB, size=25)
    for region, (layer, slot, view, _, _) in zip(regions, expected):
        assert (region.layer_name, region.slot) == (layer.name, slot)
        want = np.array([view[int(i)].data_ptr() for i in ids], dtype=np.int64)
        got = region.block_addrs(ids)
        assert got.dtype == np.int64
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_region_block_bytes_and_stride_equal_one_torch_block(case: Case) -> None:
    _, _, regions, expected = build(case)
    for region, (_, _, view, _, _) in zip(regions, expected):
        for i in (0, NB - 1):
            assert region.block_bytes == view[i].numel() * view.element_size()
        assert region.block_stride == view[1].data_ptr() - view[0].data_ptr()
        assert region.num_blocks == NB
        assert region.addr == view.data_ptr()
        assert region.end == view[NB - 1].data_ptr() + region.block_bytes


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_bytes_at_region_addresses_are_the_blocks_torch_holds(case: Case, rng: np.random.Generator) -> None:
    _, _, regions, expected = build(case)
    ids = rng.integers(0, NB, size=10)
    for region, (_, _, view, _, _) in zip(regions, expected):
        for i, addr in zip(ids, region.block_addrs(ids)):
            assert ctypes.string_at(int(addr), region.block_bytes) == raw(view[int(i)])


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_regions_carry_the_spec_identity_of_each_slot(case: Case) -> None:
    spec, _, regions, expected = build(case)
    for region, (layer, slot, view, heads, head_elems) in zip(regions, expected):
        assert region.group_id == layer.group_id
        assert region.layer == layer.index
        assert region.slot == slot
        assert region.tokens_per_block == spec.group(layer.group_id).tokens_per_block
        assert region.heads == heads
        assert region.row_bytes == head_elems * view.element_size()
        assert region.heads * region.row_bytes * region.tokens_per_block == region.block_bytes
        assert region.order == case.order


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_layout_allocate_gives_the_engines_shapes_zeroed(case: Case) -> None:
    spec = case.spec("bfloat16")
    layer = spec.layers[0]
    got = tensors_of(get_layout(case.layout).allocate(layer, NB, BS))
    want = tensors_of(case.make(NB, BS, torch.bfloat16))
    assert [t.shape for t in got] == [t.shape for t in want]
    assert all(t.dtype == torch.bfloat16 and not t.any() for t in got)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize("case", [CASES[0], CASES[5], CASES[7]], ids=lambda c: c.id)
def test_regions_scale_with_the_dtype_element_size(
    case: Case, dtype: torch.dtype, rng: np.random.Generator
) -> None:
    _, _, regions, expected = build(case, dtype)
    ids = rng.integers(0, NB, size=5)
    for region, (_, _, view, _, head_elems) in zip(regions, expected):
        assert region.block_bytes == view[0].numel() * dtype.itemsize
        assert region.row_bytes == head_elems * dtype.itemsize
        np.testing.assert_array_equal(region.block_addrs(ids), [view[int(i)].data_ptr() for i in ids])


def test_fused_gqa_view_of_interleaved_blocks_keeps_torchs_stride(rng: np.random.Generator) -> None:
    # an engine that keeps (nb, 2, bs, h, d) and hands over its (2, nb, ...) permutation: k and v of one
    # block are neighbours, so each slot's block stride is two blocks.
    spec = gqa_spec()
    tensors = {name: rand((NB, 2, BS, H, D), torch.bfloat16).transpose(0, 1) for name in spec.layer_names}
    regions = regions_from_tensors(spec, tensors, "kv_first")
    ids = rng.integers(0, NB, size=12)
    for region, (name, i) in zip(regions, [(n, s) for n in spec.layer_names for s in (0, 1)]):
        view = tensors[name][i]
        assert region.block_stride == 2 * region.block_bytes
        np.testing.assert_array_equal(region.block_addrs(ids), [view[int(b)].data_ptr() for b in ids])
        for b, addr in zip(ids, region.block_addrs(ids)):
            assert ctypes.string_at(int(addr), region.block_bytes) == raw(view[int(b)])


# -- block ids -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [-1, NB, NB + 100])
def test_block_addrs_of_an_out_of_range_id_raises_naming_the_id_and_layer(bad: int) -> None:
    _, _, regions, _ = build(case_named("split_kv"))
    region = regions[3]  # layers.1, slot v
    with pytest.raises(
        PlanError, match=rf"block id {bad} is out of range for layer 'layers.1' slot 'v'.*0\.\.{NB - 1}"
    ):
        region.block_addrs([0, bad, 1])


def test_block_addrs_of_no_ids_is_empty() -> None:
    _, _, regions, _ = build(CASES[0])
    out = regions[0].block_addrs([])
    assert out.shape == (0,) and out.dtype == np.int64


# -- shape, dtype and count errors ---------------------------------------------------------------------------
def _value_with(case: Case, index: int, tensor: torch.Tensor) -> object:
    parts = list(tensors_of(case.make(NB, BS, torch.bfloat16)))
    parts[index] = tensor
    return parts[0] if len(parts) == 1 else tuple(parts)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_a_wrong_dim_raises_naming_the_layer_the_dim_and_both_sizes(case: Case) -> None:
    spec = case.spec("bfloat16")
    good = {name: case.make(NB, BS, torch.bfloat16) for name in spec.layer_names}
    for index, t in enumerate(tensors_of(good["layers.1"])):
        for dim in range(t.dim()):
            if dim == case.block_dim:
                continue
            shape = list(t.shape)
            shape[dim] += 1
            bad = dict(good, **{"layers.1": _value_with(case, index, rand(tuple(shape), torch.bfloat16))})
            with pytest.raises(
                LayoutError,
                match=rf"layer 'layers\.1' .*dim {dim} .* is {shape[dim]}, the KV spec says {t.shape[dim]}",
            ):
                regions_from_tensors(spec, bad, case.layout)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_a_wrong_number_of_dims_raises_naming_the_layer_and_the_shape(case: Case) -> None:
    spec = case.spec("bfloat16")
    good = {name: case.make(NB, BS, torch.bfloat16) for name in spec.layer_names}
    t = tensors_of(good["layers.2"])[0]
    bad = dict(good, **{"layers.2": _value_with(case, 0, t.unsqueeze(-1))})
    with pytest.raises(LayoutError, match=rf"layer 'layers\.2' .*{t.dim()} dims\), got shape"):
        regions_from_tensors(spec, bad, case.layout)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_a_wrong_dtype_raises_naming_the_layer_slot_and_both_dtypes(case: Case) -> None:
    spec = case.spec("bfloat16")
    tensors = {name: case.make(NB, BS, torch.bfloat16) for name in spec.layer_names}
    tensors["layers.0"] = case.make(NB, BS, torch.float16)
    with pytest.raises(
        LayoutError, match=r"layer 'layers\.0' slot '.+': tensor dtype is float16, the KV spec says bfloat16"
    ):
        regions_from_tensors(spec, tensors, case.layout)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_a_wrong_tensor_count_raises_naming_the_layer_and_both_counts(case: Case) -> None:
    spec = case.spec("bfloat16")
    tensors = {name: case.make(NB, BS, torch.bfloat16) for name in spec.layer_names}
    parts = tensors_of(tensors["layers.1"])
    for wrong in (parts + parts[:1], parts[:-1]):
        if not wrong:
            continue
        bad = dict(tensors, **{"layers.1": wrong})
        with pytest.raises(
            LayoutError,
            match=rf"layer 'layers\.1': layout {case.layout} takes {len(parts)} tensor\(s\).*got {len(wrong)}",
        ):
            regions_from_tensors(spec, bad, case.layout)


def test_mla_split_without_the_index_tensor_the_spec_asks_for_raises() -> None:
    spec = mla_index_spec()
    tensors = {
        name: (rand((NB, BS, 1, RANK), torch.bfloat16), rand((NB, BS, 1, ROPE), torch.bfloat16))
        for name in spec.layer_names
    }
    with pytest.raises(LayoutError, match=r"layer 'layers\.0': layout mla_split takes 3 tensor\(s\).*got 2"):
        regions_from_tensors(spec, tensors, "mla_split")


@pytest.mark.parametrize(
    "layout, slots, value",
    [
        ("mla_fused", ("kv_c", 1, RANK, "k_pe", 1, ROPE), (NB, BS, RANK + ROPE)),
        ("packed_kv", ("k", H, D, "v", H, D), (NB, H, BS, 2 * D)),
        ("kv_first", ("k", H, D, "v", H, D), (2, NB, BS, H, D)),
        ("split_kv", ("k", H, D, "v", H, D), ((NB, BS, H, D), (NB, BS, H, D))),
    ],
    ids=["mla_fused", "packed_kv", "kv_first", "split_kv"],
)
def test_a_layout_that_has_no_place_for_a_slot_of_the_layer_raises_naming_it(
    layout: str, slots: tuple, value: tuple
) -> None:
    # The spec says each layer also stores indexer keys; a layout without an index tensor would silently
    # leave them out of every region, manifest and transfer.
    spec_slots = (
        SlotSpec(slots[0], slots[1], slots[2]),
        SlotSpec(slots[3], slots[4], slots[5]),
        SlotSpec("index", 1, IDX),
    )
    spec = KVSpec(groups=(KVGroup(0, BS),), layers=(LayerSpec("layers.0", 0, 0, spec_slots),))
    tensors = {
        "layers.0": tuple(rand(v, torch.bfloat16) for v in value)
        if isinstance(value[0], tuple)
        else rand(value, torch.bfloat16)
    }
    with pytest.raises(LayoutError, match=r"layers\.0.*index"):
        regions_from_tensors(spec, tensors, layout)


def test_an_mla_slot_with_several_heads_is_refused_in_the_spec() -> None:
    with pytest.raises(SpecError, match=r"slot 'kv_c': MLA slots have 1 head .* got heads=2"):
        SlotSpec("kv_c", 2, RANK)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_a_block_that_is_not_contiguous_raises_naming_layer_and_slot(case: Case) -> None:
    spec = case.spec("bfloat16")
    tensors = {name: case.make(NB, BS, torch.bfloat16) for name in spec.layer_names}
    t = tensors_of(tensors["layers.1"])[-1]
    strided = rand((*t.shape[:-1], 2 * t.shape[-1]), torch.bfloat16)[..., ::2]
    assert strided.shape == t.shape
    tensors["layers.1"] = _value_with(case, len(tensors_of(tensors["layers.1"])) - 1, strided)
    with pytest.raises(LayoutError, match=r"layer 'layers\.1' slot '.+': one block is not contiguous"):
        regions_from_tensors(spec, tensors, case.layout)


def test_a_split_kv_tensor_that_is_really_hnd_is_read_as_head_major_blocks() -> None:
    spec = gqa_spec()
    tensors = {
        name: tuple(rand((NB, H, BS, D), torch.bfloat16).transpose(1, 2) for _ in "kv")
        for name in spec.layer_names
    }
    regions = regions_from_tensors(spec, tensors, "split_kv")
    assert {r.order for r in regions} == {"HND"}  # the strides say head-major, whatever the logical shape
    for r, (name, i) in zip(regions, [(n, s) for n in spec.layer_names for s in (0, 1)]):
        memory = tensors[name][i].transpose(1, 2)  # (nb, h, bs, d): the allocation
        assert ctypes.string_at(int(r.block_addrs([5])[0]), r.block_bytes) == raw(memory[5])


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_blocks_that_overlap_in_memory_are_rejected(case: Case) -> None:
    spec = case.spec("bfloat16")
    tensors = {name: case.make(NB, BS, torch.bfloat16) for name in spec.layer_names}
    t = tensors_of(tensors["layers.0"])[0]
    one = list(t.shape)
    one[case.block_dim] = 1
    tensors["layers.0"] = _value_with(case, 0, rand(tuple(one), torch.bfloat16).expand(t.shape))
    with pytest.raises(
        LayoutError, match=r"layer 'layers\.0' slot '.+': dim 'block' has stride 0 .* blocks overlap"
    ):
        regions_from_tensors(spec, tensors, case.layout)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_a_cache_of_zero_blocks_is_rejected(case: Case) -> None:
    spec = case.spec("bfloat16")
    tensors = {name: case.make(0, BS, torch.bfloat16) for name in spec.layer_names}
    with pytest.raises(LayoutError, match=r"layer 'layers\.0' slot '.+': the cache has 0 blocks"):
        regions_from_tensors(spec, tensors, case.layout)


# -- names and families --------------------------------------------------------------------------------------
def test_a_spec_layer_without_a_tensor_raises_naming_it() -> None:
    spec = gqa_spec()
    tensors = {name: CASES[0].make(NB, BS, torch.bfloat16) for name in spec.layer_names if name != "layers.1"}
    with pytest.raises(LayoutError, match=r"layer 'layers\.1' has no tensor"):
        regions_from_tensors(spec, tensors, "packed_kv")


def test_a_tensor_for_a_layer_the_spec_lacks_raises_naming_it() -> None:
    spec = gqa_spec()
    tensors = {name: CASES[0].make(NB, BS, torch.bfloat16) for name in spec.layer_names}
    tensors["model.layers.9.attn"] = CASES[0].make(NB, BS, torch.bfloat16)
    with pytest.raises(LayoutError, match=r"model\.layers\.9\.attn.*not in the KV spec"):
        regions_from_tensors(spec, tensors, "packed_kv")


def test_a_layout_of_another_family_raises_naming_the_layer_and_family() -> None:
    spec = mla_spec()
    tensors = {name: case_named("mla_fused").make(NB, BS, torch.bfloat16) for name in spec.layer_names}
    with pytest.raises(LayoutError, match=r"layer 'layers\.0' is family 'mla' but no layout was given"):
        regions_from_tensors(spec, tensors, "packed_kv")


def test_a_layout_mapped_to_the_wrong_family_is_rejected() -> None:
    with pytest.raises(LayoutError, match=r"layout mla_fused stores family 'mla', not 'gqa'"):
        layouts_by_family({"gqa": "mla_fused"})


def test_mla_and_indexer_layers_bind_through_one_layout_per_family(rng: np.random.Generator) -> None:
    mla_slots = (SlotSpec("kv_c", 1, RANK), SlotSpec("k_pe", 1, ROPE))
    layers = []
    for i in range(2):
        layers.append(LayerSpec(f"layers.{i}.attn", 2 * i, 0, mla_slots))
        layers.append(LayerSpec(f"layers.{i}.indexer", 2 * i + 1, 0, (SlotSpec("index", 1, IDX),)))
    spec = KVSpec(groups=(KVGroup(0, BS),), layers=tuple(layers))
    tensors = {
        layer.name: rand((NB, BS, RANK + ROPE) if layer.family == "mla" else (NB, BS, IDX), torch.bfloat16)
        for layer in spec.layers
    }
    regions = regions_from_tensors(spec, tensors, {"mla": "mla_fused", "index": "index"})
    assert [(r.layer_name, r.slot) for r in regions] == [
        ("layers.0.attn", "kv_c+k_pe"),
        ("layers.0.indexer", "index"),
        ("layers.1.attn", "kv_c+k_pe"),
        ("layers.1.indexer", "index"),
    ]
    ids = rng.integers(0, NB, size=6)
    for r in regions:
        np.testing.assert_array_equal(
            r.block_addrs(ids), [tensors[r.layer_name][int(i)].data_ptr() for i in ids]
        )


# -- hybrid models: groups with different block sizes --------------------------------------------------------
def hybrid_spec() -> KVSpec:
    return KVSpec.gqa(
        4, H, D, tokens_per_block=BS, layer_groups=[0, 1, 0, 1], group_tokens_per_block={1: 2 * BS}
    )


@pytest.mark.parametrize("case", [CASES[0], CASES[1], CASES[2], CASES[4]], ids=lambda c: c.id)
def test_hybrid_groups_each_use_their_own_tokens_per_block(case: Case, rng: np.random.Generator) -> None:
    spec = hybrid_spec()
    assert [(g.group_id, g.tokens_per_block) for g in spec.groups] == [(0, BS), (1, 2 * BS)]
    tensors = {layer.name: case.make(NB, BS * (1 + layer.group_id), torch.bfloat16) for layer in spec.layers}
    regions = regions_from_tensors(spec, tensors, case.layout)
    ids = rng.integers(0, NB, size=8)
    views = [(layer, *v) for layer in spec.layers for v in case.views(tensors[layer.name])]
    for region, (layer, _, view, _, _) in zip(regions, views):
        assert region.group_id == layer.group_id
        assert region.tokens_per_block == BS * (1 + layer.group_id)
        assert region.block_bytes == view[0].numel() * view.element_size()
        np.testing.assert_array_equal(region.block_addrs(ids), [view[int(i)].data_ptr() for i in ids])
    assert {r.layer_name for r in regions if r.group_id == 1} == {"layers.1", "layers.3"}


def test_hybrid_layer_with_the_other_groups_block_size_raises_naming_layer_and_dim() -> None:
    spec = hybrid_spec()
    tensors = {
        layer.name: case_named("split_kv").make(NB, BS, torch.bfloat16) for layer in spec.layers
    }  # all at group 0's size
    with pytest.raises(
        LayoutError, match=rf"layer 'layers\.1' slot 'k': dim 1 .* is {BS}, the KV spec says {2 * BS}"
    ):
        regions_from_tensors(spec, tensors, "split_kv")


def test_spec_rejects_a_layer_in_an_unknown_group() -> None:
    with pytest.raises(SpecError, match=r"layer 'l0': group_id=3 is not one of \[0\]"):
        KVSpec(
            groups=(KVGroup(0, BS),),
            layers=(LayerSpec("l0", 0, 3, (SlotSpec("k", 1, 8), SlotSpec("v", 1, 8))),),
        )


# -- allocate_cache --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_allocate_cache_gives_zeroed_tensors_of_the_engines_shapes(case: Case) -> None:
    spec = case.spec("bfloat16")
    cache = allocate_cache(spec, case.layout, NB)
    assert list(cache) == spec.layer_names
    for name, value in cache.items():
        want = tensors_of(case.make(NB, BS, torch.bfloat16))
        got = tensors_of(value)
        assert [t.shape for t in got] == [t.shape for t in want]
        assert all(not t.any() for t in got)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_allocate_cache_carved_from_one_buffer_gives_the_same_regions_back_to_back(case: Case) -> None:
    spec = case.spec("bfloat16")
    calls: list[torch.Tensor] = []

    def alloc(nbytes: int) -> torch.Tensor:
        buf = torch.full((nbytes,), 0xAB, dtype=torch.uint8)
        calls.append(buf)
        return buf

    plain = regions_from_tensors(spec, allocate_cache(spec, case.layout, NB), case.layout)
    carved_cache = allocate_cache(spec, case.layout, NB, alloc=alloc)
    carved = regions_from_tensors(spec, carved_cache, case.layout)

    assert len(calls) == 1
    (buf,) = calls
    assert buf.numel() == NB * BS * spec.bytes_per_token
    assert not buf.any()  # zeroed, whatever alloc handed back
    assert [{**_fields(r), "addr": 0} for r in carved] == [{**_fields(r), "addr": 0} for r in plain]
    assert min(r.addr for r in carved) == buf.data_ptr()
    assert max(r.end for r in carved) == buf.data_ptr() + buf.numel()
    assert sum(r.num_blocks * r.block_bytes for r in carved) == buf.numel()  # every byte in exactly one block


def test_allocate_cache_carved_tensors_write_through_to_the_buffer() -> None:
    spec = gqa_spec()
    holder: list[torch.Tensor] = []

    def alloc(nbytes: int) -> torch.Tensor:
        holder.append(torch.empty(nbytes, dtype=torch.uint8))
        return holder[-1]

    cache = allocate_cache(spec, "split_kv", NB, alloc=alloc)
    k, _ = cache["layers.0"]
    k[3].fill_(1.0)
    region = regions_from_tensors(spec, cache, "split_kv")[0]
    (addr,) = region.block_addrs([3])
    offset = int(addr) - holder[0].data_ptr()
    block = holder[0][offset : offset + region.block_bytes].view(torch.bfloat16)
    assert torch.equal(block, torch.ones_like(block))


def _fields(region: object) -> dict[str, object]:
    return {f: getattr(region, f) for f in region.__struct_fields__}  # type: ignore[attr-defined]


def test_block_addrs_do_not_depend_on_how_the_ids_are_passed() -> None:
    _, _, regions, _ = build(CASES[0])
    r = regions[0]
    want = r.block_addrs(np.array([1, 2, 3]))
    np.testing.assert_array_equal(r.block_addrs([1, 2, 3]), want)
    np.testing.assert_array_equal(r.block_addrs(np.array([1, 2, 3], dtype=np.int32)), want)
    np.testing.assert_array_equal(r.block_addrs(torch.tensor([1, 2, 3])), want)


def test_region_messages_are_plain_text_not_reprs_of_tensors() -> None:
    spec = gqa_spec()
    tensors = {name: CASES[0].make(NB, BS, torch.float32) for name in spec.layer_names}
    with pytest.raises(LayoutError) as info:
        regions_from_tensors(spec, tensors, "packed_kv")
    assert "tensor(" not in str(info.value)
    assert re.search(r"dtype='float32'", str(info.value))  # the fix it names


# -- whole allocations ---------------------------------------------------------------------------------------
def test_whole_allocations_pass_and_so_do_halves_of_one_buffer() -> None:
    cache = torch.zeros((2, NB, BS, H, D))
    check_whole_allocations({"layers.0": cache})
    check_whole_allocations({"layers.0": (cache[0], cache[1])})  # K and V halves of one buffer, checked together


@pytest.mark.parametrize("view", ["first blocks", "shifted", "one half"])
def test_a_slice_of_the_engines_cache_is_refused_naming_the_uncovered_bytes(view: str) -> None:
    cache = torch.zeros((NB, BS, H, D))
    part = {"first blocks": cache[: NB - 2], "shifted": cache[2:], "one half": torch.zeros((2, NB, BS, H, D))[0]}
    with pytest.raises(LayoutError, match=r"layers \['layers\.0'\]: their tensors leave bytes \[\d+, \d+\) .* uncovered"):
        check_whole_allocations({"layers.0": part[view]})


def test_gaps_under_the_backends_alignment_pass() -> None:
    buf = torch.zeros(NB * BS * H * D + 64)
    aligned = buf[16 : 16 + NB * BS * H * D].view(NB, BS, H, D)  # vllm-ascend: an aligned view of a larger buffer
    with pytest.raises(LayoutError, match="uncovered"):
        check_whole_allocations({"layers.0": aligned})
    check_whole_allocations({"layers.0": aligned}, slack=64 * 4)
