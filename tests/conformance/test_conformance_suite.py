"""The conformance suite as a vendor runs it, on cpu, emulated npu and emulated mlu: it passes everywhere here.

Each run is a real subprocess started from a scratch directory (not the repository), the first two through
``pytest -p kvplane.conformance --pyargs kvplane.conformance`` (the emulated npu added by
``-p kvplane.testing.pytest_plugin``), the third through ``kvplane conformance --emulate``; they run side by side.
Skips are allowed only with the reasons that make them honest: no pinning where device memory is host memory,
no vendor memcpy on the cpu backend, and no hccl/cncl on an emulated device.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvplane.conformance.report import ConformanceReport
from kvplane.kv.layouts import LAYOUTS

BANDWIDTH_MIB = "8"  # small: the figures are reported, not asserted, and CI time matters
ALLOWED_SKIPS = {
    "test_host_memory_is_pinned_for_dma": "device memory is host memory here, so there is nothing to pin",
    "test_an_accelerator_names_its_visible_devices_variable_and_its_copy_function": "is not an accelerator",
    "test_two_processes_gather_manifests_and_agree_on_finished_requests": "itself is untested",
    "test_the_collective_is_one_torch_distributed_reports": "needs the hardware; test_collectives says what ran",
}


def pytest_suite(device: str, report: Path, *plugins: str) -> list[str]:
    loads = [arg for plugin in ("kvplane.conformance", *plugins) for arg in ("-p", plugin)]
    return [sys.executable, "-m", "pytest", *loads, "--pyargs", "kvplane.conformance", f"--kvplane-device={device}",
            f"--kvplane-report={report}", f"--kvplane-bandwidth-mib={BANDWIDTH_MIB}", "-p", "no:cacheprovider", "-q"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple[int, str, ConformanceReport]]]:
    scratch = tmp_path_factory.mktemp("conformance")
    base = {k: v for k, v in os.environ.items() if k != "KVPLANE_DEVICE"}
    commands = {
        "cpu": (pytest_suite("cpu", scratch / "cpu.json"), base),
        "npu": (pytest_suite("npu-emulated", scratch / "npu.json", "kvplane.testing.pytest_plugin"), base),
        "mlu": ([sys.executable, "-m", "kvplane.cli.main", "conformance", "--device", "mlu", "--emulate",
                 "--json", str(scratch / "mlu.json"), "--bandwidth-mib", BANDWIDTH_MIB], base),
    }
    procs = {name: subprocess.Popen(cmd, cwd=scratch, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True) for name, (cmd, env) in commands.items()}
    out: dict[str, tuple[int, str, ConformanceReport]] = {}
    for name, proc in procs.items():
        stdout, _ = proc.communicate(timeout=300)
        path = scratch / f"{name}.json"
        assert path.exists(), f"{name}: no report was written; output:\n{stdout}"
        out[name] = (proc.returncode, stdout, ConformanceReport.decode(path.read_bytes()))
    yield out


@pytest.mark.integration
@pytest.mark.parametrize(("device", "label"), [("cpu", "cpu"), ("npu", "npu-emulated"), ("mlu", "mlu-emulated")])
def test_the_suite_passes_and_every_skip_has_an_honest_reason(
    runs: dict[str, tuple[int, str, ConformanceReport]], device: str, label: str
) -> None:
    code, stdout, report = runs[device]
    assert code == 0, stdout
    assert report.label == label and report.emulated == (device != "cpu")
    assert report.counts()["failed"] == 0 and report.ok
    for check in report.checks:
        if check.outcome == "skipped":
            assert check.check in ALLOWED_SKIPS and ALLOWED_SKIPS[check.check] in check.detail, check
        if report.emulated:
            assert "emulated" in check.params, f"{check.check}[{check.params}] does not say emulated"


@pytest.mark.integration
@pytest.mark.parametrize("device", ["cpu", "npu", "mlu"])
def test_plans_ran_for_every_layout_and_direction_and_bandwidth_was_reported(
    runs: dict[str, tuple[int, str, ConformanceReport]], device: str
) -> None:
    _, _, report = runs[device]
    ran = {c.params.split("-", 2 if report.emulated else 1)[-1] for c in report.checks
           if c.check == "test_plan_moves_exactly_the_planned_blocks" and c.outcome == "passed"}
    assert ran == {f"{layout}-{d}" for layout in LAYOUTS for d in ("d2h", "h2d", "d2d")}
    assert sorted(b.direction for b in report.bandwidth) == ["d2h", "h2d"]
    assert all(b.gbps > 0 and b.baseline_gbps > 0 and b.descriptors > 0 for b in report.bandwidth)


@pytest.mark.integration
def test_emulated_devices_run_the_vendor_memcpy_stand_ins_and_never_claim_their_collective(
    runs: dict[str, tuple[int, str, ConformanceReport]],
) -> None:
    npu, mlu = runs["npu"][2], runs["mlu"][2]
    assert npu.copy_path == "aclrtMemcpyAsync (emulated)" and mlu.copy_path == "cnrtMemcpyAsync_V2 (emulated)"
    for report, collective in ((npu, "hccl"), (mlu, "cncl")):
        (check,) = [c for c in report.checks if c.check.startswith("test_two_processes")]
        assert check.outcome == "skipped" and f"{collective} itself is untested" in check.detail
        assert report.probe_reason.startswith("EMULATED")


@pytest.mark.integration
def test_the_command_prints_the_report_with_the_label_checks_and_bandwidth(
    runs: dict[str, tuple[int, str, ConformanceReport]],
) -> None:
    _, stdout, report = runs["mlu"]
    assert stdout.startswith("kvplane conformance: backend mlu-emulated")
    assert "PASSED  test_plan_moves_exactly_the_planned_blocks[mlu-emulated-mla_split-d2h]" in stdout
    assert "bandwidth (reported, not asserted)" in stdout
    n = report.counts()
    assert f"result: {n['passed']} passed, 0 failed, {n['skipped']} skipped on mlu-emulated" in stdout


@pytest.mark.integration
@pytest.mark.parametrize(
    ("device", "says"),
    [("tpu", "matches no installed backend"), ("npu", "torch_npu is not installed; pip install torch-npu")],
)
def test_a_backend_that_cannot_run_is_an_error_saying_why(tmp_path: Path, device: str, says: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "kvplane.cli.main", "conformance", "--device", device],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "the conformance suite did not run" in proc.stderr and says in proc.stderr
