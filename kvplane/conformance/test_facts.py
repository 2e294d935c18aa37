"""Device facts: present, of the right kind, and consistent with each other and with kvplane's layouts."""

from __future__ import annotations

import os

import pytest

from kvplane.backend.base import DIRECTIONS, Backend
from kvplane.conformance.plugin import DeviceUnderTest
from kvplane.kv.layouts import LAYOUTS
from kvplane.kv.spec import FAMILY_SLOTS

COLLECTIVES = {"gloo", "nccl", "hccl", "cncl"}
MOONCAKE_PROTOCOLS = {"tcp", "rdma", "ascend"}  # what FACTS.md records; a new device adds its protocol here
NIXL_MEMORY_TYPES = {"DRAM", "VRAM"}
COPY_SIGNATURES = {"cuda", "acl", "cnrt"}


def test_the_backend_is_the_one_selected_and_says_whether_it_is_emulated(
    kvplane_backend: Backend, kvplane_device: DeviceUnderTest
) -> None:
    assert kvplane_backend.name == kvplane_device.name
    assert kvplane_backend.emulated == kvplane_device.emulated
    assert kvplane_backend.label == kvplane_device.label
    assert ("emulated" in kvplane_backend.name) == ("emulated" in kvplane_backend.label) == kvplane_backend.emulated
    assert type(kvplane_backend).probe().available


def test_transport_and_collective_facts_name_known_values(kvplane_backend: Backend) -> None:
    b = type(kvplane_backend)
    assert b.collective_backend in COLLECTIVES, f"collective_backend={b.collective_backend!r}"
    assert b.mooncake_protocol in MOONCAKE_PROTOCOLS, f"mooncake_protocol={b.mooncake_protocol!r}"
    assert b.nixl_memory_type in NIXL_MEMORY_TYPES, f"nixl_memory_type={b.nixl_memory_type!r}"
    assert kvplane_backend.mooncake_location().split(":")[0] in {b.torch_device_type, "cpu"}
    for name, value in b.mooncake_env_defaults.items():
        assert name.isupper() and isinstance(value, str), f"mooncake_env_defaults[{name!r}]={value!r}"


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
    assert getattr(b, "memcpy_signature", None) in COPY_SIGNATURES
    assert getattr(b, "memcpy_symbol", "") and getattr(b, "memcpy_library", "")
    assert getattr(b, "stream_handle_attribute", "")
    kinds = getattr(b, "memcpy_kinds", {})
    assert {"h2d", "d2h", "d2d"} <= set(kinds) <= set(DIRECTIONS), f"memcpy_kinds={kinds}"
    assert all(isinstance(code, int) and code >= 0 for code in kinds.values())
