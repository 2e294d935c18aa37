"""How the Ascend probe answers each state of a machine, faked: no package, a broken one, no device, devices.

A fake ``torch_npu`` in ``sys.modules`` and a fake ``torch.npu`` stand in for the device stack; the probe
must report each case as a reason and never raise.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from kvplane_ascend.backend import AscendBackend

from kvplane.backend.accelerator import probe_device_package


def fake_device_stack(
    monkeypatch: pytest.MonkeyPatch, *, available: bool = True, count: int = 1, with_module: bool = True
) -> ModuleType:
    monkeypatch.setitem(sys.modules, "torch_npu", ModuleType("torch_npu"))
    npu = ModuleType("npu")
    npu.is_available = lambda: available  # type: ignore[attr-defined]
    npu.device_count = lambda: count  # type: ignore[attr-defined]
    if with_module:
        monkeypatch.setattr(torch, "npu", npu, raising=False)
    else:
        monkeypatch.delattr(torch, "npu", raising=False)
    return npu


def test_a_missing_package_is_named_with_the_install_hint() -> None:
    probe = probe_device_package("kvplane_no_such_device_pkg", "pip install it", device_type="npu")
    assert (probe.available, probe.reason) == (
        False,
        "kvplane_no_such_device_pkg is not installed; pip install it",
    )


def test_a_package_that_fails_to_import_declines_with_its_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "kvplane_broken_device_pkg.py").write_text("raise OSError('libascendcl.so: cannot open')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    probe = probe_device_package("kvplane_broken_device_pkg", "reinstall it", device_type="npu")
    assert not probe.available
    assert "importing kvplane_broken_device_pkg failed (OSError: libascendcl.so: cannot open)" in probe.reason
    assert probe.reason.endswith("reinstall it")


def test_no_visible_npu_declines_and_shows_the_visible_devices_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake_device_stack(monkeypatch, available=False)
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "")
    probe = AscendBackend.probe()
    assert not probe.available
    assert "torch.npu.is_available() is False" in probe.reason
    assert "ASCEND_RT_VISIBLE_DEVICES=''" in probe.reason


def test_zero_devices_declines(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_device_stack(monkeypatch, available=True, count=0)
    monkeypatch.delenv("ASCEND_RT_VISIBLE_DEVICES", raising=False)
    probe = AscendBackend.probe()
    assert not probe.available
    assert probe.reason == "torch.npu.device_count() is 0: no npu device is visible"


def test_visible_npus_make_it_available(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_device_stack(monkeypatch, available=True, count=8)
    probe = AscendBackend.probe()
    assert probe.available
    assert probe.reason == "8 npu device(s) visible"


def test_a_torch_without_the_npu_module_declines_with_the_install_hint(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake_device_stack(monkeypatch, with_module=False)
    probe = AscendBackend.probe()
    assert not probe.available
    assert "has no torch.npu module" in probe.reason
    assert "pip install torch-npu" in probe.reason


def test_a_device_module_that_raises_declines_instead_of_raising(monkeypatch: pytest.MonkeyPatch) -> None:
    npu = fake_device_stack(monkeypatch)

    def broken() -> bool:
        raise RuntimeError("drvMngGetConsoleLogLevel failed")

    npu.is_available = broken  # type: ignore[attr-defined]
    probe = AscendBackend.probe()
    assert not probe.available
    assert probe.reason == "probing torch.npu raised RuntimeError: drvMngGetConsoleLogLevel failed"
