"""The MLU probe against a faked torch_mlu stack, and registration spans (no alignment, no region cap)."""

from __future__ import annotations

import sys
from types import ModuleType

import pytest
import torch
from kvplane_mlu.backend import MluBackend

from kvplane.descriptors import Region
from kvplane.testing import backend_package


def fake_torch_mlu(monkeypatch: pytest.MonkeyPatch, *, available: bool, count: int) -> None:
    monkeypatch.setitem(sys.modules, "torch_mlu", ModuleType("torch_mlu"))
    mlu = ModuleType("mlu")
    mlu.is_available = lambda: available  # type: ignore[attr-defined]
    mlu.device_count = lambda: count  # type: ignore[attr-defined]
    monkeypatch.setattr(torch, "mlu", mlu, raising=False)


def test_no_visible_mlu_declines_and_shows_the_visible_devices_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake_torch_mlu(monkeypatch, available=False, count=0)
    monkeypatch.setenv("MLU_VISIBLE_DEVICES", "7")
    probe = MluBackend.probe()
    assert not probe.available
    assert (
        probe.reason
        == "torch.mlu.is_available() is False: no mlu device is visible (MLU_VISIBLE_DEVICES='7')"
    )


def test_visible_mlus_make_it_available(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_torch_mlu(monkeypatch, available=True, count=4)
    assert MluBackend.probe().available


def region(addr: int, nbytes: int, layer: int) -> Region:
    return backend_package.region(addr, nbytes, layer=layer)


def test_spans_are_the_regions_themselves_merged_only_when_they_touch() -> None:
    base = 0x7F00_0000_0000
    a, b, c = region(base + 100, 4096, 0), region(base + 4196, 4096, 1), region(base + 10_000, 512, 2)
    assert MluBackend(0).registration_spans([c, b, a]) == [(base + 100, 8192), (base + 10_000, 512)]


def test_there_is_no_cap_on_the_number_of_regions() -> None:
    regions = [region(0x7F00_0000_0000 + i * 8192, 4096, i) for i in range(1000)]
    assert len(MluBackend(0).registration_spans(regions)) == 1000
