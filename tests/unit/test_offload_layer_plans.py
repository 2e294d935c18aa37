"""``LayerPlanner`` builds every layer's plan in one pass and must give exactly ``block_copy_plan``'s plans."""

from __future__ import annotations

import numpy as np
import pytest
from offload_fakes import Harness, small_spec

from kvplane.errors import PlanError
from kvplane.flows.offload.layer_plans import LayerPlanner
from kvplane.kv.spec import KVSpec
from kvplane.plan.local import block_copy_plan

LAYOUTS = [("gqa", "packed_kv"), ("gqa", "split_kv"), ("gqa", "kv_first"), ("mla", "mla_fused"), ("mla", "mla_split")]


def harness(family: str, layout: str) -> Harness:
    spec = small_spec(layers=4) if family == "gqa" else KVSpec.mla(4, kv_lora_rank=16, rope_dim=8, tokens_per_block=2)
    return Harness(spec, host_blocks=32, device_blocks=64, layouts=layout)


@pytest.mark.parametrize(("family", "layout"), LAYOUTS)
@pytest.mark.parametrize("ids", ["scattered", "runs", "one"])
def test_every_layers_plan_equals_block_copy_plan(family: str, layout: str, ids: str) -> None:
    h = harness(family, layout)
    rng = np.random.default_rng(7)
    if ids == "scattered":
        device, host = rng.choice(64, 20, replace=False), rng.choice(32, 20, replace=False)
    elif ids == "runs":  # contiguous on both sides: descriptors coalesce, but never across a layer
        device, host = np.r_[10:20, 40:45], np.r_[0:10, 20:25]
    else:
        device, host = np.array([5]), np.array([31])
    device, host = device.astype(np.int64), host.astype(np.int64)
    c = h.engine.copier
    layers = h.spec.layer_names
    saves = LayerPlanner(layers, c.device_regions, c.host_regions).plans(device, host)
    loads = LayerPlanner(layers, c.host_regions, c.device_regions).plans(host, device)
    for name in layers:
        for got, want in (
            (saves[name], block_copy_plan(c.device_regions[name], device, c.host_regions[name], host)),
            (loads[name], block_copy_plan(c.host_regions[name], host, c.device_regions[name], device)),
        ):
            assert np.array_equal(got.src, want.src)
            assert np.array_equal(got.dst, want.dst)
            assert np.array_equal(got.length, want.length)


def test_out_of_range_ids_and_unpaired_counts_are_plan_errors() -> None:
    h = harness("gqa", "packed_kv")
    c = h.engine.copier
    planner = LayerPlanner(h.spec.layer_names, c.device_regions, c.host_regions)
    with pytest.raises(PlanError, match="destination block id 32 is out of range"):
        planner.plans(np.array([1], dtype=np.int64), np.array([32], dtype=np.int64))
    with pytest.raises(PlanError, match="2 source block ids but 1 destination ids"):
        planner.plans(np.array([1, 2], dtype=np.int64), np.array([3], dtype=np.int64))
    empty = planner.plans(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))
    assert all(len(p) == 0 for p in empty.values())
