"""What the Ascend backend states about its device, how kvplane finds it; no NPU needed."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
from kvplane_ascend.backend import AscendBackend

from kvplane.backend.registry import BackendRegistry
from kvplane.descriptors import CopyPlan
from kvplane.errors import BackendError, BackendUnavailable
from kvplane.kv.layouts import LAYOUTS
from kvplane.testing import backend_package

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
HAS_TORCH_NPU = importlib.util.find_spec("torch_npu") is not None


def declared_entry_points() -> dict[str, str]:
    return backend_package.declared_entry_points(PYPROJECT)


def registry_of_this_package() -> BackendRegistry:
    return backend_package.registry_of(PYPROJECT)


def test_device_facts_match_vllm_ascend() -> None:
    assert AscendBackend.name == "npu"
    assert AscendBackend.torch_device_type == "npu"
    assert AscendBackend.is_accelerator
    assert AscendBackend.collective_backend == "hccl"
    assert AscendBackend.visible_devices_env == "ASCEND_RT_VISIBLE_DEVICES"
    assert AscendBackend.device_package == "torch_npu"
    assert AscendBackend.mooncake_protocol == "ascend"
    assert AscendBackend.nixl_memory_type == "DRAM"
    assert AscendBackend.registration_alignment == 2 * 1024 * 1024
    assert AscendBackend.max_registered_regions == 256
    assert AscendBackend.registration_merge_gap == 4096
    assert AscendBackend.layouts == {"gqa": "split_kv", "mla": "mla_split", "index": "index"}


def test_every_layout_it_names_exists() -> None:
    assert set(AscendBackend.layouts.values()) <= set(LAYOUTS)


def test_mooncake_timeouts_are_recorded_as_defaults_in_milliseconds() -> None:
    env = AscendBackend.mooncake_env_defaults
    assert set(env) == {"ASCEND_CONNECT_TIMEOUT", "ASCEND_TRANSFER_TIMEOUT"}
    assert all(value.isdigit() and int(value) > 0 for value in env.values())


def test_constructing_touches_no_device() -> None:
    backend = AscendBackend(3)
    assert backend.device_index == 3
    assert backend.label == "npu"
    assert not AscendBackend.emulated
    assert backend.mooncake_location() == "npu:3"


def test_executing_a_plan_needs_a_direction() -> None:
    plan = CopyPlan(np.array([0], np.int64), np.array([64], np.int64), np.array([64], np.int64))
    with pytest.raises(BackendError, match=r"^npu: execute\(\) needs direction="):
        AscendBackend(0).execute(plan)
    AscendBackend(0).execute(CopyPlan.empty())  # nothing to run is not an error


@pytest.mark.skipif(HAS_TORCH_NPU, reason="torch_npu is installed here")
def test_executing_a_plan_without_torch_npu_says_what_to_install() -> None:
    plan = CopyPlan(np.array([0], np.int64), np.array([64], np.int64), np.array([64], np.int64))
    with pytest.raises(BackendError, match="importing torch_npu failed .*pip install torch-npu"):
        AscendBackend(0).execute(plan, direction="d2h")


@pytest.mark.skipif(HAS_TORCH_NPU, reason="torch_npu is installed here")
def test_probe_declines_here_and_says_to_install_torch_npu() -> None:
    probe = AscendBackend.probe()
    assert not probe.available
    assert "torch_npu is not installed" in probe.reason
    assert "pip install torch-npu" in probe.reason


def test_importing_the_plugin_does_not_import_torch_npu() -> None:
    attempts, imported = backend_package.plugin_imports("kvplane_ascend.plugin", "torch_npu")
    assert attempts == [] and not imported


def test_pyproject_registers_the_plugin_under_npu() -> None:
    assert declared_entry_points() == {"npu": "kvplane_ascend.plugin"}
    assert registry_of_this_package().load("npu") is AscendBackend


def test_installed_distribution_registers_the_plugin_under_npu() -> None:
    installed = backend_package.installed_entry_points("kvplane-ascend")
    if installed is None:
        pytest.skip("kvplane-ascend is not installed")
    assert installed == {"npu": "kvplane_ascend.plugin"}


@pytest.mark.skipif(HAS_TORCH_NPU, reason="torch_npu is installed here")
def test_selecting_npu_here_is_an_error_that_says_to_install_torch_npu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVPLANE_DEVICE", "npu")
    with pytest.raises(BackendUnavailable, match="torch_npu is not installed; pip install torch-npu"):
        registry_of_this_package().select()


@pytest.mark.skipif(HAS_TORCH_NPU, reason="torch_npu is installed here")
def test_device_primitives_without_torch_npu_raise_backend_error_saying_to_install_it() -> None:
    backend = AscendBackend(0)
    primitives = (backend.new_stream, backend.new_event, backend.current_stream, backend.synchronize)
    for primitive in (*primitives, backend.set_current_device, backend.device):
        with pytest.raises(BackendError, match="importing torch_npu failed .*pip install torch-npu"):
            primitive()
    assert backend.alloc_host(64, pinned=False).numel() == 64  # unpinned host memory needs no device


def test_plans_run_through_acl_memcpy_async_with_aclrt_memcpy_kinds() -> None:
    assert AscendBackend.memcpy_library == "libascendcl.so"
    assert (AscendBackend.memcpy_symbol, AscendBackend.memcpy_signature) == ("aclrtMemcpyAsync", "acl")
    # ACL_MEMCPY_HOST_TO_DEVICE 1, DEVICE_TO_HOST 2, DEVICE_TO_DEVICE 3; host-to-host is refused by the async API
    assert dict(AscendBackend.memcpy_kinds) == {"h2d": 1, "d2h": 2, "d2d": 3}
    assert AscendBackend.stream_handle_attribute == "npu_stream"


def test_a_host_to_host_plan_is_refused_up_front_naming_the_supported_directions() -> None:
    plan = CopyPlan(np.array([0], np.int64), np.array([64], np.int64), np.array([64], np.int64))
    with pytest.raises(BackendError, match=r"direction='h2h' is not supported by aclrtMemcpyAsync.*'d2d', 'd2h'"):
        AscendBackend(0).execute(plan, direction="h2h")
