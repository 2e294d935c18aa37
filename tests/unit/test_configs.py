"""Configs built from plain data: every error names its path, the value and what was expected; misspelt
enumerated values (protocol, transport, device, layout, mode) fail when the config is built, not later in a worker.

The strings are what an operator writes in ``kv_connector_extra_config``; the connector's config needs no vLLM.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvplane.flows.offload.config import OffloadConfig, StoreConfig
from kvplane.flows.offload.errors import OffloadConfigError
from kvplane.integrations.vllm.config import ConnectorConfig, ConnectorConfigError
from kvplane.kv.layouts import LAYOUTS

STORE = {"master_address": "127.0.0.1:50051"}
GQA_LAYOUT = next(name for name, layout in LAYOUTS.items() if layout.family == "gqa")


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        ({"host_bytes": "4096"}, ["$.host_bytes='4096'", "expected `int`, got `str`"]),
        ({"host_bytes": 0}, ["$.host_bytes=0 must be a positive int"]),
        ({"host_bytes": 1, "store": {}}, ["$.store.master_address is required and missing"]),
        ({"host_bytes": 1, "store": {**STORE, "protocol": "rmda"}},
         ["$.store.protocol='rmda'", "choose one of ['tcp', 'rdma', 'ascend']"]),
        ({"host_bytes": 1, "store": {**STORE, "timeout_s": "abc"}}, ["$.store.timeout_s='abc'", "expected `float`"]),
        ({"host_bytes": 1, "store": {**STORE, "timeout_s": -1}}, ["$.store.timeout_s=-1.0 must be > 0"]),
        ({"host_bytes": 1, "store": {"master_address": "nope"}}, ["$.store.master_address='nope' is not host:port"]),
        ({"host_bytes": 1, "store": {**STORE, "segmentbytes": 1}}, ["$.store has unknown key(s) ['segmentbytes']"]),
        ({"host_bytes": 1, "store": "127.0.0.1:50051"}, ["$.store='127.0.0.1:50051'", "expected `object | null`"]),
    ],
)
def test_an_offload_config_error_names_the_path_the_value_and_what_was_expected(
    raw: dict[str, Any], says: list[str]
) -> None:
    with pytest.raises(OffloadConfigError) as info:
        OffloadConfig.from_dict(raw)
    for words in says:
        assert words in str(info.value)


def test_a_misspelt_protocol_fails_when_a_store_config_is_constructed() -> None:
    with pytest.raises(OffloadConfigError, match=r"StoreConfig.protocol='rmda' is not one of \['tcp', 'rdma'"):
        StoreConfig(master_address="127.0.0.1:1", protocol="rmda")  # type: ignore[arg-type]


def connector(extra: dict[str, Any], role: str = "kv_both", tp_size: int = 1) -> ConnectorConfig:
    return ConnectorConfig.from_extra(extra, role=role, engine_id="e1", tp_size=tp_size)


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ({"offload": {"host_bytes": "1g"}}, ["kv_connector_extra_config", "$.offload.host_bytes='1g'"]),
        ({"offload": {"host_bytes": 1, "store": {**STORE, "protocol": "tpc"}}},
         ["$.offload.store.protocol='tpc'", "'tcp'"]),
        ({"offload": {"host_bytes": 1}, "lookup_timeout_s": "abc"},
         ["$.lookup_timeout_s='abc'", "expected `float`, got `str`"]),
        ({"offload": {"host_bytes": 1}, "lookup_timeout_s": 0}, ["$.lookup_timeout_s=0.0 must be > 0"]),
        ({"offload": {"host_bytes": 1}, "device": "nup"}, ["$.device='nup' is not an installed backend", "'cpu'"]),
        ({"offload": {"host_bytes": 1}, "layouts": {"gqa": "splitkv"}},
         ["$.layouts.gqa='splitkv' is not a layout", "choose one of"]),
        ({"offload": {"host_bytes": 1}, "layouts": {"gqq": GQA_LAYOUT}}, ["$.layouts='gqq' is not a KV family"]),
        ({"disagg": {"port": "5600"}}, ["$.disagg.port='5600'", "expected `int`, got `str`"]),
        ({"disagg": {"transport": "mooncak"}},
         ["$.disagg.transport='mooncak' is not an installed transport", "'mooncake'", "'nixl'"]),
        ({"disagg": {"mode": "pul"}}, ["$.disagg.mode='pul'", "choose one of ['pull', 'push', 'layerwise']"]),
        ({"disagg": {"lease_s": "long"}}, ["$.disagg.lease_s='long'", "expected `float`"]),
        ({"offload": {"host_bytes": 1}, "cross_layer_blocks": "yes"},
         ["$.cross_layer_blocks='yes'", "expected `bool`, got `str`"]),
    ],
)
def test_a_connector_config_error_names_the_path_the_value_and_the_choices(
    extra: dict[str, Any], says: list[str]
) -> None:
    with pytest.raises(ValueError) as info:
        connector(extra)
    assert isinstance(info.value, (ConnectorConfigError, OffloadConfigError))
    for words in says:
        assert words in str(info.value), str(info.value)


def test_a_good_connector_config_keeps_its_typed_values() -> None:
    config = connector({"offload": {"host_bytes": 1 << 20, "store": {**STORE, "protocol": "rdma"}},
                        "disagg": {"port": 7000, "transport": "nixl"}, "device": "cpu",
                        "layouts": {"gqa": GQA_LAYOUT}, "lookup_timeout_s": 2}, tp_size=2)
    assert config.offload is not None and config.offload.store is not None
    assert config.offload.store.protocol == "rdma" and config.lookup_timeout_s == 2.0
    assert config.device == "cpu" and config.layouts == {"gqa": GQA_LAYOUT}
    assert config.disagg_for(1).transport == "nixl" and config.disagg_for(1).rank_port() == 7001
