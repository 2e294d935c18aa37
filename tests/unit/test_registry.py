"""Backend discovery and selection, with faked entry points (nothing is installed for these tests).

Each test builds a ``BackendRegistry`` over ``importlib.metadata.EntryPoint`` objects that name the fake
plugins in ``fake_backends.py`` (and a module that fails to import, ``fake_broken_backend.py``).
"""

from __future__ import annotations

import sys
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

from kvplane.backend import BackendRegistry
from kvplane.backend.registry import ENV_VAR, GROUP
from kvplane.errors import BackendError, BackendUnavailable, UnknownBackend

HERE = Path(__file__).resolve().parent
FAKES = "fake_backends"  # tests/unit/fake_backends.py
BROKEN = "fake_broken_backend"  # tests/unit/fake_broken_backend.py


def ep(name: str, value: str) -> EntryPoint:
    return EntryPoint(name=name, value=value, group=GROUP)


CPU = ep("cpu", "kvplane.backend.cpu.plugin")
CUDA = ep("cuda", FAKES)  # the module itself is the plugin
MLU = ep("mlu", f"{FAKES}:mlu")
NPU_MISSING = ep("npu", f"{FAKES}:npu_missing")
NPU_EMULATED = ep("npu-emulated", f"{FAKES}:npu_emulated")
BROKEN_EP = ep("mlu", BROKEN)


def registry(*eps: EntryPoint) -> BackendRegistry:
    return BackendRegistry(list_entry_points=lambda: list(eps))


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch) -> None:
    """No KVPLANE_DEVICE from the caller's shell; the fake plugin modules importable by their names."""
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.syspath_prepend(str(HERE))


@pytest.fixture
def unimported(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forget the fake modules for one test (restored after), so imports can be observed in sys.modules."""
    for name in (FAKES, BROKEN):
        monkeypatch.delitem(sys.modules, name, raising=False)


# -- discovery -----------------------------------------------------------------------------------------------
@pytest.mark.usefixtures("unimported")
def test_names_lists_every_backend_without_importing_any() -> None:
    reg = registry(CPU, CUDA, NPU_MISSING, ep("xpu", "kvplane_no_such_plugin_module"), BROKEN_EP)
    assert reg.names() == ["cpu", "cuda", "mlu", "npu", "xpu"]
    assert FAKES not in sys.modules and BROKEN not in sys.modules
    assert "kvplane_no_such_plugin_module" not in sys.modules


@pytest.mark.usefixtures("unimported")
def test_selecting_by_name_imports_only_that_backend() -> None:
    reg = registry(CPU, BROKEN_EP, ep("xpu", "kvplane_no_such_plugin_module"))
    st = reg.select("cpu")
    assert st.name == "cpu" and st.probe.available
    assert BROKEN not in sys.modules and FAKES not in sys.modules


def test_the_installed_distribution_registers_cpu_through_the_entry_point_group() -> None:
    assert "cpu" in BackendRegistry().names()


def test_a_plugin_module_is_a_plugin_and_create_instantiates_its_backend() -> None:
    backend = registry(CPU, CUDA).create("cuda", device_index=3)
    assert type(backend).__name__ == "FakeCuda"
    assert backend.name == "cuda" and backend.device_index == 3 and backend.emulated is False


def test_a_plugin_object_named_module_colon_attr_is_a_plugin() -> None:
    st = registry(CPU, MLU).select("mlu")
    assert st.cls is not None and st.cls.__name__ == "FakeMlu"


# -- selection by name ---------------------------------------------------------------------------------------
def test_kvplane_device_selects_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    reg = registry(CPU, CUDA, MLU)
    monkeypatch.setenv(ENV_VAR, "mlu")
    assert reg.select().name == "mlu"
    monkeypatch.setenv(ENV_VAR, " CPU ")
    assert reg.select().name == "cpu"


def test_an_explicit_name_wins_over_kvplane_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, "mlu")
    assert registry(CPU, CUDA, MLU).select("cuda").name == "cuda"


def test_an_empty_kvplane_device_means_auto_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, "")
    assert registry(CPU, CUDA).select().name == "cuda"


def test_an_unknown_name_raises_listing_every_installed_backend_and_why_each_declined() -> None:
    reg = registry(CPU, CUDA, NPU_MISSING, BROKEN_EP)
    with pytest.raises(UnknownBackend) as info:
        reg.select("tpu")
    message = str(info.value)
    assert f"{ENV_VAR}='tpu' matches no installed backend" in message
    assert "cpu: available" in message
    assert "cuda: available" in message
    assert "npu: unavailable (torch_npu is not installed; pip install kvplane-ascend[torch])" in message
    assert "mlu: unavailable (plugin failed to load: ModuleNotFoundError" in message
    assert "kvplane_fake_device_runtime_not_installed" in message
    assert isinstance(info.value, BackendError)


def test_an_unknown_name_in_kvplane_device_raises_unknown_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, "tpu")
    with pytest.raises(
        UnknownBackend, match=rf"{ENV_VAR}='tpu' matches no installed backend.*cpu: available"
    ):
        registry(CPU).select()


def test_an_unavailable_backend_raises_backend_unavailable_with_the_probes_reason() -> None:
    reg = registry(CPU, NPU_MISSING)
    with pytest.raises(
        BackendUnavailable,
        match=r"KVPLANE_DEVICE='npu': that backend is installed but cannot run here: "
        r"torch_npu is not installed; pip install kvplane-ascend\[torch\]",
    ):
        reg.select("npu")
    with pytest.raises(BackendUnavailable, match=r"Installed backends: cpu: available; npu: unavailable"):
        reg.create("npu")


def test_an_emulated_backend_is_created_as_emulated_and_says_so() -> None:
    reg = registry(CPU, NPU_EMULATED)
    (npu,) = [s for s in reg.survey() if s.name == "npu-emulated"]
    assert npu.describe() == "npu-emulated: available (emulated)"
    backend = reg.create("npu-emulated")
    assert backend.emulated is True and backend.label == "npu-emulated"


def test_an_emulated_backend_is_used_only_when_named() -> None:
    assert registry(CPU, NPU_EMULATED).select().name == "cpu"


def test_a_plugin_added_by_a_fixture_loads_like_an_installed_one(monkeypatch: pytest.MonkeyPatch) -> None:
    reg = registry(CPU)
    assert "npu-emulated" not in reg.names()
    reg.add(NPU_EMULATED)
    assert reg.added() == (NPU_EMULATED,)
    monkeypatch.setenv(ENV_VAR, "npu-emulated")
    assert reg.create().emulated
    with pytest.raises(ValueError, match="is in group 'kvplane.transports', not 'kvplane.backends'"):
        reg.add(EntryPoint("x", "y", "kvplane.transports"))


# -- auto-selection ------------------------------------------------------------------------------------------
def test_auto_selection_picks_the_single_available_accelerator() -> None:
    assert registry(CPU, CUDA, NPU_MISSING, BROKEN_EP).select().name == "cuda"


def test_auto_selection_falls_back_to_cpu_when_no_accelerator_is_available() -> None:
    st = registry(CPU, NPU_MISSING, BROKEN_EP).select()
    assert st.name == "cpu" and st.probe.available


def test_auto_selection_with_only_cpu_installed_is_cpu() -> None:
    assert type(registry(CPU).create()).__name__ == "CpuBackend"


def test_auto_selection_with_several_accelerators_raises_naming_them_and_the_variable() -> None:
    with pytest.raises(
        BackendError, match=rf"several accelerators are available \(cuda, mlu\); set {ENV_VAR}"
    ):
        registry(CPU, CUDA, MLU).select()


def test_auto_selection_without_cpu_or_accelerator_raises_backend_unavailable() -> None:
    with pytest.raises(BackendUnavailable, match=r"cpu backend is missing.*npu: unavailable"):
        registry(NPU_MISSING).select()


# -- plugins that decline ------------------------------------------------------------------------------------
def test_a_plugin_whose_module_fails_to_import_is_listed_as_declined_not_a_crash() -> None:
    statuses = {s.name: s for s in registry(CPU, BROKEN_EP).survey()}
    assert statuses["cpu"].probe.available
    broken = statuses["mlu"]
    assert not broken.probe.available and broken.cls is None
    assert broken.probe.reason.startswith("plugin failed to load: ModuleNotFoundError")
    assert "kvplane_fake_device_runtime_not_installed" in broken.probe.reason


def test_a_broken_plugin_selected_by_name_raises_backend_unavailable_with_the_import_error() -> None:
    with pytest.raises(BackendUnavailable, match=r"'mlu'.*plugin failed to load: ModuleNotFoundError"):
        registry(CPU, BROKEN_EP).select("mlu")


def test_a_plugin_whose_backend_is_named_differently_is_declined() -> None:
    reg = registry(CPU, ep("rocm", f"{FAKES}:rocm_named_cuda"))
    (rocm,) = [s for s in reg.survey() if s.name == "rocm"]
    assert not rocm.probe.available and rocm.cls is None
    assert "plugin 'rocm' returned backend named 'cuda'; the names must match" in rocm.probe.reason
    assert reg.select().name == "cpu"


def test_a_plugin_returning_something_else_than_a_backend_is_declined() -> None:
    (odd,) = [s for s in registry(CPU, ep("odd", f"{FAKES}:not_a_backend")).survey() if s.name == "odd"]
    assert not odd.probe.available
    assert "must return one Backend subclass from kvplane_backend()" in odd.probe.reason


def test_a_probe_that_raises_declines_with_the_error() -> None:
    reg = registry(CPU, ep("xpu", f"{FAKES}:xpu_probe_raises"))
    (xpu,) = [s for s in reg.survey() if s.name == "xpu"]
    assert xpu.probe == type(xpu.probe)(False, "probe raised RuntimeError: driver crashed")
    assert reg.select().name == "cpu"


def test_a_plugin_with_a_misspelled_hook_is_declined_naming_the_hook() -> None:
    (bad,) = [s for s in registry(CPU, ep("bad", f"{FAKES}:misspelled")).survey() if s.name == "bad"]
    assert not bad.probe.available
    assert "unknown hook 'kvplane_backends'" in bad.probe.reason


def test_a_plugin_with_a_misspelled_hook_does_not_break_the_backends_loaded_after_it() -> None:
    # "aaa" sorts first, so survey() loads it before cpu and cuda
    reg = registry(ep("aaa", f"{FAKES}:misspelled"), CPU, CUDA)
    statuses = {s.name: s for s in reg.survey()}
    assert not statuses["aaa"].probe.available
    assert statuses["cpu"].probe.available, statuses["cpu"].probe.reason
    assert statuses["cuda"].probe.available, statuses["cuda"].probe.reason
    assert reg.select().name == "cuda"


def test_two_plugins_claiming_one_name_are_declined_naming_both() -> None:
    reg = registry(CPU, CUDA, ep("cuda", f"{FAKES}:rocm_named_cuda"))
    (cuda,) = [s for s in reg.survey() if s.name == "cuda"]
    assert not cuda.probe.available
    assert FAKES in cuda.probe.reason and f"{FAKES}:rocm_named_cuda" in cuda.probe.reason
    assert reg.select().name == "cpu"


class CountingEntryPoint(EntryPoint):
    loads: list[str] = []

    def load(self) -> object:
        CountingEntryPoint.loads.append(self.name)
        return super().load()


def test_each_plugin_is_imported_once_whether_it_loads_or_declines(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(CountingEntryPoint, "loads", [])
    eps = [CountingEntryPoint("cpu", CPU.value, GROUP), CountingEntryPoint("mlu", BROKEN, GROUP)]
    reg = BackendRegistry(list_entry_points=lambda: eps)
    for _ in range(3):
        statuses = {s.name: s for s in reg.survey()}
        reg.select("cpu")
    assert sorted(CountingEntryPoint.loads) == ["cpu", "mlu"]
    assert statuses["cpu"].probe.available and not statuses["mlu"].probe.available
