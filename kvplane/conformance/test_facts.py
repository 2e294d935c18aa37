"""Device facts: present, of the right kind, and consistent with each other, with what torch reports and with
kvplane's layouts. Nothing here lists the devices kvplane knows: a fourth vendor's values pass when they are
well formed and what they name exists (its collective in torch.distributed, its copy function's signature in the
native loop, or its own ``_execute``)."""

from __future__ import annotations

import os
import re

import pytest

from kvplane.backend.accelerator import AcceleratorBackend
from kvplane.backend.base import DIRECTIONS, Backend
from kvplane.backend.vendor_copy import SIGNATURES
from kvplane.conformance.plugin import DeviceUnderTest
from kvplane.kv.layouts import LAYOUTS
from kvplane.kv.spec import FAMILY_SLOTS

IDENTIFIER = re.compile(r"^[a-z][a-z0-9_]*$")
NIXL_MEMORY_TYPES = {"DRAM", "VRAM", "BLK", "OBJ", "FILE"}  # NIXL's own nixl_mem_t, what register_memory takes


def test_the_backend_is_the_one_selected_and_says_whether_it_is_emulated(
    kvplane_backend: Backend, kvplane_device: DeviceUnderTest
) -> None:
    assert kvplane_backend.name == kvplane_device.name
    assert kvplane_backend.emulated == kvplane_device.emulated
    assert kvplane_backend.label == kvplane_device.label
    assert ("emulated" in kvplane_backend.name) == ("emulated" in kvplane_backend.label) == kvplane_backend.emulated
    assert type(kvplane_backend).probe().available


def test_the_collective_is_one_torch_distributed_reports(kvplane_backend: Backend) -> None:
    import torch.distributed as dist

    name = type(kvplane_backend).collective_backend
    assert isinstance(name, str) and IDENTIFIER.match(name), f"collective_backend={name!r}"
    if kvplane_backend.emulated:
        pytest.skip(f"{kvplane_backend.label}: {name} needs the hardware; test_collectives says what ran instead")
    assert dist.is_available() and dist.is_backend_available(name), (
        f"collective_backend={name!r}: torch.distributed.is_backend_available({name!r}) is False; install the "
        f"package that registers it (torch_npu registers hccl, torch_mlu cncl) or name the right one"
    )


def test_transport_facts_are_well_formed(kvplane_backend: Backend) -> None:
    b = type(kvplane_backend)
    assert isinstance(b.mooncake_protocol, str) and IDENTIFIER.match(b.mooncake_protocol), (
        f"mooncake_protocol={b.mooncake_protocol!r}: the protocol name Mooncake's initialize takes (tcp, rdma, ...)"
    )
    assert b.nixl_memory_type in NIXL_MEMORY_TYPES, f"nixl_memory_type={b.nixl_memory_type!r}"
    assert kvplane_backend.mooncake_location().split(":")[0] in {b.torch_device_type, "cpu"}
    for name, value in b.mooncake_env_defaults.items():
        assert name.isupper() and isinstance(value, str), f"mooncake_env_defaults[{name!r}]={value!r}"
    for name, value in b.nixl_env_defaults.items():
        assert name.isupper() and isinstance(value, str), f"nixl_env_defaults[{name!r}]={value!r}"


def test_every_layout_the_backend_names_exists_and_stores_its_family(kvplane_backend: Backend) -> None:
    layouts = type(kvplane_backend).layouts
    assert {"gqa", "mla"} <= set(layouts), f"layouts={layouts}: name the GQA and MLA layouts of this device"
    for family, name in layouts.items():
        assert family in FAMILY_SLOTS, f"layouts key {family!r} is not a KV family {sorted(FAMILY_SLOTS)}"
        assert name in LAYOUTS, f"layouts[{family!r}]={name!r} is not one of {sorted(LAYOUTS)}"
        assert LAYOUTS[name].family == family, f"layout {name} stores {LAYOUTS[name].family}, not {family}"


def test_registration_limits_are_sane(kvplane_backend: Backend) -> None:
    b = type(kvplane_backend)
    assert isinstance(b.registration_alignment, int) and b.registration_alignment >= 1
    assert b.registration_alignment & (b.registration_alignment - 1) == 0, "alignment must be a power of two"
    assert isinstance(b.registration_merge_gap, int) and b.registration_merge_gap >= 0
    assert b.max_registered_regions is None or b.max_registered_regions >= 1


def test_an_accelerator_names_its_visible_devices_variable_and_its_copy_function(kvplane_backend: Backend) -> None:
    b = type(kvplane_backend)
    if not b.is_accelerator:
        assert b.visible_devices_env is None
        pytest.skip(f"{kvplane_backend.label} is not an accelerator: no visible-devices variable or vendor memcpy")
    assert b.visible_devices_env and b.visible_devices_env.isupper(), f"visible_devices_env={b.visible_devices_env!r}"
    if b.visible_devices_env in os.environ:
        assert isinstance(os.environ[b.visible_devices_env], str)
    if not issubclass(b, AcceleratorBackend) or b._execute is not AcceleratorBackend._execute:
        return  # it runs plans with its own _execute (docs/backends.md); test_plans checks the bytes it moves
    signature = b.memcpy_signature
    assert signature in SIGNATURES, (
        f"memcpy_signature={signature!r} is not a signature the native loop knows {SIGNATURES}; bring the loop "
        f"with the 'plan' signature, or override _execute"
    )
    assert b.memcpy_symbol and b.memcpy_library and b.stream_handle_attribute
    kinds = b.memcpy_kinds
    assert {"h2d", "d2h", "d2d"} <= set(kinds) <= set(DIRECTIONS), f"memcpy_kinds={kinds}"
    assert all(isinstance(code, int) and code >= 0 for code in kinds.values())
