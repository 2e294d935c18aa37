"""Cross-layer bench rows: the bench's cross-layer caches are vLLM's (``allocate_cross_layer``) on a backend's
memory, their rows sit beside the per-layer ones, plans between them are one descriptor per block while the
baseline keeps one per layer and block, and the table tells the two rows apart. No transfer engine runs here."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvplane.backend import get_backend
from kvplane.bench import scenarios
from kvplane.bench.block_ids import per_block_plan
from kvplane.bench.models import model_spec
from kvplane.bench.peer import KVBuffer
from kvplane.bench.results import make_result
from kvplane.bench.table import label
from kvplane.bench.timing import Samples
from kvplane.kv.binding import allocate_cross_layer, regions_from_tensors
from kvplane.plan.planner import plan_transfer

CASES = [("qwen3-0.6b", "packed_kv"), ("deepseek-v3", "mla_fused")]


@pytest.mark.parametrize("model, layout", CASES)
def test_a_cross_layer_buffer_has_vllms_layout_on_the_backends_memory(model: str, layout: str) -> None:
    spec = model_spec(model, 16)
    kv = KVBuffer(spec, layout, 6, get_backend("cpu").alloc_host, cross_layer=True)
    cross, views = allocate_cross_layer(spec, layout, 6, zero=False)
    want = regions_from_tensors(spec, views, layout)
    shift = kv.buffer.data_ptr() - cross.data_ptr()
    assert [(r.addr + shift, r.block_stride, r.block_bytes) for r in want] == [
        (r.addr, r.block_stride, r.block_bytes) for r in kv.regions]
    assert kv.buffer.numel() == cross.numel() * cross.element_size()  # one allocation, every layer in it


def test_a_cross_layer_buffer_fills_and_digests_every_layer_through_its_views() -> None:
    spec = model_spec("qwen3-0.6b", 16)
    a = KVBuffer(spec, "packed_kv", 4, get_backend("cpu").alloc_host, cross_layer=True)
    b = KVBuffer(spec, "packed_kv", 4, get_backend("cpu").alloc_host, cross_layer=True)
    a.fill(1)
    b.buffer.zero_()
    name = spec.layer_names[5]
    b.cache[name][2].copy_(a.cache[name][2])  # type: ignore[index]
    assert a.digest(np.array([2])) != b.digest(np.array([2]))  # the other layers of block 2 still differ
    for layer in spec.layer_names:
        b.cache[layer][2].copy_(a.cache[layer][2])  # type: ignore[index]
    assert a.digest(np.array([2])) == b.digest(np.array([2]))
    assert torch.equal(b.buffer.view(torch.int64)[: 8], torch.zeros(8, dtype=torch.int64))  # block 0 untouched


@pytest.mark.parametrize("model, layout", CASES)
def test_kvplane_moves_one_descriptor_per_block_and_the_baseline_one_per_layer_and_block(model: str, layout: str) -> None:
    spec = model_spec(model, 16)
    a, b = (KVBuffer(spec, layout, 40, get_backend("cpu").alloc_host, cross_layer=True) for _ in range(2))
    rng = np.random.default_rng(0)
    src, dst = rng.choice(40, 20, replace=False), rng.choice(40, 20, replace=False)
    ma, mb = a.manifest("p", 0, 1, "cpu"), b.manifest("d", 0, 1, "cpu")
    plan = plan_transfer(ma, mb, {0: src}, {0: dst}, {0: 20 * 16}).plan
    raw = per_block_plan(ma.regions, src, mb.regions, dst)
    assert len(plan) <= 20 and len(raw) == 20 * len(ma.regions)
    assert plan.total_bytes == raw.total_bytes == 20 * 16 * spec.bytes_per_token


def test_cross_layer_rows_sit_beside_the_per_layer_rows_of_the_same_run() -> None:
    default, full = [s.name for s in scenarios.default()], [s.name for s in scenarios.full()]
    for m in scenarios.MODELS:
        for d in ("store", "load"):
            assert full.index(f"offload-{m}-{d}{scenarios.XL}") > full.index(f"offload-{m}-{d}")
    for d in ("store", "load"):
        assert default.index(f"offload-deepseek-v3-{d}{scenarios.XL}") > default.index(f"offload-deepseek-v3-{d}")
    for e in scenarios.ENGINES:
        assert f"pd-flow-{e}-qwen3-0.6b-pull{scenarios.XL}" in default
    for e in scenarios.ENGINES:  # the 2x goal: 10k tokens of Qwen3 between processes, per engine
        assert f"pd-{e}-qwen3-0.6b-read{scenarios.XL}" in full and f"pd-{e}-qwen3-0.6b-read" in full
    assert all(s.params.get("cross_layer") for s in scenarios.full() if s.name.endswith(scenarios.XL))


def test_the_table_labels_a_cross_layer_row_apart_from_its_per_layer_twin() -> None:
    samples = Samples([0.1] * 5, [0.1] * 5, [0.01] * 5)

    def row(cache: str) -> str:
        return label(make_result("pd-nixl-qwen3-0.6b-read", "pd", "cpu", "nixl", 1, samples, "raw", True, 1,
                                 {"model": "qwen3-0.6b", "op": "READ", "cache": cache}))

    assert row("cross-layer") == "qwen3 nixl read xl" and row("per-layer") == "qwen3 nixl read"
