"""Cross-layer caches (vLLM's one tensor for all layers): per-layer views read like per-layer tensors, and plans
between two of them move one descriptor per block for all layers. Caches here are allocated with ``zero=False``
(address space, no pages touched), so 10k tokens of Qwen3-0.6B cost nothing to plan."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvplane.backend import get_backend
from kvplane.kv.binding import allocate_cache, allocate_cross_layer, regions_from_tensors
from kvplane.kv.manifest import Manifest
from kvplane.kv.spec import KVSpec
from kvplane.plan import block_copy_plan
from kvplane.plan.planner import plan_transfer

QWEN3 = KVSpec.gqa(28, 8, 128, tokens_per_block=16)
DEEPSEEK_V3 = KVSpec.mla(61, tokens_per_block=16)


def manifest(spec: KVSpec, cache: dict, layout: str, engine: str) -> Manifest:
    return Manifest(engine, 0, 1, "cpu", spec, {spec.layers[0].family: layout},
                    tuple(regions_from_tensors(spec, cache, layout)))


@pytest.mark.parametrize("spec, layout", [(QWEN3, "packed_kv"), (DEEPSEEK_V3, "mla_fused")], ids=["qwen3", "dsv3"])
def test_ten_thousand_tokens_between_cross_layer_caches_are_one_descriptor_per_block(spec: KVSpec, layout: str) -> None:
    tokens, blocks = 10_000, 625
    rng = np.random.default_rng(1)
    src_ids, dst_ids = rng.choice(2 * blocks, blocks, replace=False), rng.choice(2 * blocks, blocks, replace=False)
    (_, a), (_, b) = (allocate_cross_layer(spec, layout, 2 * blocks, zero=False) for _ in range(2))
    plan = plan_transfer(manifest(spec, a, layout, "a"), manifest(spec, b, layout, "b"),
                         {0: src_ids}, {0: dst_ids}, {0: tokens}).plan
    assert len(plan) <= blocks
    assert plan.total_bytes == tokens * spec.bytes_per_token


def test_cross_layer_views_copy_block_for_block_like_torch_and_merge_layers() -> None:
    spec = KVSpec.gqa(3, 2, 8, tokens_per_block=4, dtype="float32")
    src_cross, src = allocate_cross_layer(spec, "packed_kv", 10)
    dst_cross, dst = allocate_cross_layer(spec, "packed_kv", 10)
    src_cross.copy_(torch.randn(src_cross.shape))
    src_ids, dst_ids = np.array([7, 2, 5]), np.array([0, 9, 4])
    plan = block_copy_plan(regions_from_tensors(spec, src, "packed_kv"), src_ids,
                           regions_from_tensors(spec, dst, "packed_kv"), dst_ids)
    assert len(plan) == 3  # one per block, all layers in it
    get_backend("cpu").execute(plan)
    assert torch.equal(dst_cross[torch.as_tensor(dst_ids)], src_cross[torch.as_tensor(src_ids)])
    for name in spec.layer_names:
        assert torch.equal(dst[name][torch.as_tensor(dst_ids)], src[name][torch.as_tensor(src_ids)])


def test_a_cross_layer_cache_and_a_per_layer_cache_exchange_the_same_bytes() -> None:
    spec = KVSpec.gqa(3, 2, 8, tokens_per_block=4, dtype="float32")
    cross_tensor, cross = allocate_cross_layer(spec, "packed_kv", 10)
    cross_tensor.copy_(torch.randn(cross_tensor.shape))
    per_layer = allocate_cache(spec, "packed_kv", 10)
    src_ids, dst_ids = np.array([1, 8]), np.array([3, 6])
    plan = plan_transfer(manifest(spec, cross, "packed_kv", "x"), manifest(spec, per_layer, "packed_kv", "p"),
                         {0: src_ids}, {0: dst_ids}, {0: 8}).plan
    assert len(plan) == len(spec.layers) * len(src_ids)  # the per-layer side takes one descriptor per layer and block
    get_backend("cpu").execute(plan)
    for name in spec.layer_names:
        assert torch.equal(per_layer[name][torch.as_tensor(dst_ids)], cross[name][torch.as_tensor(src_ids)])
