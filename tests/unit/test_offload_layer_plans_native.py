"""``LayerPlanner``'s native pass (``plan_blocks`` in ``kvplane/_native/memcpy.c``) and its numpy fallback give
the same plan and the same layer bounds, for every layout and for scattered, consecutive and whole-cache ids
(where a layer's last block can sit right before the next row's first)."""

from __future__ import annotations

import numpy as np
import pytest
from offload_fakes import Harness, small_spec

import kvplane.flows.offload.layer_plans as layer_plans
from kvplane.descriptors import CopyPlan
from kvplane.flows.offload.layer_plans import LayerPlanner
from kvplane.kv.spec import KVSpec

LAYOUTS = [("gqa", "packed_kv"), ("gqa", "split_kv"), ("gqa", "kv_first"), ("mla", "mla_fused"), ("mla", "mla_split")]


def ids_for(kind: str, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    if kind == "scattered":
        return rng.choice(64, 20, replace=False), rng.choice(32, 20, replace=False)
    if kind == "runs":
        return np.r_[10:20, 40:45], np.r_[0:10, 20:25]
    return np.arange(32), np.arange(32)  # every host block in order: rows can touch across their boundary


@pytest.mark.skipif(layer_plans._native is None, reason="the C extension is not built")
@pytest.mark.parametrize(("family", "layout"), LAYOUTS)
@pytest.mark.parametrize("kind", ["scattered", "runs", "whole"])
def test_native_and_numpy_planners_agree(family: str, layout: str, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = small_spec(layers=4) if family == "gqa" else KVSpec.mla(4, kv_lora_rank=16, rope_dim=8, tokens_per_block=2)
    h = Harness(spec, host_blocks=32, device_blocks=64, layouts=layout)
    device, host = (a.astype(np.int64) for a in ids_for(kind, np.random.default_rng(3)))
    c = h.engine.copier
    planner = LayerPlanner(h.spec.layer_names, c.host_regions, c.device_regions)
    native_plan, native_bounds = planner.parts(host, device)
    monkeypatch.setattr(layer_plans, "_native", None)
    numpy_plan, numpy_bounds = planner.parts(host, device)
    assert native_bounds == numpy_bounds
    for field in ("src", "dst", "length"):
        assert np.array_equal(getattr(native_plan, field), getattr(numpy_plan, field))


@pytest.mark.skipif(layer_plans._native is None, reason="the C extension is not built")
@pytest.mark.parametrize(("family", "layout"), LAYOUTS)
def test_native_plans_pass_the_copy_plan_checks_they_skip(family: str, layout: str) -> None:
    spec = small_spec(layers=4) if family == "gqa" else KVSpec.mla(4, kv_lora_rank=16, rope_dim=8, tokens_per_block=2)
    h = Harness(spec, host_blocks=32, device_blocks=64, layouts=layout)
    device, host = (a.astype(np.int64) for a in ids_for("scattered", np.random.default_rng(5)))
    c = h.engine.copier
    plan, _ = LayerPlanner(h.spec.layer_names, c.host_regions, c.device_regions).parts(host, device)
    checked = CopyPlan(plan.src, plan.dst, plan.length)  # raises where CopyPlan would have refused the plan
    for field in ("src", "dst", "length"):
        arr = getattr(plan, field)
        assert arr.dtype == np.int64 and arr.ndim == 1 and arr.flags.c_contiguous
        assert getattr(checked, field) is arr  # nothing was copied to make it contiguous
    assert len(plan) and int(plan.length.min()) > 0
