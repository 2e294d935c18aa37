"""Which backend a worker connector uses: the config's ``device``, else ``$KVPLANE_DEVICE``, else vLLM's platform."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="the vLLM connector tests need vLLM: pip install --no-deps vllm==0.27.1 + .[vllm]")

from kvplane.backend.registry import ENV_VAR  # noqa: E402
from kvplane.errors import KvplaneError  # noqa: E402
from kvplane.integrations.vllm import device  # noqa: E402

CACHES = {"layer": torch.zeros(2, 4, 16, 2, 8)}


def test_vllm_platform_decides_when_nothing_else_does(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert device.platform_device_type() == "cpu"  # vLLM's CUDA wheel on a machine without a GPU
    assert device.select_backend(None, CACHES).name == "cpu"


def test_kvplane_device_beats_the_platform_and_the_config_beats_both(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device, "platform_device_type", lambda: "cuda")
    monkeypatch.setenv(ENV_VAR, "cpu")
    assert device.select_backend(None, CACHES).name == "cpu"
    monkeypatch.setenv(ENV_VAR, "no-such-device")
    assert device.select_backend("cpu", CACHES).name == "cpu"


def test_a_platform_kvplane_cannot_drive_is_an_error_naming_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.setattr(device, "platform_device_type", lambda: "cuda")  # vLLM says cuda, no GPU is here
    with pytest.raises(KvplaneError, match="KVPLANE_DEVICE"):
        device.select_backend(None, CACHES)
