"""Emulated npu and mlu devices: the real ascend and mlu backend code over CPU memory, named and labelled emulated.

They are test doubles that plug in from outside (``kvplane.testing.backends``): a registry sees them only once
a fixture adds them. Every test removes the emulation it caused (``uninstall_emulated``), so torch and
``sys.modules`` look as before for the tests that fake a device stack of their own.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from collections.abc import Iterator
from types import ModuleType

import numpy as np
import pytest
import torch
from kvplane_ascend.backend import AscendBackend
from kvplane_cuda.backend import CudaBackend
from kvplane_mlu.backend import MluBackend

from kvplane.backend.accelerator import AcceleratorBackend
from kvplane.backend.registry import BackendRegistry
from kvplane.backend.vendor_copy import CopyFunction, emulated_copy_function
from kvplane.descriptors import CopyPlan
from kvplane.errors import BackendError
from kvplane.kv.binding import allocate_cache, regions_from_tensors, slot_tensors
from kvplane.kv.spec import KVSpec
from kvplane.plan import block_copy_plan
from kvplane.testing.backends import emulated_backend, register_emulated
from kvplane.testing.emulated import emulated, install_emulated, uninstall_emulated

BACKENDS: list[type[AcceleratorBackend]] = [AscendBackend, MluBackend]
EmulatedAscend, EmulatedMlu = emulated_backend(AscendBackend), emulated_backend(MluBackend)


@pytest.fixture(autouse=True)
def _clean() -> Iterator[None]:
    yield
    for cls in BACKENDS:
        uninstall_emulated(cls.torch_device_type)


@pytest.mark.parametrize("cls", BACKENDS, ids=lambda c: c.name)
def test_an_emulated_backend_is_named_emulated_and_its_probe_says_so(cls: type[AcceleratorBackend]) -> None:
    assert not cls.probe().available  # no device package here, and the real backend knows nothing of emulation
    fake = emulated_backend(cls)
    assert fake.name == f"{cls.name}-emulated" and fake.emulated and not cls.emulated
    assert issubclass(fake, cls) and fake(0).label == f"{cls.name}-emulated"
    probe = fake.probe()
    assert probe.available and probe.reason.startswith("EMULATED: CPU memory behind a stand-in")
    assert f"uses no {cls.name} hardware and claims no support for it" in probe.reason
    assert cls.device_package not in sys.modules  # probing installs nothing


def test_cuda_is_never_emulated_because_torch_cuda_is_real() -> None:
    probe = emulated_backend(CudaBackend).probe()
    assert not probe.available
    assert "cannot emulate cuda: torch.cuda is real here" in probe.reason


def test_emulation_never_shadows_a_real_device_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch_npu", ModuleType("torch_npu"))
    assert "the real torch_npu is imported in this process" in EmulatedAscend.probe().reason
    with pytest.raises(BackendError, match="cannot emulate npu: the real torch_npu is imported"):
        install_emulated("npu", device_package="torch_npu")


def test_the_registry_sees_emulated_backends_only_once_a_fixture_adds_them() -> None:
    registry = BackendRegistry()
    assert "mlu-emulated" not in registry.names()
    assert register_emulated(registry, "mlu") == ["mlu-emulated"]
    assert registry.select().name == "cpu"  # never auto-selected
    backend = registry.create("mlu-emulated")
    assert isinstance(backend, MluBackend) and backend.emulated
    assert backend.label == "mlu-emulated"
    assert backend.device() == torch.device("cpu")
    assert backend.alloc_device(64).device.type == "cpu"
    assert not backend.alloc_host(64).is_pinned()
    assert getattr(torch, "mlu").get_device_name() == "kvplane emulated mlu (CPU memory)"
    assert backend.copy_path() == "cnrtMemcpyAsync_V2 (emulated)"


@pytest.mark.parametrize("cls", BACKENDS, ids=lambda c: c.name)
def test_a_scattered_d2h_plan_runs_through_the_real_backend_path(cls: type[AcceleratorBackend]) -> None:
    backend = emulated_backend(cls)(0)
    spec = KVSpec.mla(2, tokens_per_block=16)
    device = allocate_cache(spec, backend.layouts, 12, alloc=backend.alloc_device)
    for st in slot_tensors(spec, device, backend.layouts):
        st.tensor.copy_(torch.randn(st.tensor.shape))
    host = allocate_cache(spec, backend.layouts, 6, alloc=backend.alloc_host)
    src_ids, dst_ids = np.array([11, 2, 7]), np.array([0, 5, 3])
    plan = block_copy_plan(
        regions_from_tensors(spec, device, backend.layouts), src_ids,
        regions_from_tensors(spec, host, backend.layouts), dst_ids,
    )
    stream, done = backend.new_stream(), backend.new_event()
    backend.execute(plan, stream, direction="d2h")
    done.record(stream)
    done.synchronize()
    assert done.query() and stream.query()
    for s, d in zip(slot_tensors(spec, device, backend.layouts), slot_tensors(spec, host, backend.layouts)):
        assert torch.equal(s.tensor[torch.from_numpy(src_ids)], d.tensor[torch.from_numpy(dst_ids)])


def test_a_refused_descriptor_is_a_backend_error_naming_it() -> None:
    backend = EmulatedAscend(0)
    src, dst = np.ones(256, np.uint8), np.zeros(256, np.uint8)
    plan = CopyPlan(
        np.array([src.ctypes.data, 0], np.int64), np.array([dst.ctypes.data, dst.ctypes.data + 128], np.int64),
        np.array([128, 128], np.int64),
    )
    with pytest.raises(BackendError, match=r"^npu-emulated: aclrtMemcpyAsync \(emulated\) returned error 1 for "
                       r"descriptor 1 of 2 \(src=0x0, "):
        backend.execute(plan, direction="h2d")
    assert dst[:128].all() and not dst[128:].any()


def test_execute_without_a_stream_runs_on_the_current_stream_and_returns_when_done() -> None:
    backend = EmulatedMlu(1)
    src, dst = np.arange(64, dtype=np.uint8), np.zeros(64, np.uint8)
    backend.execute(CopyPlan(np.array([src.ctypes.data], np.int64), np.array([dst.ctypes.data], np.int64),
                             np.array([64], np.int64)), direction="d2d")
    np.testing.assert_array_equal(dst, src)
    assert getattr(backend.current_stream(), "device_index") == 1


def test_a_foreign_stream_is_refused_naming_the_handle_attribute() -> None:
    backend = EmulatedAscend(0)
    plan = CopyPlan(np.array([8], np.int64), np.array([16], np.int64), np.array([8], np.int64))
    with pytest.raises(BackendError, match=r"streams of this backend .* str has no 'npu_stream' handle"):
        backend.execute(plan, "npu:0", direction="d2d")  # type: ignore[arg-type]


def test_a_batch_the_driver_refuses_falls_back_to_the_loop_once_and_says_so() -> None:
    calls: list[int] = []

    @ctypes.CFUNCTYPE(ctypes.c_int, *[ctypes.c_void_p] * 2, ctypes.c_void_p, ctypes.c_size_t,
                      *[ctypes.c_void_p] * 3, ctypes.c_void_p)
    def refusing_batch(*args: object) -> int:
        calls.append(1)
        return 36  # cudaErrorCallRequiresNewerDriver

    backend = EmulatedMlu(0)
    loop = emulated_copy_function("cnrt", "cnrtMemcpyAsync_V2")
    address = ctypes.cast(refusing_batch, ctypes.c_void_p).value
    assert address is not None
    backend._copy_fn = CopyFunction(address, "cuda_batch13", "batchAsync", "test", fallback=loop)
    src, dst = np.arange(32, dtype=np.uint8), np.zeros(32, np.uint8)
    plan = CopyPlan(np.array([src.ctypes.data], np.int64), np.array([dst.ctypes.data], np.int64),
                    np.array([32], np.int64))
    backend.execute(plan, backend.new_stream(), direction="h2d")
    np.testing.assert_array_equal(dst, src)
    assert calls == [1] and backend._copy_fn is loop
    assert backend.copy_path() == (
        "cnrtMemcpyAsync_V2 (emulated); batched copy refused by the driver; using cnrtMemcpyAsync_V2 (emulated)"
    )


def test_the_context_manager_removes_what_it_installed() -> None:
    with emulated("npu", device_package="torch_npu") as emulation:
        assert getattr(torch, "npu") is emulation.module and sys.modules["torch_npu"] is emulation.package
        stream = emulation.module.Stream(device=1)
        assert stream.npu_stream == stream.stream_id and stream.device_index == 1
        with pytest.raises(RuntimeError, match="device 2 does not exist"):
            emulation.module.set_device(2)
    assert not hasattr(torch, "npu") and "torch_npu" not in sys.modules


@pytest.mark.integration
def test_kvplane_info_lists_no_emulated_backend_and_never_picks_one() -> None:
    env = {k: v for k, v in os.environ.items() if k != "KVPLANE_DEVICE"}
    out = subprocess.run([sys.executable, "-m", "kvplane.cli.main", "info"], capture_output=True, text=True,
                         env=env, timeout=120, check=True).stdout
    assert "emulated" not in out.lower()
    assert "selected: cpu (auto)" in out
    npu = next(line for line in out.splitlines() if line.strip().startswith("npu "))
    assert "unavailable" in npu and "torch_npu is not installed" in npu
