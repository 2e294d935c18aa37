"""The bench's report: its catalog, table, JSON, log redirection and the no-matplotlib path.

No scenario runs here (the integration tests run them); results are built by hand.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvplane.backend import get_backend
from kvplane.bench import runner, scenarios
from kvplane.bench.logs import engine_output_to
from kvplane.bench.results import BenchResult, make_result
from kvplane.bench.scenario import Scenario
from kvplane.bench.table import WIDTH, render
from kvplane.bench.timing import MIN_REPS, Samples, interleave


def result(kind: str, scenario: str, transport: str, **params: object) -> BenchResult:
    samples = Samples([0.2, 0.1, 0.3, 0.2, 0.25], [0.1, 0.1, 0.2, 0.15, 0.1], [0.01] * 5)
    note = "a long note that must go under the table rather than widen it " * 3
    return make_result(scenario, kind, "cpu", transport, 1_147_000_000, samples, "raw thing", True, 35_000,
                       {"note": note, **params})


RESULTS = [
    result("offload", "offload-qwen3-0.6b-store", "local", model="qwen3-0.6b", direction="store"),
    result("overhead", "overhead-deepseek-v3-load", "local", model="deepseek-v3", direction="load"),
    result("pd", "pd-flow-mooncake-deepseek-v3-layerwise-runs", "mooncake", model="deepseek-v3",
           mode="layerwise", blocks_pattern="runs"),
    result("store", "store-qwen3-0.6b-get", "mooncake-store", model="qwen3-0.6b", op="get"),
    result("plan", "plan-qwen3-0.6b-100k", "none", model="qwen3-0.6b", tokens=100_000),
]


def test_the_catalog_lists_each_scenario_once_and_the_default_run_is_a_subset_of_kinds_and_models() -> None:
    default, full = scenarios.default(), scenarios.full()
    for listed in (default, full):
        names = [s.name for s in listed]
        assert len(names) == len(set(names)), "a scenario is listed twice"
    kinds = {s.kind for s in default}
    assert {"offload", "overhead", "pd", "plan"} <= kinds
    assert not any(s.name.startswith("copy-") for s in default)  # the block-size sweep is --full only
    assert {s.name for s in full} >= {s.name for s in default}


def test_scenario_modules_register_nothing_on_import() -> None:
    from kvplane.bench import local_copy, offload, pd, pd_flow, plan_build, store  # noqa: F401

    assert not hasattr(scenarios, "SCENARIOS") and not hasattr(scenarios, "register")


def test_an_unknown_scenario_name_is_an_error_listing_the_known_ones() -> None:
    from kvplane.errors import KvplaneError

    with pytest.raises(KvplaneError, match=r"--scenario 'nope' is unknown; choose from: .*offload-qwen3-0.6b-store"):
        scenarios.select(["nope"])


def test_the_table_fits_100_columns_and_puts_notes_under_it() -> None:
    text = render(RESULTS, "kvplane bench - backend cpu")
    assert max(len(line) for line in text.splitlines()) <= WIDTH
    table, notes = text.split("\nnotes:\n")
    assert "a long note" not in table and "a long note" in notes
    assert "dsv3 mooncake layerwise runs" in table
    plan_row = next(line for line in table.splitlines() if line.startswith("qwen3 100k"))
    assert " - " in plan_row  # plan rows have no GB/s, only milliseconds


def test_interleave_alternates_the_two_sides_at_least_five_times() -> None:
    order: list[str] = []
    s = interleave(lambda: order.append("k"), lambda: order.append("b"), reps=2, warmup=1)
    assert s.reps == MIN_REPS and len(s.cpu) == MIN_REPS
    assert order == ["k", "b"] * (MIN_REPS + 1)


def test_the_json_keeps_its_keys_and_adds_descriptors_cpu_reps_and_spread(tmp_path: Path) -> None:
    from kvplane.bench.results import machine_info, write_json

    path = tmp_path / "b.json"
    write_json(str(path), machine_info("cpu"), RESULTS[:1])
    (r,) = json.loads(path.read_text())["results"]
    assert {"scenario", "kind", "backend", "transport", "bytes", "seconds", "gbps", "baseline", "baseline_gbps",
            "ratio", "verified", "params"} <= set(r)
    assert r["descriptors"] == 35_000 and r["reps"] == 5 and r["cpu_seconds"] == pytest.approx(0.01)
    assert r["spread"]["min_s"] == pytest.approx(0.1) and r["spread"]["baseline_median_s"] == pytest.approx(0.1)
    assert r["ratio"] == pytest.approx(0.5)


def test_without_matplotlib_the_bench_still_prints_and_writes_json_and_says_how_to_get_the_plot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(runner, "plot_available", lambda: False)
    terminal = io.StringIO()
    row = Scenario("fake", "plan", lambda backend, quick: RESULTS[-1])
    runner.run(get_backend("cpu"), [row], quick=True, json_path=str(tmp_path / "b.json"),
               plot_path=str(tmp_path / "b.png"), log_path=str(tmp_path / "b.log"), terminal=terminal)
    out = terminal.getvalue()
    assert "qwen3 100k" in out and "pip install" in out and "matplotlib" in out
    assert (tmp_path / "b.json").exists() and not (tmp_path / "b.png").exists()


def test_engine_output_from_c_threads_and_child_processes_goes_to_the_log_not_the_terminal(tmp_path: Path) -> None:
    log = tmp_path / "engines.log"
    code = f"""
import os, subprocess, sys
from kvplane.bench.logs import engine_output_to
with engine_output_to({str(log)!r}) as terminal:
    os.write(1, b"fd1 from C-level code\\n")
    os.write(2, b"fd2 from glog\\n")
    print("python print")
    subprocess.run([sys.executable, "-c", "print('child process stdout')"], check=True)
    terminal.write("the table\\n")
print("after")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ, check=True)
    assert proc.stdout == "the table\nafter\n" and proc.stderr == ""
    text = log.read_text()
    for line in ("fd1 from C-level code", "fd2 from glog", "python print", "child process stdout"):
        assert line in text


def test_the_terminal_stream_is_restored_after_an_error(tmp_path: Path) -> None:
    before = os.fstat(1).st_ino
    with pytest.raises(RuntimeError), engine_output_to(str(tmp_path / "x.log")):
        raise RuntimeError("boom")
    assert os.fstat(1).st_ino == before


def test_the_runner_releases_a_modules_buffers_before_another_modules_rows_and_at_the_end(tmp_path: Path) -> None:
    events: list[str] = []

    def release_a() -> None:
        events.append("release a")

    def release_b() -> None:
        events.append("release b")

    def row(name: str, release: object) -> Scenario:
        def run(backend: object, quick: bool) -> BenchResult:
            events.append(name)
            return RESULTS[0]

        return Scenario(name, "offload", run, release=release)  # type: ignore[arg-type]

    rows = [row("a1", release_a), row("a2", release_a), row("b1", release_b), row("c1", None)]
    runner.run(get_backend("cpu"), rows, quick=True, json_path=None, plot_path=None,
               log_path=str(tmp_path / "b.log"), terminal=io.StringIO())
    assert events == ["a1", "a2", "release a", "b1", "release b", "c1"]
