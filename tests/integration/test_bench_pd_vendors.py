"""The cross-vendor P/D bench row runs end to end: a prefill holding the Ascend backend's caches (split, 128-token
blocks) feeding a decode holding the cuda backend's (packed, 16-token blocks) moves verified bytes through real sides
and engines, staged and re-laid out, beside a same-vendor pair in the same run (no timing is asserted)."""

from __future__ import annotations

import pytest

from kvplane.backend import get_backend
from kvplane.bench import pd_vendors, scenarios
from kvplane.bench.table import label

pytestmark = pytest.mark.integration
TOKENS = 300  # three 128-token npu blocks, nineteen 16-token cuda blocks


def test_the_default_run_has_a_cross_vendor_row_beside_the_same_vendor_flow_rows() -> None:
    names = [s.name for s in scenarios.default() if s.kind == "pd"]
    assert "pd-vendors-mooncake-qwen3-0.6b-pull" in names and "pd-flow-mooncake-qwen3-0.6b-pull" in names


@pytest.mark.parametrize("engine,model,mode", [("mooncake", "deepseek-v3", "push"), ("nixl", "qwen3-0.6b", "pull")])
def test_the_cross_vendor_pair_moves_verified_bytes_staged_and_reports_them_against_the_same_vendor_pair(
        engine: str, model: str, mode: pd_vendors.Mode) -> None:
    try:
        r = pd_vendors.run(get_backend("cpu"), engine, model, mode, TOKENS, "row")
    finally:
        pd_vendors.close_all()
    assert r.verified and r.kind == "pd" and r.backend == "cpu"
    assert "split_kv" in r.params["prefill"] or "mla_split" in r.params["prefill"]
    # split against packed differs within a block: whole source blocks are staged, none moves directly
    per_token = {"deepseek-v3": 61 * 576 * 2, "qwen3-0.6b": 28 * 2 * 8 * 128 * 2}[model]
    assert r.params["direct_bytes"] == 0 and r.params["staged_bytes"] == 3 * 128 * per_token == r.bytes
    assert 0 < r.descriptors and 0 < r.params["same_vendor_descriptors"]
    assert r.reps >= 5 and r.seconds > 0 and r.params["same_vendor_ms"] > 0 and r.ratio > 0
    assert label(r) == f"{'dsv3' if model == 'deepseek-v3' else 'qwen3'} {engine} {mode} x-vendor"  # apart from pd-flow's
