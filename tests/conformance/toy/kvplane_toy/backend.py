"""The toy backend: device facts, a device module of its own, and its own copy function.

Streams, events, pinned memory and plan execution come from kvplane's ``AcceleratorBackend``; the package
overrides ``device_module``/``device`` (its device has no torch device type) and ``load_copy_function`` (its
vendor's calling convention is its own).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from types import ModuleType
from typing import ClassVar

import torch

from kvplane.backend.accelerator import AcceleratorBackend
from kvplane.backend.base import Probe
from kvplane.backend.cpu.backend import CpuBackend
from kvplane.backend.vendor_copy import CopyFunction
from kvplane_toy import runtime


@functools.cache
def toy_module() -> ModuleType:
    """``torch.toy`` as the toy runtime's Python package would provide it: streams with a ``toy_stream`` handle."""
    from kvplane.testing.emulated_device import device_module

    return device_module("toy", "toy_stream", 2)


class ToyBackend(AcceleratorBackend):
    name = "toy"
    torch_device_type = "toy"
    collective_backend = "gloo"  # the toy has no collective library of its own; torch reports gloo available
    visible_devices_env = "TOY_VISIBLE_DEVICES"
    install_hint = "the toy device belongs to kvplane's test suite; there is nothing to install"
    mooncake_protocol = "tcp"
    nixl_memory_type = "DRAM"
    layouts: ClassVar[dict[str, str]] = dict(CpuBackend.layouts)  # its memory is host memory, laid out as cpu's
    memcpy_library = "kvplane_toy"
    memcpy_symbol = "toy_copy_plan"
    memcpy_signature = "plan"
    memcpy_kinds: ClassVar[Mapping[str, int]] = runtime.KINDS
    stream_handle_attribute = "toy_stream"

    @classmethod
    def probe(cls) -> Probe:
        return Probe(True, "2 toy devices (host memory behind the toy runtime's device module)")

    def device_module(self) -> ModuleType:
        return toy_module()

    def device(self) -> torch.device:
        return torch.device("cpu")  # the toy's device memory is host memory

    def load_copy_function(self) -> CopyFunction:
        return CopyFunction(runtime.address(), self.memcpy_signature, self.memcpy_symbol, self.memcpy_library)
