"""The two-machine P/D commands of docs/vllm.md and docs/deploy.md start as written: every ``--kv-transfer-config``
and ``kvplane info --config`` with a ``disagg`` section on a non-loopback host names CURVE key files, and with
the files the docs' ``kvplane keys`` commands make (``/etc/kvplane`` moved under a temporary directory) each
passes the check ``kvplane info --config`` runs, ending in ``auth CURVE``."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from kvplane.backend.registry import ENV_VAR, default_registry
from kvplane.cli import sidechannel
from kvplane.cli.main import main
from kvplane.flows.disagg.wire.auth import SECRET_ENV
from kvplane.hosts import is_loopback

DOCS = Path(__file__).resolve().parents[2] / "docs"
KEY_DIR = "/etc/kvplane/"
CONFIG = re.compile(r"(?:--kv-transfer-config|kvplane info --config) '(\{.*?\})'")
KEYS = re.compile(r"^mkdir -p /etc/kvplane && kvplane keys (\S+)$", re.M)


def doc_configs() -> list[tuple[str, str]]:
    """(document, JSON) of every P/D config a command in the docs passes."""
    found = []
    for name in ("vllm.md", "deploy.md"):
        for text in CONFIG.findall((DOCS / name).read_text()):
            extra = json.loads(text).get("kv_connector_extra_config", {})
            disagg = extra.get("disagg")
            if disagg is not None and not is_loopback(disagg.get("host", "127.0.0.1")):
                found.append((name, text))
    return found


@pytest.fixture
def keys_made(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The docs' ``kvplane keys`` commands, run with ``/etc/kvplane`` under ``tmp_path``."""
    monkeypatch.delenv(SECRET_ENV, raising=False)
    monkeypatch.delenv(ENV_VAR, raising=False)
    for name in ("vllm.md", "deploy.md"):
        prefixes = KEYS.findall((DOCS / name).read_text())
        assert {p.removeprefix(KEY_DIR) for p in prefixes} == {"prefill", "decode"}, (name, prefixes)
    for prefix in ("prefill", "decode"):
        assert main(["keys", str(tmp_path / prefix)]) == 0
    return tmp_path


def test_every_two_machine_config_in_the_docs_names_key_files() -> None:
    configs = doc_configs()
    assert len(configs) >= 10  # vllm.md: pull and push, CUDA and Ascend, both sides; deploy.md: both sides
    for name, text in configs:
        assert "curve_secret_key_file" in text and KEY_DIR in text, (name, text)


def test_the_docs_configs_pass_the_check_kvplane_info_runs(keys_made: Path) -> None:
    installed = default_registry().names()
    checked = 0
    for name, text in doc_configs():
        whole: dict[str, Any] = json.loads(text.replace(KEY_DIR, f"{keys_made}/"))
        if whole["kv_connector_extra_config"].get("device", "cpu") not in installed:
            continue  # an Ascend config on a machine without kvplane-ascend: refused, rightly
        side = sidechannel.report(json.dumps(whole), 1, 1, env={})
        assert side.get("authenticated") is True, (name, side)
        checked += 1
    assert checked >= 6


def test_kvplane_info_exits_0_on_the_vllm_pull_commands(keys_made: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pull = [text for name, text in doc_configs() if name == "vllm.md" and '"mode":"pull"' in text
            and '"device"' not in text]
    assert len(pull) == 2  # the CUDA prefill and decode
    for text in pull:
        assert main(["info", "--config", text.replace(KEY_DIR, f"{keys_made}/")]) == 0
        assert "auth CURVE" in capsys.readouterr().out
