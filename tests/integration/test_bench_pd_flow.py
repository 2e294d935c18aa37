"""The P/D flow bench scenarios run end to end on the cpu backend: every mode moves verified bytes through
real sides and engines, and reports the figures the docs promise (no timing is asserted)."""

from __future__ import annotations

import pytest

from kvplane.backend import get_backend
from kvplane.bench import pd_flow, scenarios

pytestmark = pytest.mark.integration
TOKENS = 512  # whole 16-token blocks; the rows' figures and checks at a quarter of the quick run's size (the runner's own test runs that)


def test_every_engine_model_and_mode_is_a_default_scenario_and_runs_variants_are_in_the_full_run() -> None:
    names = {s.name for s in scenarios.default() if s.kind == "pd"}
    full = {s.name for s in scenarios.full() if s.kind == "pd"}
    for engine in pd_flow.ENGINES:
        for model in pd_flow.MODELS:
            for mode in pd_flow.MODES:
                assert f"pd-flow-{engine}-{model}-{mode}" in names
                assert f"pd-flow-{engine}-{model}-{mode}-runs" in full


@pytest.mark.parametrize("engine", pd_flow.ENGINES)
def test_each_mode_moves_verified_bytes_and_reports_its_figures(engine: str) -> None:
    cpu = get_backend("cpu")
    try:
        results = {mode: pd_flow.run_flow(cpu, engine, "deepseek-v3", mode, quick=True, tokens=TOKENS)
                   for mode in pd_flow.MODES}
    finally:
        pd_flow.close_all()
    for mode, r in results.items():
        assert r.verified, mode
        assert r.kind == "pd" and r.transport == engine and r.scenario == f"pd-flow-{engine}-deepseek-v3-{mode}"
        assert r.bytes == TOKENS * 61 * 576 * 2  # DeepSeek-V3's bf16 kv_c + k_pe, every layer
        assert r.seconds > 0 and r.baseline_gbps > 0
        assert r.params["prefill_done_to_kv_ready_ms"] > 0 and r.params["raw_ms"] > 0
        assert r.reps >= 5 and r.descriptors > 0 and r.params["baseline_descriptors"] >= r.descriptors
        # what the flow handed its engine per request: the plan for pull and push, per-layer writes for layerwise
        if mode == "layerwise":
            assert r.descriptors >= r.params["plan_descriptors"], r.params
        else:
            assert r.descriptors == r.params["plan_descriptors"], (mode, r.descriptors, r.params)
        if engine == "nixl":  # every plan of the flow went through the lists prepared for its peer
            paths = r.params["prep_paths"]
            assert paths["prepped"] > 0 and paths["unprepped"] == 0 and paths["preps"] >= 1, (mode, paths)
    lw = results["layerwise"].params
    assert 0.0 <= lw["hidden"] <= 1.0 and lw["compute_over_push"] > 0.0 and lw["push_ms"] > 0.0
    assert "hidden" in lw["note"]
    assert lw["simulated_prefill_ms"] == pytest.approx(round(470 * TOKENS / 10_000, 1))  # 470 ms per 10k tokens
    assert not pd_flow._held  # the sides were closed: their ports and engines are gone
