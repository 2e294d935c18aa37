"""The ``kvplane`` command as a user runs it: a real subprocess, real files out."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

FIELDS = {"scenario", "kind", "backend", "transport", "bytes", "seconds", "gbps", "baseline", "baseline_gbps",
          "ratio", "verified"}


def kvplane(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvplane.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.integration
def test_bench_writes_verified_results_and_a_plot(tmp_path: Path) -> None:
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    proc = kvplane(
        "bench", "--quick",
        "--scenario", "copy-qwen3-0.6b-d2h-bs16",
        "--scenario", "copy-deepseek-v3-h2d-bs64",
        "--json", str(out), "--plot", str(png), "--log", str(tmp_path / "bench.log"),
        env={"KVPLANE_DEVICE": "cpu"},
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert data["machine"]["backend"] == "cpu"
    results = data["results"]
    assert [r["scenario"] for r in results] == ["copy-qwen3-0.6b-d2h-bs16", "copy-deepseek-v3-h2d-bs64"]
    for r in results:
        assert FIELDS <= set(r)
        assert r["kind"] == "offload" and r["transport"] == "local"
        assert r["verified"] is True
        assert r["bytes"] > 0 and r["gbps"] > 0 and r["baseline_gbps"] > 0
        assert r["ratio"] == pytest.approx(r["gbps"] / r["baseline_gbps"], rel=0.01)
    assert results[0]["bytes"] == 2000 * 114_688  # 2k tokens of Qwen3-0.6B in 16-token blocks
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "qwen3 d2h bs16" in proc.stdout and "dsv3 h2d bs64" in proc.stdout  # the table's short row names
    assert all(len(line) <= 100 for line in proc.stdout.splitlines())
    assert "engine logs:" in proc.stdout and proc.stderr == ""


@pytest.mark.integration
def test_bench_rejects_an_unknown_scenario_by_name() -> None:
    proc = kvplane("bench", "--scenario", "no-such-thing", env={"KVPLANE_DEVICE": "cpu"})
    assert proc.returncode == 2
    assert "no-such-thing" in proc.stderr and "copy-qwen3-0.6b-d2h-bs16" in proc.stderr


@pytest.mark.integration
def test_info_lists_backends_with_reasons_and_engines() -> None:
    proc = kvplane("info", "--json")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    by_name = {b["name"]: b for b in info["backends"]}
    assert by_name["cpu"]["available"] is True
    for name, b in by_name.items():
        if not b["available"]:
            assert b["reason"], f"backend {name} declined without saying why"
    assert set(info["engines"]) >= {"mooncake", "nixl"}
    assert info["selected"]["name"] is not None


@pytest.mark.integration
def test_unknown_device_is_an_error_naming_installed_backends() -> None:
    proc = kvplane("bench", "--quick", env={"KVPLANE_DEVICE": "tpu"})
    assert proc.returncode == 2
    assert "KVPLANE_DEVICE='tpu'" in proc.stderr and "cpu: available" in proc.stderr


@pytest.mark.integration
def test_plan_scenario_reports_verified_descriptors(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    proc = kvplane("bench", "--quick", "--scenario", "plan-qwen3-0.6b-10k", "--json", str(out), "--plot", "",
                   "--log", str(tmp_path / "plan.log"))
    assert proc.returncode == 0, proc.stderr
    (r,) = json.loads(out.read_text())["results"]
    assert r["kind"] == "plan" and r["verified"] is True
    assert r["bytes"] == 10_000 * 114_688
    assert r["params"]["descriptors"] == 28 * 2 * 625  # one per block and slot: nothing merged, nothing lost
