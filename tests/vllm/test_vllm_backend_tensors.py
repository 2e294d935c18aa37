"""The vLLM KV-tensor helper (``vllm_kv_tensors``) checked against vLLM itself: every backend class the installed
vLLM ships is found and accounted for, and the tensors the helper builds are the ones vLLM's own allocation code
builds (same shape, strides and bytes), per layer and cross-layer, NHD and HND.

The kvplane assertions (regions against torch indexing) are built on top of this helper elsewhere.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the vLLM backend tests need vLLM: pip install --no-deps vllm==0.27.1 + .[vllm]")

import torch  # noqa: E402
import vllm_kv_tensors as vkt  # noqa: E402

SHAPE_API = vkt.api_generation() == "shape"
# vLLM <= 0.27.x: per-backend get_kv_cache_shape, compared with vLLM's own _reshape_attention_kv_cache /
# allocate_uniform_kv_caches. vLLM 0.33.0 removed both (one KVCacheLayout, views from allocate_kv_cache).
shape_api = pytest.mark.skipif(not SHAPE_API, reason=f"vLLM {vkt.vllm_version()} has no get_kv_cache_shape")
layout_api = pytest.mark.skipif(SHAPE_API, reason=f"vLLM {vkt.vllm_version()} has get_kv_cache_shape, no KVCacheLayout")

CASES = vkt.attention_backends()
CROSS_CASES = [c for c in CASES if vkt.uses_cross_layer(c) is None]
NO_CROSS_CASES = [c for c in CASES if vkt.uses_cross_layer(c) is not None]
NUM_BLOCKS = 3


def _ids(cases: list[vkt.BackendCase]) -> list[str]:
    return [c.id for c in cases]


def _sample_params(case: vkt.BackendCase) -> list[tuple[int, int, int, str]]:
    """A few accepted parameter sets per case (vLLM's own supports_* say accepted), covering small and large blocks,
    one and several heads, a head size that is not a multiple of 16, and every cache dtype the class lists."""
    grid = [p for p in vkt.parameter_grid(case) if vkt.accepted(case.cls, p[0], p[2], p[3])]
    picked: dict[Any, tuple[int, int, int, str]] = {}
    for p in grid:
        picked.setdefault((p[0] in (16, 64), p[1], p[2]), p)
        picked.setdefault(("dtype", p[3]), p)
    return [p for p in picked.values() if _shape_or_none(case, p) is not None]


def _shape_or_none(case: vkt.BackendCase, p: tuple[int, int, int, str]) -> tuple[int, ...] | None:
    try:
        return vkt.kv_cache_shape(case.cls, NUM_BLOCKS, p[0], p[1], p[2], p[3])
    except Exception:  # noqa: BLE001 - refusals are checked in test_refusals_carry_vllms_own_message
        return None


def _spec(case: vkt.BackendCase, block_size: int, heads: int, head_size: int, dtype: torch.dtype) -> Any:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    if vkt.is_row_cache(case):
        return MLAAttentionSpec(block_size, num_kv_heads=heads, head_size=head_size, dtype=dtype)
    return FullAttentionSpec(
        block_size, num_kv_heads=heads, head_size=head_size, dtype=dtype,
        head_size_v=getattr(case.cls, "head_size_v", head_size),
    )


def _same_view(a: torch.Tensor, b: torch.Tensor) -> None:
    assert (a.shape, a.stride(), a.dtype, a.storage_offset()) == (b.shape, b.stride(), b.dtype, b.storage_offset())
    assert a.untyped_storage().nbytes() == b.untyped_storage().nbytes()


def test_every_discovered_backend_class_is_built_or_has_a_recorded_reason() -> None:
    cases = vkt.discover()
    assert cases, "no backend class found: vllm.v1.attention.backends did not walk"
    kinds = {vkt.KV, vkt.NOT_KV, vkt.ABSTRACT, vkt.IMPORT_FAILED}
    for case in cases:
        assert case.kind in kinds, case
        if case.kind == vkt.KV:
            assert case.cls is not None and case.name, case
        else:
            assert case.error, f"{case.id} is {case.kind} without a reason"


def test_discovery_finds_the_backends_kvplane_must_serve() -> None:
    found = {c.id: c for c in vkt.discover()}
    for must in ("flash_attn.FlashAttentionBackend", "triton_attn.TritonAttentionBackend",
                 "flex_attention.FlexAttentionBackend", "rocm_attn.RocmAttentionBackend",
                 "hpc_attn.HpcAttentionBackend", "mla.triton_mla.TritonMLABackend", "mla.flashmla.FlashMLABackend",
                 "mla.flashmla_sparse.FlashMLASparseBackend", "mla.indexer.DeepseekV32IndexerBackend",
                 "mla.sparse_swa.DeepseekSparseSWABackend"):
        assert found[must].kind == vkt.KV, found[must]
    flashinfer = [c for c in vkt.discover() if c.module.endswith(".flashinfer")]
    assert flashinfer and all(c.kind in (vkt.KV, vkt.IMPORT_FAILED) for c in flashinfer), flashinfer
    mamba = [c for c in vkt.discover() if "mamba" in c.module]
    assert mamba and all(c.kind == vkt.NOT_KV for c in mamba), mamba


@shape_api
@pytest.mark.parametrize("layout", vkt.LAYOUTS)
@pytest.mark.parametrize("case", CASES, ids=_ids(CASES))
def test_kv_tensor_is_what_vllms_reshape_attention_kv_cache_builds(case: vkt.BackendCase, layout: str) -> None:
    from vllm.v1.worker.gpu.attn_utils import _reshape_attention_kv_cache

    params = _sample_params(case)
    assert params, f"{case.id}: no parameter set that vLLM accepts and builds"
    for bs, heads, head, cdt in params:
        ours = vkt.kv_tensor(case, NUM_BLOCKS, bs, heads, head, cache_dtype_str=cdt, layout=layout)
        with vkt.kv_cache_layout(layout):
            shape = vkt.kv_cache_shape(case.cls, NUM_BLOCKS, bs, heads, head, cdt)
            order = vkt.stride_order(case.cls, len(shape))
        raw = torch.zeros(math.prod(shape) * ours.dtype.itemsize, dtype=torch.int8)
        theirs = _reshape_attention_kv_cache(raw, _spec(case, bs, heads, head, ours.dtype), shape, order,
                                             NUM_BLOCKS, None)
        assert ours.shape == shape
        _same_view(ours, theirs)
        # memory order is one whole, dense allocation: the permuted view is contiguous and covers the storage
        assert ours.permute(*order).is_contiguous()
        assert ours.untyped_storage().nbytes() == ours.numel() * ours.element_size()


@shape_api
@pytest.mark.parametrize("layout", vkt.LAYOUTS)
@pytest.mark.parametrize("case", CROSS_CASES, ids=_ids(CROSS_CASES))
def test_cross_layer_tensor_is_what_vllms_allocate_uniform_kv_caches_builds(case: vkt.BackendCase,
                                                                             layout: str) -> None:
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheTensor
    from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

    num_layers = 3
    for bs, heads, head, cdt in _sample_params(case):
        if vkt.uses_cross_layer(case, cdt, layout) is not None:  # per-token-head quant: vLLM allocates per layer
            with pytest.raises(vkt.NotUsedByVllm, match="per-token-head"):
                vkt.cross_layer_tensor(case, num_layers, NUM_BLOCKS, bs, heads, head, cache_dtype_str=cdt)
            continue
        cross, views = vkt.cross_layer_tensor(case, num_layers, NUM_BLOCKS, bs, heads, head, cache_dtype_str=cdt,
                                              layout=layout)
        spec = _spec(case, bs, heads, head, cross.dtype)
        page = math.prod(vkt.kv_cache_shape(case.cls, 1, bs, heads, head, cdt)) * cross.element_size()
        assert spec.page_size_bytes == page, (case.id, spec.page_size_bytes, page)
        config = KVCacheConfig(
            num_blocks=NUM_BLOCKS,
            kv_cache_tensors=[KVCacheTensor(size=page * NUM_BLOCKS, shared_by=[f"layer.{i}"]) for i in range(num_layers)],
            kv_cache_groups=[],
        )
        group = SimpleNamespace(kv_cache_spec=spec, backend=case.cls)  # the two fields the function reads
        with vkt.kv_cache_layout(layout):
            theirs_views, theirs_cross, backend = KVConnectorModelRunnerMixin.allocate_uniform_kv_caches(
                config, [[group]], cdt, torch.device("cpu"), [bs]
            )
        assert backend is case.cls
        _same_view(cross, theirs_cross)
        assert cross.is_contiguous()
        logical = vkt.kv_cache_shape(case.cls, NUM_BLOCKS, bs, heads, head, cdt)
        for i, view in enumerate(views):
            assert view.shape == logical
            _same_view(view, theirs_views[f"layer.{i}"])


@pytest.mark.parametrize("case", NO_CROSS_CASES, ids=_ids(NO_CROSS_CASES))
def test_no_cross_layer_tensor_where_vllm_would_not_make_one(case: vkt.BackendCase) -> None:
    with pytest.raises(vkt.NotUsedByVllm, match="indexes_kv_by_block_stride|supported_kv_cache_layouts"):
        vkt.cross_layer_tensor(case, 2, NUM_BLOCKS, 16, 1, 64)


@shape_api
def test_nhd_cross_layer_block_of_every_layer_is_one_contiguous_range() -> None:
    case = next(c for c in CASES if c.id == "flash_attn.FlashAttentionBackend")
    layers, bs, heads, head = 4, 16, 2, 64
    cross, views = vkt.cross_layer_tensor(case, layers, NUM_BLOCKS, bs, heads, head, layout="NHD")
    assert cross.shape == (NUM_BLOCKS, layers, bs, heads, 2 * head)
    block_bytes = layers * bs * heads * 2 * head * cross.element_size()
    base = cross.data_ptr()
    for b in range(NUM_BLOCKS):
        for layer, view in enumerate(views):
            start = view[b].data_ptr() - base
            assert b * block_bytes <= start < (b + 1) * block_bytes, (b, layer)
        views[-1][b, -1, -1, -1] = 1.0  # the last element of a block is the last byte of its range
        assert cross.view(torch.int8).reshape(NUM_BLOCKS, -1)[b].view(cross.dtype)[-1] == 1.0


@shape_api
def test_kv_cache_layout_uses_and_restores_vllms_override() -> None:
    from vllm.v1.attention.backends import utils

    before = utils._KV_CACHE_LAYOUT_OVERRIDE
    with vkt.kv_cache_layout("HND"):
        assert utils.get_kv_cache_layout() == "HND"
        with vkt.kv_cache_layout("NHD"):
            assert utils.get_kv_cache_layout() == "NHD"
        assert utils.get_kv_cache_layout() == "HND"
    assert utils._KV_CACHE_LAYOUT_OVERRIDE == before
    with pytest.raises(ValueError, match="layout='XYZ'"), vkt.kv_cache_layout("XYZ"):
        pass


@shape_api
def test_backend_records_cover_every_case_and_refusals_carry_vllms_own_message() -> None:
    records = vkt.backend_records(CASES)
    assert {r.case_id for r in records} == {c.id for c in CASES}
    for r in records:
        assert (r.shape is None) == (r.error is not None), r
        if r.shape is not None:
            assert r.order_nhd is not None and sorted(r.order_nhd) == list(range(len(r.shape)))
            assert r.cross_order_nhd is not None and len(r.cross_order_nhd) == len(r.shape) + 1
    # every case builds for at least one parameter set vLLM accepts
    built = {r.case_id for r in records if r.shape is not None and r.accepted}
    assert built == {c.id for c in CASES}, {c.id for c in CASES} - built


@layout_api
@pytest.mark.parametrize("layout", vkt.LAYOUTS)
@pytest.mark.parametrize("case", CASES, ids=_ids(CASES))
def test_layer_views_follow_the_kv_cache_layout_vllm_resolves(case: vkt.BackendCase, layout: str) -> None:
    """0.33.0: each layer is a [B, H, N, C] view of one shared int8 backing; its strides follow the layout's stride
    order (vllm/v1/kv_cache_layout.py) and C is the spec's content bytes over the element size."""
    heads, head = vkt.typical_params(case)
    try:
        caches = vkt.layer_kv_caches(case, 3, NUM_BLOCKS, 64, heads, head, layout=layout)
    except vkt.NotUsedByVllm as refused:
        assert "supported_kv_cache_layouts" in str(refused)
        return
    kv_layout = vkt.layout_033(layout, cross_layer=False)
    spec = vkt.spec_033(case.cls, 64, heads, head, vkt.default_dtype(case.cls, "auto"), "auto")
    storages = {v.untyped_storage().data_ptr() for v in caches.values()}
    assert len(storages) == 1, "0.33 layers share one backing allocation"
    for view in caches.values():
        assert view.shape == (NUM_BLOCKS, spec.num_heads, 64, spec.state_content_size_bytes // view.element_size())
        physical = kv_layout.layer_view_order
        assert [view.stride(d) for d in physical] == sorted((view.stride(d) for d in physical), reverse=True)


@layout_api
@pytest.mark.parametrize("case", CROSS_CASES, ids=_ids(CROSS_CASES))
def test_block_outermost_layout_makes_a_block_of_every_layer_one_range(case: vkt.BackendCase) -> None:
    heads, head = vkt.typical_params(case)
    backing, views = vkt.cross_layer_tensor(case, 3, NUM_BLOCKS, 64, heads, head, layout="NHD")
    block_bytes = backing.numel() // NUM_BLOCKS
    for b in range(NUM_BLOCKS):
        for view in views:
            start = view[b].data_ptr() - backing.data_ptr()
            assert b * block_bytes <= start < (b + 1) * block_bytes


@pytest.mark.parametrize("case", CASES, ids=_ids(CASES))
def test_block_dim_indexes_whole_blocks_of_the_logical_tensor(case: vkt.BackendCase) -> None:
    """Torch indexing on block_dim picks one block; the lead's region checks compare against exactly this."""
    bs, heads, head, cdt = _sample_params(case)[0] if SHAPE_API else (64, *vkt.typical_params(case), "auto")
    for layout in vkt.vllm_layouts(case):
        t = vkt.kv_tensor(case, NUM_BLOCKS, bs, heads, head, cache_dtype_str=cdt, layout=layout)
        dim = vkt.block_dim(case, cdt, heads, head)
        assert t.shape[dim] == NUM_BLOCKS
        vkt.fill_distinct(t)
        blocks = [t.select(dim, b) for b in range(NUM_BLOCKS)]
        assert not torch.equal(blocks[0].to(torch.float32), blocks[1].to(torch.float32)), layout
