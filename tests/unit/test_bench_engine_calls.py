"""The engine-call latency scenario (issue 12): registered in ``--full`` for both engines, reported like every row."""

from __future__ import annotations

import json
from pathlib import Path

from kvplane.bench import scenarios
from kvplane.bench.engine_calls import percentile
from kvplane.bench.results import make_result, write_json
from kvplane.bench.table import WIDTH, render
from kvplane.bench.timing import Samples


def test_full_runs_get_finished_latency_during_a_transfer_for_nixl_and_mooncake() -> None:
    calls = [s for s in scenarios.full() if s.kind == "calls"]
    assert sorted(s.params["engine"] for s in calls) == ["mooncake", "nixl"]
    assert {s.name for s in calls} == {"calls-mooncake-get_finished", "calls-nixl-get_finished"}
    assert [s.name for s in scenarios.select(["calls-nixl-get_finished"], full_run=True)] == [
        "calls-nixl-get_finished"]


def test_a_calls_row_has_the_keys_of_every_row_and_prints_in_ms_within_the_table_width(tmp_path: Path) -> None:
    samples = Samples([2e-5, 3e-5, 1e-5, 2e-5, 4e-5], [1e-5] * 5, [5e-6] * 5)
    row = make_result("calls-nixl-get_finished", "calls", "cpu", "nixl", 2 << 30, samples,
                      "get_finished, nothing in flight", True, 0,
                      {"engine": "nixl", "mode": "get_finished", "p99_ms": 0.04, "note": "p99 0.04 ms"})
    write_json(str(tmp_path / "b.json"), {}, [row])
    written = json.loads((tmp_path / "b.json").read_text())["results"][0]
    assert {"descriptors", "cpu_seconds", "reps", "spread", "ratio", "params"} <= set(written)
    assert written["reps"] == 5 and written["spread"]["baseline_min_s"] == 1e-5
    text = render([row], "t")
    assert "calls:" in text and "nixl get_finished" in text
    assert all(len(line) <= WIDTH for line in text.splitlines())


def test_percentiles_of_no_calls_are_nan_not_an_error() -> None:
    assert percentile([], 99) != percentile([], 99)
    assert percentile([1.0, 2.0, 3.0], 50) == 2.0
