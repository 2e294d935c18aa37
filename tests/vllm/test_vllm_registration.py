"""How vLLM finds the connector: by module path, by the general-plugin entry point, and what config it refuses."""

from __future__ import annotations

from collections.abc import Iterator
from importlib.metadata import entry_points

import pytest

pytest.importorskip("vllm", reason="the vLLM connector tests need vLLM: pip install --no-deps vllm==0.27.1 + .[vllm]")

from vllm.config import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402

from kvplane.integrations.vllm import CONNECTOR_NAME, plugin  # noqa: E402
from kvplane.integrations.vllm.config import ConnectorConfig, ConnectorConfigError  # noqa: E402
from kvplane.integrations.vllm.connector import KVPlaneConnector  # noqa: E402


@pytest.fixture
def clean_registry() -> Iterator[None]:
    before = dict(KVConnectorFactory._registry)
    KVConnectorFactory._registry.pop(CONNECTOR_NAME, None)
    try:
        yield
    finally:
        KVConnectorFactory._registry.clear()
        KVConnectorFactory._registry.update(before)


def test_kv_connector_module_path_resolves_to_the_hma_capable_connector() -> None:
    config = KVTransferConfig(kv_connector=CONNECTOR_NAME, kv_connector_module_path="kvplane.integrations.vllm",
                              kv_role="kv_both", kv_connector_extra_config={"offload": {"host_bytes": 1 << 20}})
    assert KVConnectorFactory.get_connector_class(config) is KVPlaneConnector
    assert KVConnectorFactory.supports_hma_config(config)


@pytest.mark.usefixtures("clean_registry")
def test_the_general_plugin_registers_by_name_and_tolerates_a_second_call() -> None:
    (ep,) = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "kvplane"]
    register = ep.load()
    assert register is plugin.register
    register()
    register()  # vLLM loads plugins in every process, sometimes twice in one
    assert KVConnectorFactory.get_connector_class_by_name(CONNECTOR_NAME) is KVPlaneConnector
    by_name = KVTransferConfig(kv_connector=CONNECTOR_NAME, kv_role="kv_producer",
                               kv_connector_extra_config={"disagg": {"port": 5600}})
    assert KVConnectorFactory.get_connector_class(by_name) is KVPlaneConnector


@pytest.mark.usefixtures("clean_registry")
def test_an_existing_registration_under_the_name_is_left_alone() -> None:
    KVConnectorFactory.register_connector(CONNECTOR_NAME, "vllm.distributed.kv_transfer.kv_connector.v1",
                                          "DecodeBenchConnector")
    plugin.register()
    assert KVConnectorFactory.get_connector_class_by_name(CONNECTOR_NAME).__name__ == "DecodeBenchConnector"


@pytest.mark.usefixtures("clean_registry")
def test_vllm_load_general_plugins_runs_the_entry_point(monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm.plugins

    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    vllm.plugins.load_general_plugins()
    assert CONNECTOR_NAME in KVConnectorFactory._registry


@pytest.mark.parametrize(
    ("extra", "role", "words"),
    [
        ({"offload": {"host_bytes": 1}, "typo": 1}, "kv_both", ["unknown key(s) ['typo']", "kvplane knows"]),
        ({"offload": {"host_bytes": 1}}, "kv_sideways", ["kv_role='kv_sideways'", "kv_producer"]),
        ({}, "kv_both", ["neither 'offload' nor 'disagg'", "host_bytes"]),
        ({"disagg": {"port": 0}}, "kv_producer", ["disagg.port=0", "base port"]),
        ({"disagg": {"engine_id": "x"}}, "kv_producer", ["['engine_id']", "come from vLLM"]),
        ({"disagg": {"mode": "teleport"}}, "kv_consumer", ["mode='teleport'", "pull"]),
        ({"offload": {"host_bytes": -5}}, "kv_both", ["host_bytes=-5", "positive int"]),
        ({"offload": {"host_bytes": 1}, "layouts": "split_kv"}, "kv_both", ["layouts='split_kv'", "{'gqa'"]),
    ],
)
def test_a_bad_extra_config_names_the_field_the_value_and_the_fix(extra: dict, role: str, words: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        ConnectorConfig.from_extra(extra, role=role, engine_id="e1")
    for w in words:
        assert w in str(info.value)


def test_roles_pick_the_sides_and_ranks_get_their_own_port() -> None:
    producer = ConnectorConfig.from_extra({"disagg": {"port": 7000}}, role="kv_producer", engine_id="p", tp_size=2)
    assert producer.is_prefill and not producer.is_decode
    assert producer.disagg_for(1).rank_port() == 7001 and producer.disagg_for(1).boot_id == producer.boot_id
    both = ConnectorConfig.from_extra({"disagg": {}}, role="kv_both", engine_id="b")
    assert both.is_prefill and both.is_decode and both.port == 5600
    offload_only = ConnectorConfig.from_extra({"offload": {"host_bytes": 1 << 20}}, role="kv_both", engine_id="o")
    assert not offload_only.is_prefill and not offload_only.is_decode
    with pytest.raises(ConnectorConfigError):
        ConnectorConfig.from_extra({"disagg": {"port": 5600}}, role=None, engine_id="x")


def test_layer_wise_work_asks_vllm_for_piecewise_cuda_graphs() -> None:
    assert KVPlaneConnector.requires_piecewise_for_cudagraph({"offload": {"host_bytes": 1 << 30}})
    assert KVPlaneConnector.requires_piecewise_for_cudagraph({"disagg": {"mode": "layerwise"}})
    assert not KVPlaneConnector.requires_piecewise_for_cudagraph({"disagg": {"mode": "pull"}})
