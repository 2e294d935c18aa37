"""Every attention backend class the installed vLLM ships: its KV tensor, built by vLLM's own shape and
stride-order functions, is either served (regions equal torch indexing for random block ids, NHD and HND) or
refused with a ``LayoutError`` naming the class, the shape and the dtype.

The backend classes are discovered from the installed package (``vllm_kv_tensors.attention_backends``), so a
backend a later vLLM adds shows up here as a new case. The reference reads of K, V and MLA rows below follow the
logical shapes vLLM documents in each ``get_kv_cache_shape`` ("K and V are packed into the content dim: logical
(B, H, N, 2*D)"), never kvplane's layout code. ``served_and_refused()`` is what docs/vllm.md's table lists.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
import vllm_ascend_shapes
from vllm_kv_tensors import (
    NotUsedByVllm,
    api_generation,
    attention_backends,
    cross_layer_tensor,
    is_indexer,
    kv_cache_shape,
    kv_tensor,
    layer_kv_caches,
    parameter_grid,
    vllm_version,
)

from kvplane.backend import get_backend
from kvplane.errors import LayoutError
from kvplane.integrations.vllm.layouts import cross_layer_logical, layout_for_backend
from kvplane.integrations.vllm.worker import WorkerSide
from kvplane.kv.binding import check_whole_allocations, matching_layouts, regions_from_tensors
from kvplane.kv.manifest import Manifest
from kvplane.kv.spec import KVGroup, KVSpec, LayerSpec, SlotSpec
from kvplane.plan.planner import plan_transfer

shape_api = pytest.mark.skipif(api_generation() != "shape", reason="vLLM 0.33 has no per-backend get_kv_cache_shape: "
                               "test_vllm_layouts_033 checks its caches")

NB, ROPE = 24, 64
CASES = attention_backends()
SERVED = {"FlashAttentionBackend", "TritonAttentionBackend", "FlexAttentionBackend", "CPUAttentionBackend",
          "RocmAttentionBackend", "TritonMLABackend", "FlashMLABackend"}


def family_of(case: object) -> str:
    """index for the sparse indexer, mla for one latent row per token ``(nb, bs, width)``, else gqa."""
    if is_indexer(case.cls):  # type: ignore[attr-defined]
        return "index"
    try:
        token_rows = len(kv_cache_shape(case.cls, 2, 64, 1, 128, "auto")) == 3  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - a shape function that refuses this probe is not a token-row one
        token_rows = False
    return "mla" if case.is_mla or token_rows else "gqa"  # type: ignore[attr-defined]


def params(case: object) -> tuple[int, int, int, str]:
    """The first (block_size, heads, head_size, cache dtype) of the case's grid whose tensor vLLM builds, the
    model's own dtype ("auto") and several heads (so NHD and HND differ) first."""
    grid = sorted(parameter_grid(case), key=lambda p: (p[3] != "auto", p[1] == 1))  # type: ignore[arg-type]
    for p in grid:
        try:
            kv_tensor(case, 2, p[0], p[1], p[2], cache_dtype_str=p[3])
        except Exception:  # noqa: BLE001 - vLLM refuses this combination: try the next
            continue
        return p
    pytest.fail(f"vLLM builds no KV tensor for {case.id} over its parameter grid")  # type: ignore[attr-defined]


def spec_for(family: str, block: int, heads: int, head: int, dtype: str, layers: int = 1) -> KVSpec:
    if family == "gqa":
        slots = (SlotSpec("k", heads, head, dtype), SlotSpec("v", heads, head, dtype))
    elif family == "mla":
        slots = (SlotSpec("kv_c", 1, head - ROPE, dtype), SlotSpec("k_pe", 1, ROPE, dtype))
    else:
        slots = (SlotSpec("index", 1, head, dtype),)
    return KVSpec((KVGroup(0, block),), tuple(LayerSpec(f"layer.{i}", i, 0, slots) for i in range(layers)))


def reference_slots(t: torch.Tensor, block: int, spec: KVSpec) -> dict[str, torch.Tensor]:
    """Per spec slot, block ``block`` as ``(tokens, heads, width)``, read from vLLM's logical shape by torch."""
    layer = spec.layers[0]
    if layer.family == "gqa":
        d = layer.slot("k").head_dim
        if t.dim() == 4:  # (nb, heads, bs, 2*d)
            rows = t[block].transpose(0, 1)
            return {"k": rows[..., :d], "v": rows[..., d:]}
        if t.shape[0] == 2:  # (2, nb, bs, heads, d)
            return {"k": t[0, block], "v": t[1, block]}
        return {"k": t[block, 0], "v": t[block, 1]}  # (nb, 2, bs, heads, d)
    rows = t[block].reshape(t.shape[1], 1, -1)  # (nb, bs, width)
    if layer.family == "index":
        return {"index": rows}
    rank = layer.slot("kv_c").head_dim
    return {"kv_c": rows[..., :rank], "k_pe": rows[..., rank:]}


def region_slots(region: object, block: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Per slot part, block ``block`` read from the region's raw bytes as ``(tokens, heads, width)``."""
    (addr,) = region.block_addrs([block])  # type: ignore[attr-defined]
    raw = bytearray(ctypes.string_at(int(addr), region.block_bytes))  # type: ignore[attr-defined]
    isz = torch.empty(0, dtype=dtype).element_size()
    row = region.row_bytes // isz  # type: ignore[attr-defined]
    flat = torch.frombuffer(raw, dtype=dtype)
    if region.order == "HND":  # type: ignore[attr-defined]
        rows = flat.view(region.heads, region.tokens_per_block, row).transpose(0, 1)  # type: ignore[attr-defined]
    else:
        rows = flat.view(region.tokens_per_block, region.heads, row)  # type: ignore[attr-defined]
    return {p.slot: rows[..., p.offset // isz : (p.offset + p.nbytes) // isz] for p in region.parts}  # type: ignore[attr-defined]


def fill(t: torch.Tensor, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    raw = t.view(torch.uint8) if t.element_size() == 1 else t
    raw.copy_(torch.randint(0, 120, raw.shape, generator=gen).to(raw.dtype))


def served_or_refused(case: object) -> tuple[str, str]:
    """("served", layout name) or ("refused", the LayoutError message)."""
    block, heads, head, cache_dtype = params(case)
    family = family_of(case)
    t = kv_tensor(case, NB, block, heads, head, cache_dtype_str=cache_dtype)
    try:
        layout = layout_for_backend(case.cls, family, head, block, str(t.dtype).removeprefix("torch."),  # type: ignore[attr-defined]
                                    cache_dtype)
    except LayoutError as e:
        return "refused", str(e)
    return "served", layout.name


@pytest.fixture
def vllm_config() -> object:
    """vLLM's default config as the current one: its cross-layer checks read it, as in its engine."""
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig("cpu"))):
        yield None


@shape_api
def test_the_installed_vllm_has_attention_backends_to_check() -> None:
    assert len(CASES) >= 10, f"vLLM {vllm_version()}: only {len(CASES)} attention backends discovered"
    found = {c.qualname for c in CASES}
    missing = SERVED - found
    assert not missing, f"backends kvplane must serve were not discovered: {sorted(missing)}"


@shape_api
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_every_attention_backend_is_served_with_torch_exact_regions_or_refused_by_name(case: object) -> None:
    rng = np.random.default_rng(11)
    verdict, detail = served_or_refused(case)
    if verdict == "refused":
        assert case.qualname not in SERVED, f"{case.id} must be served: {detail}"  # type: ignore[attr-defined]
        assert case.qualname in detail and "dtype" in detail and "kvplane serves" in detail  # type: ignore[attr-defined]
        return
    for memory in ("NHD", "HND"):
        check_regions_equal_torch(case, *params(case), memory, detail, rng)


def check_regions_equal_torch(
    case: object, block: int, heads: int, head: int, cache_dtype: str, memory: str, layout: str,
    rng: np.random.Generator,
) -> None:
    t = kv_tensor(case, NB, block, heads, head, cache_dtype_str=cache_dtype, layout=memory)
    spec = spec_for(family_of(case), block, heads, head, str(t.dtype).removeprefix("torch."))
    fill(t, seed=7)
    check_whole_allocations({"layer.0": t})
    regions = regions_from_tensors(spec, {"layer.0": t}, layout)
    for b in rng.choice(NB, 6, replace=False).tolist():
        want = reference_slots(t, b, spec)
        got = {k: v for r in regions for k, v in region_slots(r, b, t.dtype).items()}
        assert set(got) == set(want)
        for slot in want:
            assert torch.equal(got[slot].contiguous().view(torch.uint8), want[slot].contiguous().view(torch.uint8)), \
                f"{case.id} {memory} {block}/{heads}/{head}/{cache_dtype}: slot {slot} of block {b} differs"  # type: ignore[attr-defined]


MAIN = [c for c in CASES if c.qualname in ("FlashAttentionBackend", "TritonAttentionBackend", "TritonMLABackend",
                                           "FlashMLABackend")]
GRID = [(bs, h, d, cdt, mem) for bs in (16, 64) for h, d in ((2, 64), (8, 128), (1, 576)) for cdt in ("auto", "fp8")
        for mem in ("NHD", "HND")]


@shape_api
@pytest.mark.parametrize("case", MAIN, ids=lambda c: c.id)
def test_main_backends_are_served_over_heads_head_sizes_block_sizes_dtypes_and_memory_orders(case: object) -> None:
    rng = np.random.default_rng(5)
    family, checked = family_of(case), 0
    for bs, heads, head, cache_dtype, memory in GRID:
        if (family == "mla") != (head == 576):
            continue
        try:
            t = kv_tensor(case, 2, bs, heads, head, cache_dtype_str=cache_dtype, layout=memory)
        except Exception:  # noqa: BLE001 - vLLM refuses this combination (e.g. FlashMLA's block size)
            continue
        layout = layout_for_backend(case.cls, family, head, bs, str(t.dtype), cache_dtype)  # type: ignore[attr-defined]
        check_regions_equal_torch(case, bs, heads, head, cache_dtype, memory, layout.name, rng)
        checked += 1
    assert checked >= 4, f"{case.id}: vLLM built only {checked} of the grid's tensors"  # type: ignore[attr-defined]


@shape_api
@pytest.mark.parametrize(
    "case", [c for c in CASES if c.qualname in ("FlashAttentionBackend", "TritonMLABackend")], ids=lambda c: c.id
)
def test_a_cross_layer_cache_moves_one_descriptor_per_block_for_all_layers(case: object, vllm_config: None) -> None:
    block, heads, head, cache_dtype = params(case)
    layers = 4
    caches = []
    for seed in (1, 2):
        try:
            cross, views = cross_layer_tensor(case, layers, NB, block, heads, head, cache_dtype_str=cache_dtype)
        except NotUsedByVllm as e:  # pragma: no cover - vLLM decides this, and it does use one for these two
            pytest.fail(f"vLLM would not allocate a cross-layer cache for {case.id}: {e}")  # type: ignore[attr-defined]
        logical = cross_layer_logical(cross, case.cls)  # type: ignore[attr-defined]
        for i, view in enumerate(views):  # the connector reads exactly the views vLLM hands register_kv_caches
            assert (logical[i].data_ptr(), logical[i].stride()) == (view.data_ptr(), view.stride())
        fill(cross, seed)
        caches.append({f"layer.{i}": logical[i] for i in range(layers)})
    family = family_of(case)
    spec = spec_for(family, block, heads, head, str(caches[0]["layer.0"].dtype).removeprefix("torch."), layers)
    layout = layout_for_backend(case.cls, family, head, block, "x", cache_dtype)  # type: ignore[attr-defined]
    manifests = [Manifest(f"e{i}", 0, 1, "cpu", spec, {family: layout.name},
                          tuple(regions_from_tensors(spec, c, layout))) for i, c in enumerate(caches)]
    src_ids, dst_ids = np.array([3, 9, 1, 17]), np.array([5, 0, 22, 11])
    tokens = len(src_ids) * block
    plan = plan_transfer(manifests[0], manifests[1], {0: src_ids}, {0: dst_ids}, {0: tokens}).plan
    assert len(plan) == len(src_ids)  # one range per block, all layers in it
    get_backend("cpu").execute(plan)
    for i in range(layers):
        src, dst = caches[0][f"layer.{i}"], caches[1][f"layer.{i}"]
        assert torch.equal(dst[torch.as_tensor(dst_ids)].view(torch.uint8), src[torch.as_tensor(src_ids)].view(torch.uint8))


ASCEND = [b for b in vllm_ascend_shapes.ASCEND_BACKENDS
          if b.handed in (vllm_ascend_shapes.GQA_KV, vllm_ascend_shapes.MLA_NOPE_ROPE)]


@pytest.mark.parametrize("backend", ASCEND, ids=lambda b: b.id)
def test_vllm_ascend_tuples_are_served_with_torch_exact_regions_as_its_runner_allocates_them(backend: object) -> None:
    """vllm-ascend hands ``(k, v)`` or ``(nope, rope)``: separate allocations, each a 2 MiB-aligned view into a
    slightly larger buffer, block size 128 (tests/vllm/vllm_ascend_shapes.py cites its model runner)."""
    mla = backend.handed == vllm_ascend_shapes.MLA_NOPE_ROPE  # type: ignore[attr-defined]
    value = vllm_ascend_shapes.ascend_kv_caches(backend, NB, heads=4, head_size=64)  # type: ignore[arg-type]
    for t in value:
        fill(t, seed=len(t.shape))
    bs = value[0].shape[1]
    layout = "mla_split" if mla else "split_kv"
    if mla:
        spec = spec_for("mla", bs, 1, value[0].shape[-1] + value[1].shape[-1], "bfloat16")
    else:
        spec = spec_for("gqa", bs, 4, 64, "bfloat16")
    with pytest.raises(LayoutError, match="uncovered"):  # an aligned view leaves up to 2 MiB unused...
        check_whole_allocations({"layer.0": value})
    check_whole_allocations({"layer.0": value}, slack=2 << 20)  # ...which the npu backend's alignment allows
    regions = regions_from_tensors(spec, {"layer.0": value}, layout)
    for b in (0, 7, NB - 1):
        for region, t in zip(regions, value):
            got = region_slots(region, b, t.dtype)
            (slot,) = got
            assert torch.equal(got[slot].contiguous().view(torch.uint8), t[b].contiguous().view(torch.uint8))


layout_api = pytest.mark.skipif(api_generation() != "layout", reason="vLLM 0.27 has a shape function per backend: "
                                "the tests above check it")


@layout_api
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
@pytest.mark.parametrize("memory", ["NHD", "HND"])
def test_033_every_attention_backends_layers_are_read_from_their_views_or_refused_by_name(
    case: object, memory: str
) -> None:
    """vLLM 0.33: every layer is a ``[B, H, N, C]`` view into one allocation for all layers, in the one layout
    the engine resolved; kvplane reads each family's layout from the first layer's view."""
    family = family_of(case)
    built = None
    for block, heads, head, cache_dtype in sorted(parameter_grid(case), key=lambda p: (p[3] != "auto", p[1] == 1)):  # type: ignore[arg-type]
        try:
            built = layer_kv_caches(case, 3, NB, block, heads, head, cache_dtype_str=cache_dtype, layout=memory)
            break
        except Exception:  # noqa: BLE001 - vLLM refuses this combination: try the next
            continue
    if built is None:  # vLLM itself allocates this backend only in other layouts (its supported_kv_cache_layouts)
        pytest.skip(f"vLLM {vllm_version()} allocates no {memory} cache for {case.id} over the grid")  # type: ignore[attr-defined]
    caches = built
    first = caches["layer.0"]
    spec = spec_for(family, block, heads, head, str(first.dtype).removeprefix("torch."), layers=3)
    found = matching_layouts(spec, "layer.0", first)
    if not found:
        with pytest.raises(LayoutError, match=rf"{case.qualname}.*shape.*match no kvplane layout"):  # type: ignore[attr-defined]
            WorkerSide._layout_of_tensor(spec, "layer.0", first, case.cls)  # type: ignore[attr-defined]
        return
    assert len(found) == 1, f"{case.id}: ambiguous layouts {[f.name for f in found]}"  # type: ignore[attr-defined]
    check_whole_allocations(caches)  # the views together cover the one allocation
    for t in caches.values():
        fill(t, seed=3)
    regions = regions_from_tensors(spec, caches, found[0])
    for layer, region in zip(spec.layers, regions):
        t = caches[layer.name]
        for b in (0, 5, NB - 1):
            want = reference_slots(t if t.dim() != 4 or family == "gqa" else t[:, 0], b, spec)
            got = region_slots(region, b, t.dtype)
            for slot in want:
                assert torch.equal(got[slot].contiguous().view(torch.uint8), want[slot].contiguous().view(torch.uint8))
