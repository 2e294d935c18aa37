"""The between-processes P/D bench rows for NIXL (``pd.run_pd``) move kvplane's plan through prepared
descriptor lists and, in the same reps, unprepared, and report both beside the raw engine (no timing is
asserted)."""

from __future__ import annotations

import pytest

from kvplane.backend import get_backend
from kvplane.bench import pd
from kvplane.transports.nixl import NixlTransport

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("cross_layer", [False, True], ids=["per-layer", "cross-layer"])
def test_a_nixl_pd_row_reports_prepared_and_unprepared_runs_of_the_same_plan(cross_layer: bool) -> None:
    ok, why = NixlTransport.available()
    if not ok:
        pytest.skip(f"nixl is not usable here: {why}")
    try:
        r = pd.run_pd(get_backend("cpu"), "nixl", "qwen3-0.6b", "READ", quick=True, cross_layer=cross_layer)
    finally:
        pd.close_all()
    assert r.verified
    p = r.params
    paths = p["prep_paths"]
    assert paths["preps"] == 1 and paths["prepped"] == r.reps + 1  # the first, verified transfer and each rep
    assert paths["unprepped"] == r.reps and paths["reasons"] == {"disabled": r.reps}
    assert p["unprepped_ms"] > 0 and p["prepped_speedup"] > 0 and p["first_request_ms"] > 0
    assert set(p["make_ms_per_request"]) == {"prepped", "unprepped"}


@pytest.mark.parametrize("engine", ["mooncake", "nixl"])
def test_a_cross_layer_pd_row_reports_the_raw_engine_moving_kvplanes_own_descriptors(engine: str) -> None:
    from kvplane.transports.registry import get_transport_class

    ok, why = get_transport_class(engine).available()
    if not ok:
        pytest.skip(f"{engine} is not usable here: {why}")
    try:
        r = pd.run_pd(get_backend("cpu"), engine, "qwen3-0.6b", "READ", quick=True, cross_layer=True)
    finally:
        pd.close_all()
    p = r.params
    assert r.verified and p["raw_same_plan_ms"] > 0
    ours_s, raw_s = r.spread["median_s"], r.spread["baseline_median_s"]
    assert p["engine_gain"] == pytest.approx(raw_s * 1e3 / p["raw_same_plan_ms"], rel=0.01)
    assert p["of_ceiling"] == pytest.approx(p["raw_same_plan_ms"] / (ours_s * 1e3), rel=0.01)
    assert "the raw engine moving kvplane's descriptors" in p["note"]


def test_a_per_layer_row_has_no_ceiling_run() -> None:
    ok, why = NixlTransport.available()
    if not ok:
        pytest.skip(f"nixl is not usable here: {why}")
    try:
        r = pd.run_pd(get_backend("cpu"), "nixl", "qwen3-0.6b", "READ", quick=True)
    finally:
        pd.close_all()
    assert "raw_same_plan_ms" not in r.params and "note" not in r.params
