"""``device`` and ``$KVPLANE_DEVICE`` are checked when the connector is built (scheduler side too), not first in
``register_kv_caches`` after the model loaded: an unknown name is a ``ConnectorConfigError`` naming the setting,
the value, the backends kvplane knows and the fix. The connector is made by vLLM's ``KVConnectorFactory``."""

from __future__ import annotations

import uuid
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the vLLM connector tests need vLLM: pip install --no-deps vllm==0.27.1 + .[vllm]")

import torch  # noqa: E402
from vllm.config import CacheConfig, KVTransferConfig, ParallelConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402

from kvplane.backend.registry import ENV_VAR, default_registry  # noqa: E402
from kvplane.integrations.vllm.config import ConnectorConfigError  # noqa: E402

OFFLOAD = {"offload": {"host_bytes": 1 << 20}}


def make_connector(extra: dict[str, Any], role: KVConnectorRole = KVConnectorRole.SCHEDULER) -> Any:
    """The connector as vLLM makes it: from a ``KVTransferConfig`` naming the module, nothing registered yet."""
    transfer = KVTransferConfig(kv_connector="KVPlaneConnector", kv_connector_module_path="kvplane.integrations.vllm",
                                kv_role="kv_both", kv_connector_extra_config=extra,
                                engine_id=f"dev-{uuid.uuid4().hex[:8]}")
    vllm_config = SimpleNamespace(
        kv_transfer_config=transfer, parallel_config=ParallelConfig(), cache_config=CacheConfig(block_size=16),
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=False), model_config=None,
        instance_id="dev",
    )
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float32)
    kv_cache_config = KVCacheConfig(8, [], [KVCacheGroupSpec(["model.layers.0.attn"], spec)])
    return KVConnectorFactory.create_connector(vllm_config, role, kv_cache_config)


def test_an_unknown_kvplane_device_is_refused_when_the_scheduler_connector_is_built(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(ENV_VAR, "nup")
    with pytest.raises(ConnectorConfigError) as info:
        make_connector(OFFLOAD)
    message = str(info.value)
    assert f"${ENV_VAR}='nup'" in message
    for name in default_registry().names():
        assert repr(name) in message
    assert "unset" in message and "kvplane-ascend" in message


def test_an_unknown_device_key_names_the_key_and_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(ConnectorConfigError) as info:
            make_connector({**OFFLOAD, "device": "nup"}, role)
        message = str(info.value)
        assert "$.device='nup'" in message and "'cpu'" in message and "kvplane-ascend" in message


def test_the_device_key_wins_so_an_unused_kvplane_device_is_not_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, "nup")
    assert make_connector({**OFFLOAD, "device": "cpu"}).config.device == "cpu"


def test_names_are_matched_as_the_backend_registry_matches_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, " CPU ")  # the registry strips and lowercases what it is asked for
    make_connector(OFFLOAD)
    monkeypatch.setenv(ENV_VAR, "")  # empty: not set (vLLM's platform decides)
    make_connector(OFFLOAD)
