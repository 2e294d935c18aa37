"""The NIXL agent kvplane starts has its progress thread on and sleeping between events (``pthrDelay`` > 0):
NIXL's Python API hard-codes 0, where the thread spins a core while idle (``kvplane/transports/nixl_progress.py``).
The config the native agent is built with is read where it is handed over, not inferred from CPU time."""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import Any

import pytest

from kvplane.backend.cpu.backend import CpuBackend
from kvplane.errors import TransportError, TransportUnavailable
from kvplane.transports.base import TransportConfig
from kvplane.transports.nixl import NixlTransport, _import_nixl
from kvplane.transports.nixl_progress import (
    DEFAULT_DELAY_US,
    DELAY_ENV,
    agent_config,
    progress_delay_us,
)

FIELDS = ("useProgThread", "pthrDelay", "useListenThread")


@pytest.fixture
def bindings() -> Any:
    try:
        _, module = _import_nixl()
    except TransportUnavailable as e:
        pytest.skip(f"NIXL is not usable here: {e}")
    return importlib.import_module(f"{module}._bindings")


@pytest.fixture
def handed(bindings: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[dict[str, Any]]]:
    """The fields of every config a native NIXL agent is created with, NIXL's own Python API included."""
    seen: list[dict[str, Any]] = []
    real = bindings.nixlAgent

    def spy(name: str, config: Any) -> Any:
        seen.append({field: getattr(config, field) for field in FIELDS})
        return real(name, config)

    monkeypatch.setattr(bindings, "nixlAgent", spy)
    yield seen


def test_the_config_has_the_progress_thread_on_with_a_delay(bindings: Any) -> None:
    config = agent_config(bindings, DEFAULT_DELAY_US)
    assert (config.useProgThread, config.pthrDelay, config.useListenThread) == (True, DEFAULT_DELAY_US, False)
    assert DEFAULT_DELAY_US >= 1000  # NIXL rounds up to whole ms; 0 is the spinning thread


def test_the_transport_starts_its_agent_with_that_config_and_again_after_a_reset(
    handed: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(DELAY_ENV, raising=False)
    transport = NixlTransport(CpuBackend(), TransportConfig(host="127.0.0.1"), agent_name="progress-delay")
    try:
        assert "UCX" in transport.agent.backends
        transport.reset()
        last = {"useProgThread": True, "pthrDelay": DEFAULT_DELAY_US, "useListenThread": False}
        assert handed[-1] == last and handed.count(last) == 2  # the agent, then the one the reset started
        assert all(seen["pthrDelay"] > 0 for seen in handed if seen["useProgThread"])
    finally:
        transport.close()


def test_the_variable_sets_the_delay_and_zero_gives_nixls_own_agent(
    handed: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(DELAY_ENV, "2500")
    transport = NixlTransport(CpuBackend(), TransportConfig(host="127.0.0.1"), agent_name="progress-2500")
    transport.close()
    assert handed[-1]["pthrDelay"] == 2500
    monkeypatch.setenv(DELAY_ENV, "0")
    transport = NixlTransport(CpuBackend(), TransportConfig(host="127.0.0.1"), agent_name="progress-0")
    transport.close()
    assert handed[-1] == {"useProgThread": True, "pthrDelay": 0, "useListenThread": False}


@pytest.mark.parametrize("raw", ["-1", "1ms", "2000000", "1.5"])
def test_a_value_that_is_no_delay_is_refused_naming_the_variable(raw: str) -> None:
    with pytest.raises(TransportError, match=DELAY_ENV):
        progress_delay_us({DELAY_ENV: raw})


def test_unset_or_blank_is_the_default() -> None:
    assert progress_delay_us({}) == progress_delay_us({DELAY_ENV: " "}) == DEFAULT_DELAY_US
