"""A backend's ``nixl_env_defaults`` are in UCX's environment while the NIXL agent starts, and only then; a value
the user set wins. The cuda backend's turns cuda_ipc GET on (UCX's "auto" turns it off without NVLink, and a
NIXL READ between two processes on one GPU then went through TCP: the first H200 run, docs/results)."""

from __future__ import annotations

import os
from typing import Any, ClassVar

import pytest
from kvplane_cuda.backend import CudaBackend

from kvplane.backend.cpu.backend import CpuBackend
from kvplane.transports.base import TransportConfig
from kvplane.transports.nixl import NixlTransport

KEY = "UCX_CUDA_IPC_ENABLE_GET_ZCOPY"


class DeviceDefaults(CpuBackend):
    nixl_env_defaults: ClassVar[dict[str, str]] = {KEY: "y"}


def _seen_at_start(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, str | None]]:
    seen: list[dict[str, str | None]] = []
    real = NixlTransport._start_agent

    def spy(self: NixlTransport) -> Any:
        original = self._nixl.nixl_agent

        def agent(*args: Any, **kwargs: Any) -> Any:
            seen.append({k: os.environ.get(k) for k in (KEY, "UCX_NET_DEVICES")})
            return original(*args, **kwargs)

        monkeypatch.setattr(self._nixl, "nixl_agent", agent)
        return real(self)

    monkeypatch.setattr(NixlTransport, "_start_agent", spy)
    return seen


def test_the_device_defaults_are_set_while_the_agent_starts_and_removed_after(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KEY, raising=False)
    seen = _seen_at_start(monkeypatch)
    transport = NixlTransport(DeviceDefaults(), TransportConfig(host="127.0.0.1"), agent_name="env-defaults")
    try:
        assert seen == [{KEY: "y", "UCX_NET_DEVICES": "lo"}]
        assert KEY not in os.environ
    finally:
        transport.close()


def test_a_value_the_user_set_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY, "n")
    seen = _seen_at_start(monkeypatch)
    transport = NixlTransport(DeviceDefaults(), TransportConfig(host="127.0.0.1"), agent_name="env-user")
    try:
        assert seen[0][KEY] == "n" and os.environ[KEY] == "n"
    finally:
        transport.close()


def test_the_cuda_backend_turns_cuda_ipc_get_on() -> None:
    assert CudaBackend.nixl_env_defaults == {KEY: "y"}
