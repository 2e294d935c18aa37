"""The conformance suite's pytest plugin: its options, the device under test, the fixtures and the report.

It is loaded only when asked for: ``pytest -p kvplane.conformance --pyargs kvplane.conformance`` (the
``conformance`` extra brings pytest), or ``kvplane conformance``, which runs that command. It declares no
``pytest11`` entry point, so other pytest sessions in an environment with kvplane installed never load it.

- ``--kvplane-device NAME``: the backend to certify (default ``$KVPLANE_DEVICE``, else auto-selection);
- ``--kvplane-report PATH``: write the report (``kvplane.conformance.report``) as JSON;
- ``--kvplane-bandwidth-mib N``: bytes per bandwidth measurement.

Every conformance test is parametrized with the device under test, so its id names it; an emulated backend's
name says so: ``test_plan_bytes[npu-emulated-split_kv-d2h]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvplane.backend.base import Backend
from kvplane.backend.registry import default_registry
from kvplane.conformance.report import CheckResult, ConformanceReport, render
from kvplane.errors import KvplaneError

MiB = 1 << 20


@dataclass(frozen=True)
class DeviceUnderTest:
    name: str
    label: str
    emulated: bool
    reason: str

    @property
    def test_id(self) -> str:
        return self.name  # an emulated backend's name says "emulated"


REPORT = pytest.StashKey[ConformanceReport]()
DEVICE = pytest.StashKey[DeviceUnderTest]()
NODES = pytest.StashKey[set[str]]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvplane", "kvplane conformance suite")
    group.addoption("--kvplane-device", dest="kvplane_device", metavar="NAME", default=None,
                    help="backend to certify (default: $KVPLANE_DEVICE, else auto-selection)")
    group.addoption("--kvplane-report", dest="kvplane_report", metavar="PATH", default=None,
                    help="write the conformance report as JSON to PATH")
    group.addoption("--kvplane-bandwidth-mib", dest="kvplane_bandwidth_mib", metavar="MIB", type=int, default=64,
                    help="MiB moved per bandwidth measurement (default 64)")


def pytest_configure(config: pytest.Config) -> None:
    config.stash[REPORT] = ConformanceReport()
    config.stash[NODES] = set()
    config.pluginmanager.register(_Recorder(config), "kvplane-conformance-recorder")
    if config.getoption("kvplane_device") is not None:
        device_under_test(config)  # a wrong name is a usage error before anything is collected


def device_under_test(config: pytest.Config) -> DeviceUnderTest:
    """The backend this session certifies, selected once through the registry like any kvplane user."""
    if DEVICE in config.stash:
        return config.stash[DEVICE]
    try:
        status = default_registry().select(config.getoption("kvplane_device"))
    except KvplaneError as e:
        raise pytest.UsageError(f"kvplane conformance: {e}") from e
    emulated = status.emulated
    device = DeviceUnderTest(status.name, status.name, emulated, status.probe.reason)
    config.stash[DEVICE] = device
    report = config.stash[REPORT]
    report.backend, report.label, report.emulated, report.probe_reason = (
        device.name, device.label, device.emulated, device.reason
    )
    if emulated:
        report.notes.append(
            f"{device.label}: memory is host memory and the vendor memcpy a C stand-in, so the bandwidth "
            f"figures measure host memcpy through kvplane's descriptor loop, not {device.name} hardware"
        )
    return device


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "kvplane_device" in metafunc.fixturenames:
        device = device_under_test(metafunc.config)
        metafunc.parametrize("kvplane_device", [device], ids=[device.test_id], scope="session")


@pytest.fixture(scope="session")
def kvplane_report(pytestconfig: pytest.Config) -> ConformanceReport:
    return pytestconfig.stash[REPORT]


@pytest.fixture(scope="session")
def kvplane_backend(kvplane_device: DeviceUnderTest, kvplane_report: ConformanceReport) -> Backend:
    backend = default_registry().create(kvplane_device.name)
    copy_path = getattr(backend, "copy_path", None)
    try:
        kvplane_report.copy_path = copy_path() if callable(copy_path) else "kvplane's native host memcpy"
    except KvplaneError as e:  # the plan checks fail with the full error; the report says why here
        kvplane_report.copy_path = f"unresolved: {e}"
    return backend


@pytest.fixture(scope="session")
def kvplane_bandwidth_bytes(pytestconfig: pytest.Config) -> int:
    mib = int(pytestconfig.getoption("kvplane_bandwidth_mib"))
    if mib < 1:
        raise pytest.UsageError(f"--kvplane-bandwidth-mib={mib} must be >= 1")
    return mib * MiB


# checks run (and are reported) from the device's facts up to whole-system behaviour
ORDER = ("test_facts", "test_memory", "test_streams", "test_plans", "test_registration", "test_collectives",
         "test_bandwidth")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    slots = [n for n, item in enumerate(items) if "kvplane_device" in getattr(item, "fixturenames", ())]
    ours = sorted((items[n] for n in slots), key=_order)
    for n, item in zip(slots, ours):
        items[n] = item
    config.stash[NODES].update(item.nodeid for item in ours)


def _order(item: pytest.Item) -> int:
    module = getattr(getattr(item, "module", None), "__name__", "").rsplit(".", 1)[-1]
    return ORDER.index(module) if module in ORDER else len(ORDER)


class _Recorder:
    """Turns each conformance test's outcome into a ``CheckResult``; writes and prints the report."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.nodeid not in self.config.stash[NODES]:
            return
        if report.when == "call" or not report.passed:
            name = report.nodeid.split("::")[-1]
            check, _, params = name.partition("[")
            self.config.stash[REPORT].checks.append(
                CheckResult(check, params.rstrip("]"), report.outcome, _detail(report), round(report.duration, 3))
            )

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        path = self.config.getoption("kvplane_report")
        report = self.config.stash[REPORT]
        if path is not None and report.checks:
            Path(path).write_bytes(report.encode())

    def pytest_terminal_summary(self, terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
        report = config.stash[REPORT]
        if report.checks:
            terminalreporter.section("kvplane conformance")
            terminalreporter.write_line(render(report))


def _detail(report: pytest.TestReport) -> str:
    """Why a test was skipped or failed, in one line."""
    if report.passed:
        return ""
    longrepr: Any = report.longrepr
    if report.skipped and isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    crash = getattr(longrepr, "reprcrash", None)
    message = getattr(crash, "message", None)
    return str(message if message is not None else longrepr).splitlines()[0] if longrepr else report.outcome
