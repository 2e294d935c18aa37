"""A fourth backend, from a package outside kvplane, passes the conformance suite with no change to kvplane.

``tests/conformance/toy/kvplane_toy`` is written as a vendor would write its package: device facts, a device
module of its own, and a copy function with its own calling convention (``toy_copy_plan``, the native loop's
``plan`` signature). It is installed into a temporary environment by writing the dist-info ``pip`` would write
(the entry point ``toy`` in ``kvplane.backends``), and certified by ``kvplane conformance --device toy``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvplane.conformance.report import ConformanceReport
from kvplane.kv.layouts import LAYOUTS

PACKAGE = Path(__file__).resolve().parent / "toy"
ENTRY_POINTS = "[kvplane.backends]\ntoy = kvplane_toy.plugin\n"


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """An environment where kvplane-toy is installed: its dist-info and its code on the path."""
    site = tmp_path_factory.mktemp("site-packages")
    info = site / "kvplane_toy-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvplane-toy\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(ENTRY_POINTS)
    path = [str(site), str(PACKAGE), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {k: v for k, v in os.environ.items() if k != "KVPLANE_DEVICE"}
    return {**env, "PYTHONPATH": os.pathsep.join(path)}


@pytest.fixture(scope="module")
def certified(installed: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> tuple[int, str, ConformanceReport]:
    scratch = tmp_path_factory.mktemp("toy")
    report = scratch / "toy.json"
    proc = subprocess.run([sys.executable, "-m", "kvplane.cli.main", "conformance", "--device", "toy", "--json",
                           str(report), "--bandwidth-mib", "4"], cwd=scratch, env=installed, capture_output=True,
                          text=True, timeout=600)
    assert report.exists(), proc.stdout + proc.stderr
    return proc.returncode, proc.stdout, ConformanceReport.decode(report.read_bytes())


@pytest.mark.integration
def test_kvplane_lists_the_installed_package_like_its_own_backends(installed: dict[str, str]) -> None:
    out = subprocess.run([sys.executable, "-m", "kvplane.cli.main", "info"], env=installed, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    (toy,) = [line for line in out.splitlines() if line.strip().startswith("toy ")]
    assert "available" in toy and "unavailable" not in toy


@pytest.mark.integration
def test_the_out_of_tree_backend_passes_the_conformance_suite(certified: tuple[int, str, ConformanceReport]) -> None:
    code, stdout, report = certified
    assert code == 0, stdout
    assert report.label == "toy" and not report.emulated and report.ok
    assert report.counts()["failed"] == 0
    skipped = {c.check for c in report.checks if c.outcome == "skipped"}
    assert skipped <= {"test_host_memory_is_pinned_for_dma"}, skipped  # its device memory is host memory


@pytest.mark.integration
def test_its_plans_ran_through_its_own_copy_function_for_every_layout_and_direction(
    certified: tuple[int, str, ConformanceReport],
) -> None:
    _, _, report = certified
    assert report.copy_path == "toy_copy_plan (kvplane_toy)"
    ran = {c.params.split("-", 1)[-1] for c in report.checks
           if c.check == "test_plan_moves_exactly_the_planned_blocks" and c.outcome == "passed"}
    assert ran == {f"{layout}-{d}" for layout in LAYOUTS for d in ("d2h", "h2d", "d2d")}
    (collectives,) = [c for c in report.checks if c.check.startswith("test_two_processes")]
    assert collectives.outcome == "passed"  # two spawned ranks found the package through its entry point too
