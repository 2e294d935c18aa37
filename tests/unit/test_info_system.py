"""What ``kvplane info`` reads about the machine, on files and tools a test lays out: driver versions from their
version files and vendor tools (absent ones said plainly), RDMA ports from sysfs, secrets redacted."""

from __future__ import annotations

import sys
from pathlib import Path

from kvplane.cli import system


def test_drivers_are_read_from_version_files_and_tools_and_absent_ones_say_so(tmp_path: Path) -> None:
    cann = tmp_path / "version.cfg"
    cann.write_text("# comment-free\nversion=8.1.RC1\nrelease=2025\nmore=1\n")
    tool = tmp_path / "fake-smi"
    tool.write_text(f"#!{sys.executable}\nprint('H100, 570.86.15, 81559 MiB')\n")
    tool.chmod(0o755)
    found = system.drivers({"CANN": (str(tmp_path / "missing"), str(cann)), "CNToolkit": (str(tmp_path / "no"),)},
                           {"fake-smi": [str(tool)], "no-such-smi": ["no-such-smi-xyz"]})
    assert found["CANN"] == f"# comment-free | version=8.1.RC1 ({cann})"
    assert found["CNToolkit"] == "not found" and found["no-such-smi"] == "not found"
    assert found["fake-smi"] == "H100, 570.86.15, 81559 MiB"


def test_rdma_devices_list_each_port_state_and_link_layer(tmp_path: Path) -> None:
    port = tmp_path / "mlx5_0" / "ports" / "1"
    port.mkdir(parents=True)
    (port / "state").write_text("4: ACTIVE\n")
    (port / "link_layer").write_text("Ethernet\n")
    assert system.rdma_devices(tmp_path) == [
        {"name": "mlx5_0", "ports": [{"port": "1", "state": "4: ACTIVE", "link_layer": "Ethernet"}]}]
    assert system.rdma_devices(tmp_path / "absent") == []


def test_the_environment_report_keeps_engine_variables_and_redacts_secrets() -> None:
    env = {"KVPLANE_CURVE_SECRET_KEY": "s" * 40, "KVPLANE_SIDE_CHANNEL_HOST": "10.0.0.7", "MC_REDIS_PASSWORD": "pw",
           "UCX_TLS": "tcp", "HOME": "/root", "AWS_SECRET_ACCESS_KEY": "x"}
    assert system.environment(env) == {"KVPLANE_CURVE_SECRET_KEY": "<redacted>", "KVPLANE_SIDE_CHANNEL_HOST": "10.0.0.7",
                                       "MC_REDIS_PASSWORD": "<redacted>", "UCX_TLS": "tcp"}
    assert system.redact({"disagg": {"curve_secret_key": "s", "curve_server_key": "p"}}) == \
        {"disagg": {"curve_secret_key": "<redacted>", "curve_server_key": "p"}}


def test_passwords_inside_urls_are_redacted_from_values_whatever_the_variable_is_called() -> None:
    env = {"MC_METADATA_SERVER": "redis://admin:hunter2@10.0.0.1:6379", "MC_MS_AUTO_DISC": "1",
           "KVPLANE_STORE_URL": "http://user@h:8080/metadata"}
    assert system.environment(env) == {"KVPLANE_STORE_URL": "http://user@h:8080/metadata", "MC_MS_AUTO_DISC": "1",
                                       "MC_METADATA_SERVER": "redis://admin:<redacted>@10.0.0.1:6379"}
    assert system.redact({"store": {"metadata_server": "etcd://u:pw@e1:2379,u:pw@e2:2379"}}) == \
        {"store": {"metadata_server": "etcd://u:<redacted>@e1:2379,u:<redacted>@e2:2379"}}
