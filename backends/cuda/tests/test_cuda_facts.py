"""What the cuda backend states about its device and how kvplane finds it; stream checks run only on a GPU."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from kvplane_cuda.backend import CudaBackend

from kvplane.backend.registry import BackendRegistry
from kvplane.descriptors import CopyPlan, Region, SlotPart
from kvplane.errors import BackendError, BackendUnavailable
from kvplane.kv.layouts import LAYOUTS
from kvplane.testing import backend_package

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
HAS_GPU = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not HAS_GPU, reason="no CUDA device here")


def declared_entry_points() -> dict[str, str]:
    return backend_package.declared_entry_points(PYPROJECT)


def registry_of_this_package() -> BackendRegistry:
    return backend_package.registry_of(PYPROJECT)


def test_device_facts_match_vllm_on_cuda() -> None:
    assert CudaBackend.name == "cuda"
    assert CudaBackend.torch_device_type == "cuda"
    assert CudaBackend.is_accelerator
    assert CudaBackend.collective_backend == "nccl"
    assert CudaBackend.visible_devices_env == "CUDA_VISIBLE_DEVICES"
    assert CudaBackend.device_package is None
    assert CudaBackend.mooncake_protocol == "rdma"
    assert CudaBackend.nixl_memory_type == "VRAM"
    assert CudaBackend.registration_alignment == 1
    assert CudaBackend.max_registered_regions is None
    assert CudaBackend.layouts == {"gqa": "packed_kv", "mla": "mla_fused", "index": "index"}
    assert set(CudaBackend.layouts.values()) <= set(LAYOUTS)


def test_constructing_touches_no_device_and_names_the_mooncake_location() -> None:
    assert CudaBackend(2).mooncake_location() == "cuda:2"
    assert CudaBackend(0).label == "cuda"


def test_executing_a_plan_needs_a_direction() -> None:
    plan = CopyPlan(np.array([0], np.int64), np.array([64], np.int64), np.array([64], np.int64))
    with pytest.raises(BackendError, match=r"^cuda: execute\(\) needs direction="):
        CudaBackend(0).execute(plan)


def test_the_copy_facts_name_cuda_memcpy_async_with_the_default_kind() -> None:
    assert (CudaBackend.memcpy_symbol, CudaBackend.memcpy_signature) == ("cudaMemcpyAsync", "cuda")
    assert dict(CudaBackend.memcpy_kinds) == {"h2d": 4, "d2h": 4, "d2d": 4, "h2h": 4}  # cudaMemcpyDefault
    assert CudaBackend.stream_handle_attribute == "cuda_stream"


@pytest.mark.skipif(HAS_GPU, reason="a CUDA device is visible here")
def test_executing_a_plan_without_a_gpu_raises_backend_error_naming_the_device() -> None:
    plan = CopyPlan(np.array([0], np.int64), np.array([64], np.int64), np.array([64], np.int64))
    with pytest.raises(BackendError, match=r"^cuda: .* on cuda:0 failed"):
        CudaBackend(0).execute(plan, direction="d2h")


@pytest.mark.skipif(HAS_GPU, reason="a CUDA device is visible here")
def test_probe_declines_here_and_says_what_to_install() -> None:
    probe = CudaBackend.probe()
    assert not probe.available
    if torch.version.cuda is None:
        assert "built without CUDA; install a CUDA build of torch" in probe.reason
    else:
        assert "no cuda device is visible" in probe.reason


def test_a_rocm_build_of_torch_is_declined_even_with_gpus_visible(monkeypatch: pytest.MonkeyPatch) -> None:
    # ROCm torch answers to torch.cuda with AMD GPUs: a ROCm backend, not this one, claims them
    monkeypatch.setattr(torch.version, "hip", "6.2.41133", raising=False)
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    probe = CudaBackend.probe()
    assert not probe.available
    assert "ROCm (HIP 6.2.41133) build" in probe.reason and "install a ROCm backend" in probe.reason


def test_importing_the_plugin_does_not_initialise_cuda() -> None:
    code = textwrap.dedent(
        """
        import sys
        import kvplane_cuda.plugin as plugin
        plugin.kvplane_backend()(0)
        torch = sys.modules.get("torch")
        print(torch is not None and torch.cuda.is_initialized())
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False"]


def test_pyproject_registers_the_plugin_under_cuda() -> None:
    assert declared_entry_points() == {"cuda": "kvplane_cuda.plugin"}
    assert registry_of_this_package().load("cuda") is CudaBackend


def test_installed_distribution_registers_the_plugin_under_cuda() -> None:
    installed = backend_package.installed_entry_points("kvplane-cuda")
    if installed is None:
        pytest.skip("kvplane-cuda is not installed")
    assert installed == {"cuda": "kvplane_cuda.plugin"}


@pytest.mark.skipif(HAS_GPU, reason="a CUDA device is visible here")
def test_selecting_cuda_without_a_gpu_is_an_error_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPLANE_DEVICE", "cuda")
    with pytest.raises(BackendUnavailable, match="KVPLANE_DEVICE='cuda'.*cannot run here"):
        registry_of_this_package().select()


def test_registration_spans_are_the_regions_merged_only_when_they_touch() -> None:
    def region(addr: int, nbytes: int) -> Region:
        return Region(0, 0, "layers.0", addr, 1, nbytes, nbytes, 16, 1, nbytes // 16, (SlotPart("k", 0, nbytes // 16),))

    base = 0x7F00_0000_0000
    spans = CudaBackend(0).registration_spans(
        [region(base + 4096, 4096), region(base, 4096), region(base + 9000, 64)]
    )
    assert spans == [(base, 8192), (base + 9000, 64)]


@needs_gpu
def test_streams_events_and_pinned_memory_on_a_gpu() -> None:
    backend = CudaBackend(0)
    assert CudaBackend.probe().available
    stream, event = backend.new_stream(), backend.new_event()
    host = backend.alloc_host(1 << 20)
    assert host.is_pinned()
    device = backend.alloc_device(1 << 20)
    with torch.cuda.stream(stream):  # type: ignore[arg-type]
        device.copy_(host, non_blocking=True)
        event.record(stream)
    event.synchronize()
    assert event.query() and stream.query()
    backend.current_stream().wait_event(event)
    backend.synchronize()


@pytest.mark.skipif(HAS_GPU, reason="a CUDA device is visible here")
def test_device_primitives_without_a_gpu_raise_backend_error_naming_the_device() -> None:
    backend = CudaBackend(0)
    for primitive in (backend.new_stream, backend.new_event, backend.current_stream, backend.synchronize):
        with pytest.raises(BackendError, match=r"^cuda: .* on cuda:0 failed"):
            primitive()
