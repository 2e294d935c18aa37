"""What the MLU backend states about its device, how kvplane finds it; no MLU needed."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
from kvplane_mlu.backend import MluBackend

from kvplane.backend.registry import BackendRegistry
from kvplane.descriptors import CopyPlan
from kvplane.errors import BackendError, BackendUnavailable
from kvplane.kv.layouts import LAYOUTS
from kvplane.testing import backend_package

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
HAS_TORCH_MLU = importlib.util.find_spec("torch_mlu") is not None


def declared_entry_points() -> dict[str, str]:
    return backend_package.declared_entry_points(PYPROJECT)


def registry_of_this_package() -> BackendRegistry:
    return backend_package.registry_of(PYPROJECT)


def test_device_facts_match_torch_mlu_and_xllm() -> None:
    assert MluBackend.name == "mlu"
    assert MluBackend.torch_device_type == "mlu"
    assert MluBackend.is_accelerator
    assert MluBackend.collective_backend == "cncl"
    assert MluBackend.visible_devices_env == "MLU_VISIBLE_DEVICES"
    assert MluBackend.device_package == "torch_mlu"
    assert MluBackend.mooncake_protocol == "rdma"
    assert MluBackend.nixl_memory_type == "DRAM"
    assert MluBackend.registration_alignment == 1
    assert MluBackend.max_registered_regions is None
    assert MluBackend.layouts == {"gqa": "split_kv", "mla": "mla_split", "index": "index"}
    assert set(MluBackend.layouts.values()) <= set(LAYOUTS)


def test_mooncake_registers_mlu_memory_by_dma_buf_location() -> None:
    assert MluBackend(0).mooncake_location() == "mlu:0"
    assert MluBackend(5).mooncake_location() == "mlu:5"


def test_constructing_touches_no_device() -> None:
    assert MluBackend(1).label == "mlu"
    assert not MluBackend.emulated


def test_executing_a_plan_needs_a_direction() -> None:
    plan = CopyPlan(np.array([0], np.int64), np.array([64], np.int64), np.array([64], np.int64))
    with pytest.raises(BackendError, match=r"^mlu: execute\(\) needs direction="):
        MluBackend(0).execute(plan)
    MluBackend(0).execute(CopyPlan.empty())  # nothing to run is not an error


@pytest.mark.skipif(HAS_TORCH_MLU, reason="torch_mlu is installed here")
def test_executing_a_plan_without_torch_mlu_says_what_to_install() -> None:
    plan = CopyPlan(np.array([0], np.int64), np.array([64], np.int64), np.array([64], np.int64))
    with pytest.raises(BackendError, match="importing torch_mlu failed .*install torch_mlu"):
        MluBackend(0).execute(plan, direction="d2h")


@pytest.mark.skipif(HAS_TORCH_MLU, reason="torch_mlu is installed here")
def test_probe_declines_here_and_says_to_install_torch_mlu() -> None:
    probe = MluBackend.probe()
    assert not probe.available
    assert probe.reason.startswith("torch_mlu is not installed; install torch_mlu")


def test_importing_the_plugin_does_not_import_torch_mlu() -> None:
    attempts, imported = backend_package.plugin_imports("kvplane_mlu.plugin", "torch_mlu")
    assert attempts == [] and not imported


def test_pyproject_registers_the_plugin_under_mlu() -> None:
    assert declared_entry_points() == {"mlu": "kvplane_mlu.plugin"}
    assert registry_of_this_package().load("mlu") is MluBackend


def test_installed_distribution_registers_the_plugin_under_mlu() -> None:
    installed = backend_package.installed_entry_points("kvplane-mlu")
    if installed is None:
        pytest.skip("kvplane-mlu is not installed")
    assert installed == {"mlu": "kvplane_mlu.plugin"}


@pytest.mark.skipif(HAS_TORCH_MLU, reason="torch_mlu is installed here")
def test_selecting_mlu_here_is_an_error_that_says_to_install_torch_mlu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVPLANE_DEVICE", "mlu")
    with pytest.raises(BackendUnavailable, match="torch_mlu is not installed"):
        registry_of_this_package().select()


def test_plans_run_through_cnrt_memcpy_async_v2_with_cnrt_directions() -> None:
    assert MluBackend.memcpy_library == "libcnrt.so"
    assert (MluBackend.memcpy_symbol, MluBackend.memcpy_signature) == ("cnrtMemcpyAsync_V2", "cnrt")
    # cnrtMemTransDir_t: HostToDev 0, DevToDev 1, DevToHost 2, HostToHost 3 (not the ACL/CUDA order)
    assert dict(MluBackend.memcpy_kinds) == {"h2d": 0, "d2d": 1, "d2h": 2, "h2h": 3}
    assert MluBackend.stream_handle_attribute == "mlu_stream"
