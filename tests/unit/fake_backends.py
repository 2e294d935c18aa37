"""Fake backend plugins for test_registry, named by faked entry points.

The module itself is a plugin the way a real backend package is (a module-level ``kvplane_backend``
hook, entry point value ``fake_backends``); the other fakes are plugin objects in this module, named as
``fake_backends:<attr>``. Nothing here touches a device.
"""

from __future__ import annotations

from typing import Any, ClassVar

from kvplane.backend import Backend, Probe, hookimpl


class FakeBackend(Backend):
    torch_device_type = "cpu"
    collective_backend = "gloo"
    mooncake_protocol = "tcp"
    nixl_memory_type = "DRAM"
    layouts: ClassVar[dict[str, str]] = {"gqa": "packed_kv"}
    available: ClassVar[bool] = True
    reason: ClassVar[str] = "fake device present"

    @classmethod
    def probe(cls) -> Probe:
        return Probe(cls.available, cls.reason)

    def new_stream(self) -> Any:
        raise NotImplementedError

    def current_stream(self) -> Any:
        raise NotImplementedError

    def new_event(self) -> Any:
        raise NotImplementedError

    def _execute(self, plan: Any, stream: Any, *, direction: Any = None) -> None:
        raise NotImplementedError

    def _alloc_host(self, nbytes: int, pinned: bool) -> Any:
        raise NotImplementedError


class FakeCuda(FakeBackend):
    name = "cuda"


class FakeMlu(FakeBackend):
    name = "mlu"


class FakeNpuMissing(FakeBackend):
    name = "npu"
    available = False
    reason = "torch_npu is not installed; pip install kvplane-ascend[torch]"


class FakeNpuEmulated(FakeBackend):
    name = "npu-emulated"
    emulated = True
    reason = "emulated npu (CPU memory behind torch.npu)"


class FakeXpuProbeRaises(FakeBackend):
    name = "xpu"

    @classmethod
    def probe(cls) -> Probe:
        raise RuntimeError("driver crashed")


class FakeRocmNamedCuda(FakeBackend):
    name = "cuda"  # served under the entry point "rocm"


def _plugin(returned: object) -> type:
    class Plugin:
        @staticmethod
        @hookimpl
        def kvplane_backend() -> Any:
            return returned

    return Plugin


# the module is the cuda plugin, like a real backend package
@hookimpl
def kvplane_backend() -> type[Backend]:
    return FakeCuda


mlu = _plugin(FakeMlu)
npu_missing = _plugin(FakeNpuMissing)
npu_emulated = _plugin(FakeNpuEmulated)
xpu_probe_raises = _plugin(FakeXpuProbeRaises)
rocm_named_cuda = _plugin(FakeRocmNamedCuda)
not_a_backend = _plugin(int)


class misspelled:  # noqa: N801 - a plugin object, named as entry points name it
    @staticmethod
    @hookimpl
    def kvplane_backends() -> type[Backend]:  # one letter too many: no such hook
        return FakeMlu
