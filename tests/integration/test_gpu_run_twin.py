"""The GPU run's CPU twin: ``scripts/gpu/run.sh`` itself, on the cpu backend with ``--quick``, writes the same
report a GPU run does, every part passing and every row's bytes compared. It keeps the prepared GPU command
working between the rare tasks that are lent a GPU (docs/gpu.md). Nothing here compares timings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
PARTS = ["info", "copy-dsv3", "sweep", "pd", "conformance", "engine"]
SECTIONS = ["## Parts", "## Conformance", "## Offload", "## Descriptor sizes by copy route", "## P/D over NIXL",
            "## Copy kernel variants"]


def test_the_prepared_gpu_command_runs_on_the_cpu_backend_and_reports_every_part(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu" / "run.sh"), str(out), "--device", "cpu", "--quick", "--no-install"],
        env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=900, cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout + done.stderr + (out / "run.log").read_text()[-4000:]
    assert sorted(p.name for p in out.iterdir()) == ["bench.log", "report.json", "report.md", "run.log"]
    report = json.loads((out / "report.json").read_text())
    assert [p["name"] for p in report["parts"]] == PARTS and all(p["status"] == "ok" for p in report["parts"])
    rows = {r["scenario"]: r for r in report["results"]}
    assert {"copy-deepseek-v3-d2h-bs16-xl", "sweep-h2d-64k", "pd-nixl-qwen3-0.6b-read-vram",
            "offload-deepseek-v3-load"} <= rows.keys()
    assert all(r["verified"] for r in rows.values()), [n for n, r in rows.items() if not r["verified"]]
    assert report["conformance"]["label"] == "cpu" and "kvplane" in report["info"]
    markdown = (out / "report.md").read_text()
    assert all(section in markdown for section in SECTIONS)
    assert "| pd-nixl-qwen3-0.6b-write-vram |" in markdown
