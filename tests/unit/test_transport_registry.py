"""Transport discovery through the ``kvplane.transports`` entry-point group, with entry points faked in place."""

from __future__ import annotations

from importlib.metadata import EntryPoint

import pytest

from kvplane.errors import TransportUnavailable
from kvplane.transports.base import Transport
from kvplane.transports.registry import (
    BUILTINS,
    GROUP,
    TransportRegistry,
    available_transports,
    get_transport_class,
)


def registry(*extra: EntryPoint) -> TransportRegistry:
    eps = [*BUILTINS, *extra]
    return TransportRegistry(lambda: eps)


def test_builtin_transports_load_by_name_through_the_same_hook_as_plugins() -> None:
    reg = registry()
    assert reg.names() == ["mooncake", "nixl"]
    for name in reg.names():
        cls = reg.get(name)
        assert issubclass(cls, Transport) and cls.name == name
        assert reg.get(name) is cls  # loaded once


def test_available_transports_say_why_each_one_is_usable_or_not() -> None:
    status = registry().available()
    assert set(status) == {"mooncake", "nixl"}
    for ok, reason in status.values():
        assert isinstance(ok, bool) and reason


def test_unknown_transport_names_the_installed_ones() -> None:
    with pytest.raises(TransportUnavailable, match="'gloo'.*mooncake, nixl"):
        registry().get("gloo")


def test_a_broken_plugin_is_reported_by_name_and_does_not_hide_the_others() -> None:
    reg = registry(EntryPoint("broken", "kvplane_no_such_module:plugin", GROUP))
    with pytest.raises(TransportUnavailable, match="broken.*ModuleNotFoundError"):
        reg.get("broken")
    status = reg.available()
    assert status["broken"][0] is False and "kvplane_no_such_module" in status["broken"][1]
    assert reg.get("nixl").name == "nixl"


def test_a_plugin_returning_a_transport_under_another_name_is_refused() -> None:
    reg = TransportRegistry(lambda: [EntryPoint("fast", "kvplane.transports.plugins:nixl", GROUP)])
    with pytest.raises(TransportUnavailable, match="'fast' returned transport named 'nixl'"):
        reg.get("fast")


def test_the_default_registry_finds_the_builtins_even_before_the_entry_points_are_installed() -> None:
    assert get_transport_class("nixl").name == "nixl"
    assert {"mooncake", "nixl"} <= set(available_transports())
