"""The planner's two ways to the same plan: the native pass (whole blocks, layers apart) and numpy, and its
per-manifest-pair pairing memo, which must never serve one manifest's pairing for another."""

from __future__ import annotations

import numpy as np
import pytest

from kvplane.bench.models import model_spec
from kvplane.bench.plan_build import synthetic_manifest
from kvplane.plan import pairing
from kvplane.plan.planner import plan_transfer


@pytest.mark.parametrize("model, layout", [("qwen3-0.6b", "split_kv"), ("deepseek-v3", "mla_split")])
@pytest.mark.parametrize("runs", [False, True], ids=["scatter", "runs"])
def test_the_native_pass_and_numpy_give_the_same_plan(model: str, layout: str, runs: bool,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    if pairing._native is None or not hasattr(pairing._native, "plan_blocks"):
        pytest.skip("the C extension is not built (python setup.py build_ext --inplace)")
    spec = model_spec(model, 16)
    src, dst = synthetic_manifest(spec, layout, 200, 1 << 40), synthetic_manifest(spec, layout, 200, 1 << 46)
    rng = np.random.default_rng(4)
    s_ids = np.arange(30, 130, dtype=np.int64) if runs else rng.choice(200, 100, replace=False).astype(np.int64)
    d_ids = np.arange(60, 160, dtype=np.int64) if runs else rng.choice(200, 100, replace=False).astype(np.int64)
    native = plan_transfer(src, dst, {0: s_ids}, {0: d_ids}, {0: 1600}).plan
    monkeypatch.setattr(pairing, "_native", None)
    numpy = plan_transfer(src, dst, {0: s_ids}, {0: d_ids}, {0: 1600}).plan
    for field in ("src", "dst", "length"):
        np.testing.assert_array_equal(getattr(native, field), getattr(numpy, field))
    assert native.total_bytes == 1600 * spec.bytes_per_token
    assert (len(native) < 100 * len(src.regions)) is runs  # consecutive ids coalesce, scattered ones do not


def test_a_pairing_is_reused_only_for_the_very_manifests_it_was_built_from() -> None:
    spec = model_spec("qwen3-0.6b", 16)
    ids = {0: np.arange(4, dtype=np.int64)}
    a_src, a_dst = synthetic_manifest(spec, "split_kv", 8, 1 << 40), synthetic_manifest(spec, "split_kv", 8, 1 << 46)
    first = plan_transfer(a_src, a_dst, ids, ids, {0: 64}).plan
    assert pairing.pairing(a_src, a_dst, None) is pairing.pairing(a_src, a_dst, None)
    del a_src
    b_src = synthetic_manifest(spec, "split_kv", 8, 1 << 42)  # may reuse the freed manifest's id
    second = plan_transfer(b_src, a_dst, ids, ids, {0: 64}).plan
    assert int(second.src.min()) >= 1 << 42 > int(first.src.max())
