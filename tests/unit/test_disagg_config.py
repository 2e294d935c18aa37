"""``DisaggConfig`` as an operator writes it: typed from plain data with every error naming its path, the value and
the choices; the bind address apart from the advertised one; environment overrides over config keys; Mooncake
protocol/NIC and NIXL backends checked against what the engines accept; one builder for ``TransferParams``."""

from __future__ import annotations

import re
import socket
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from ports import free_port

from kvplane.backend import get_backend
from kvplane.flows.disagg import DisaggConfig, PrefillSide, TransferParams
from kvplane.flows.disagg.wire.errors import DisaggConfigError
from kvplane.integrations.vllm.config import ConnectorConfig, ConnectorConfigError
from kvplane.kv.binding import allocate_cache
from kvplane.kv.bound import bind
from kvplane.kv.spec import KVSpec
from kvplane.transports import options

E = {"engine_id": "e"}


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        ({**E, "port": "5600"}, ["$.disagg.port='5600'", "expected `int`, got `str`"]),
        ({**E, "lease_s": "abc"}, ["$.disagg.lease_s='abc'", "expected `float`"]),
        ({**E, "rank": 1.5}, ["$.disagg.rank=1.5", "expected `int`"]),
        ({**E, "curve_allowed_clients": "k"}, ["$.disagg.curve_allowed_clients='k'", "expected `array`"]),
        ({**E, "mode": "pul"}, ["$.disagg.mode='pul'", "choose one of ['pull', 'push', 'layerwise']"]),
        ({**E, "transport": "mooncak"}, ["$.disagg.transport='mooncak'", "choose one of ['mooncake', 'nixl']"]),
        ({**E, "protocol": "rmda"}, ["$.disagg.protocol='rmda'", "not a Mooncake protocol", "'tcp', 'rdma'"]),
        ({**E, "protocol": "tcp", "device_name": "mlx5_0"}, ["$.disagg.device_name='mlx5_0'", "protocol 'tcp'"]),
        ({**E, "device_name": "mlx5 0"}, ["$.disagg.device_name='mlx5 0'"]),
        ({**E, "nixl_backends": []}, ["$.disagg.nixl_backends=[]", "is empty"]),
        ({**E, "port": 70000}, ["$.disagg.port=70000", "<= 65536"]),
        ({**E, "port": 65530, "tp_size": 4, "dp_rank": 2}, ["$.disagg.port=65530", "dp_rank=2, tp_size=4"]),
        ({**E, "heartbeat_s": 30}, ["$.disagg.heartbeat_s=30.0 must be below lease_s=30.0"]),
        ({**E, "max_inflight": 0}, ["$.disagg.max_inflight=0 must be >= 1"]),
        ({**E, "lease_seconds": 3}, ["$.disagg has unknown key(s) ['lease_seconds']"]),
        ({"port": 1}, ["$.disagg.engine_id is required and missing"]),
    ],
)
def test_a_disagg_config_error_names_the_path_the_value_and_the_choices(raw: dict[str, Any], says: list[str]) -> None:
    with pytest.raises(DisaggConfigError) as info:
        DisaggConfig.from_dict(raw, path="$.disagg", env={})
    for words in says:
        assert words in str(info.value)


def test_a_misspelt_nixl_backend_names_the_plugins_the_installed_nixl_ships() -> None:
    installed = options.installed_nixl_backends()
    if not installed:
        pytest.skip("NIXL is not installed here: no plugin list to check against")
    assert "UCX" in installed
    with pytest.raises(DisaggConfigError, match=r"\$\.nixl_backends=\['UCXX'\] names \['UCXX'\].*'UCX'"):
        DisaggConfig.from_dict({**E, "nixl_backends": ["UCXX"]}, env={})
    assert DisaggConfig.from_dict({**E, "nixl_backends": ["UCX"]}, env={}).nixl_backends == ("UCX",)


def test_misspelt_enumerated_values_fail_when_the_dataclass_is_constructed_directly() -> None:
    with pytest.raises(DisaggConfigError, match=r"DisaggConfig.transport='nxil' is not an installed transport"):
        DisaggConfig(engine_id="e", transport="nxil")
    with pytest.raises(DisaggConfigError, match=r"DisaggConfig.protocol='rmda'"):
        DisaggConfig(engine_id="e", protocol="rmda")


def test_the_connector_config_names_the_disagg_path_of_a_wrong_type_or_a_misspelt_protocol() -> None:
    def connector(disagg: dict[str, Any]) -> ConnectorConfig:
        return ConnectorConfig.from_extra({"disagg": disagg}, role="kv_producer", engine_id="e", env={})

    with pytest.raises(ConnectorConfigError, match=r"kv_connector_extra_config: \$\.disagg\.port='5600'"):
        connector({"port": "5600"})
    with pytest.raises(ConnectorConfigError, match=r"\$\.disagg\.protocol='tpc'"):
        connector({"protocol": "tpc"})
    with pytest.raises(ConnectorConfigError, match=r"\$\.disagg sets \['dp_rank'\], which come from vLLM"):
        connector({"dp_rank": 1})


def test_the_environment_overrides_the_config_and_an_unset_or_empty_variable_does_not() -> None:
    raw = {**E, "host": "127.0.0.2", "port": 5600, "protocol": "tcp"}
    env = {"KVPLANE_SIDE_CHANNEL_HOST": "127.0.0.3", "KVPLANE_SIDE_CHANNEL_PORT": "6100",
           "KVPLANE_SIDE_CHANNEL_BIND_HOST": "127.0.0.1", "KVPLANE_MOONCAKE_PROTOCOL": "", "KVPLANE_NIXL_BACKENDS": "UCX"}
    config = DisaggConfig.from_dict(raw, env=env)
    assert (config.host, config.bind_host, config.port, config.protocol) == ("127.0.0.3", "127.0.0.1", 6100, "tcp")
    assert config.nixl_backends == ("UCX",)
    assert DisaggConfig.from_dict(raw, env={}).host == "127.0.0.2"
    assert DisaggConfig(engine_id="e").port == 0  # built in code: no environment read


def test_a_bad_port_in_the_environment_names_the_variable() -> None:
    with pytest.raises(DisaggConfigError, match=r"\$KVPLANE_SIDE_CHANNEL_PORT='56oo' is not a port number"):
        DisaggConfig.from_dict(E, env={"KVPLANE_SIDE_CHANNEL_PORT": "56oo"})
    with pytest.raises(ConnectorConfigError, match=r"\$KVPLANE_SIDE_CHANNEL_PORT='x'"):
        ConnectorConfig.from_extra({"disagg": {}}, role="kv_producer", engine_id="e",
                                   env={"KVPLANE_SIDE_CHANNEL_PORT": "x"})


def test_the_authentication_rule_applies_to_the_bind_address_not_the_advertised_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVPLANE_CURVE_SECRET_KEY", raising=False)
    with pytest.raises(DisaggConfigError, match=r"DisaggConfig.bind_host='0.0.0.0' is not a loopback address"):
        DisaggConfig(engine_id="e", host="127.0.0.1", bind_host="0.0.0.0")
    assert DisaggConfig(engine_id="e", host="127.0.0.1", bind_host="0.0.0.0", allow_unauthenticated=True)
    # a public advertised name in front of a loopback listener (a local tunnel or proxy) binds only loopback
    assert DisaggConfig(engine_id="e", host="10.1.2.3", bind_host="127.0.0.1").listen_host == "127.0.0.1"
    with pytest.raises(DisaggConfigError, match=r"DisaggConfig.host='10.1.2.3' is not a loopback address"):
        DisaggConfig(engine_id="e", host="10.1.2.3")


def test_ports_count_up_by_tp_rank_within_each_dp_rank() -> None:
    config = DisaggConfig.from_dict({**E, "port": 5600, "rank": 1, "tp_size": 2, "dp_rank": 1}, env={})
    assert (config.base_port(), config.rank_port(), config.rank_port(0)) == (5602, 5603, 5602)
    ports = [DisaggConfig(engine_id="e", port=5600, tp_size=2, dp_rank=d, rank=r).rank_port()
             for d in range(2) for r in range(2)]
    assert ports == [5600, 5601, 5602, 5603]
    assert DisaggConfig(engine_id="e", dp_rank=3).rank_port() == 0  # port 0: any free port


def test_a_prefill_rank_binds_the_bind_address_and_advertises_the_host() -> None:
    spec = KVSpec.gqa(1, 1, 8, dtype="float32", tokens_per_block=16)
    cache = allocate_cache(spec, "packed_kv", 4)
    port = free_port()
    config = DisaggConfig(engine_id="p", host="127.0.0.2", bind_host="127.0.0.1", port=port, protocol="tcp")
    with PrefillSide(bind(get_backend("cpu"), spec, cache, "packed_kv"), config) as side:
        params = side.request_finished("r1", {0: np.array([1])}, 16)
        assert (params.remote_host, params.remote_port) == ("127.0.0.2", port)
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # listening on the bind address
        with pytest.raises(OSError), socket.create_connection(("127.0.0.2", port), timeout=5):
            pass  # and not on the advertised one, which another host (or a NAT) would forward


def test_the_one_builder_gives_the_scheduler_and_the_prefill_rank_the_same_parameters() -> None:
    config = DisaggConfig(engine_id="p", boot_id="b" * 16, host="127.0.0.2", port=5600, tp_size=2, dp_rank=1,
                          mode="push")
    params = TransferParams.from_prefill(config, "r1", [[4, 5]], block_size=16, num_tokens=20, token="a" * 32)
    assert params.to_dict() == {
        "remote_engine_id": "p", "remote_request_id": "r1", "remote_host": "127.0.0.2", "remote_port": 5602,
        "tp_size": 2, "remote_block_ids": [[4, 5]], "remote_block_size": 16, "remote_num_tokens": 20,
        "remote_boot_id": "b" * 16, "kvplane_mode": "push", "kvplane_token": "a" * 32, "do_remote_prefill": True,
        "do_remote_decode": False,
    }


@pytest.mark.parametrize(
    ("device_name", "protocol", "available", "says"),
    [
        ("", "rdma", [], ""),
        ("mlx5_0,mlx5_1", "rdma", ["mlx5_0", "mlx5_1"], ""),
        ("mlx5_0", "rdma", [], ""),  # no sysfs list to check against: Mooncake says at initialize
        ("mlx5_9", "rdma", ["mlx5_0"], "names ['mlx5_9'], which this machine does not have; choose from ['mlx5_0']"),
        ("mlx5_0", "tcp", ["mlx5_0"], "protocol 'tcp' takes none"),
        ("mlx5_0;rm", "rdma", [], "not NIC names"),
    ],
)
def test_a_nic_list_is_checked_against_the_protocol_and_the_rdma_devices_seen(
        device_name: str, protocol: str, available: list[str], says: str) -> None:
    problem = options.nic_problem(device_name, protocol, available)
    assert (says in problem) if says else problem == ""


def test_nixl_backends_are_the_plugin_files_a_nixl_directory_holds(tmp_path: Path) -> None:
    for name in ("libplugin_UCX.so", "libplugin_LIBFABRIC.so", "libnixl.so", "README"):
        (tmp_path / name).touch()
    assert options.nixl_backends([tmp_path, tmp_path / "missing"]) == ["LIBFABRIC", "UCX"]


def test_a_nixl_backend_that_is_installed_but_cannot_start_is_refused_naming_it() -> None:
    """NIXL ships a GDS plugin, which needs NVIDIA GPUDirect Storage: on a machine without it the agent fails."""
    import torch

    from kvplane.errors import TransportError, TransportUnavailable
    from kvplane.transports.base import TransportConfig
    from kvplane.transports.nixl import NixlTransport

    if "GDS" not in options.installed_nixl_backends() or torch.cuda.is_available():
        pytest.skip("needs a NIXL with a GDS plugin on a machine without a GPU (where GDS cannot start)")
    with pytest.raises((TransportError, TransportUnavailable), match=r"backends \['GDS'\]"):
        NixlTransport(get_backend("cpu"), TransportConfig(nixl_backends=("GDS",))).close()


@pytest.mark.parametrize("wildcard", ["0.0.0.0", "::", "*", "[::]"])
def test_a_wildcard_advertised_host_is_refused_pointing_at_bind_host(wildcard: str) -> None:
    """Peers would connect to 0.0.0.0, which is their own machine: the decode reads the wrong instance or none."""
    with pytest.raises(DisaggConfigError, match=rf"DisaggConfig.host='{re.escape(wildcard)}' .*bind_host"):
        DisaggConfig(engine_id="e", host=wildcard, allow_unauthenticated=True)
    with pytest.raises(ConnectorConfigError, match=r"\$KVPLANE_SIDE_CHANNEL_HOST"):
        ConnectorConfig.from_extra({"disagg": {"allow_unauthenticated": True}}, role="kv_producer", engine_id="e",
                                   env={"KVPLANE_SIDE_CHANNEL_HOST": wildcard})


def test_a_bad_value_from_the_environment_names_the_variable_that_set_it() -> None:
    env = {"KVPLANE_MOONCAKE_PROTOCOL": "rmda"}
    with pytest.raises(DisaggConfigError, match=r"\$\.protocol='rmda' .*set by \$KVPLANE_MOONCAKE_PROTOCOL"):
        DisaggConfig.from_dict(E, env=env)
    with pytest.raises(ConnectorConfigError, match=r"\$\.disagg\.protocol='rmda' .*set by \$KVPLANE_MOONCAKE_PROTOCOL"):
        ConnectorConfig.from_extra({"disagg": {}}, role="kv_producer", engine_id="e", env=env)
    with pytest.raises(ConnectorConfigError, match=r"\$\.disagg\.port=0.*set by \$KVPLANE_SIDE_CHANNEL_PORT"):
        ConnectorConfig.from_extra({"disagg": {}}, role="kv_producer", engine_id="e",
                                   env={"KVPLANE_SIDE_CHANNEL_PORT": "0"})
