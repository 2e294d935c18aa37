"""CURVE keys a user makes and shares as files: ``kvplane keys NAME`` writes ``NAME.key`` (secret, mode 0600)
and ``NAME.pub`` (public), Z85 text as ``zmq.curve_keypair()`` makes them, and refuses to overwrite without
``--force``; ``DisaggConfig``'s ``curve_*_file`` fields read them when the config is built, and a file that cannot
serve is a ``DisaggConfigError`` naming the field, the path and the fix, never the secret."""

from __future__ import annotations

import json
import stat
from pathlib import Path
from typing import Any

import pytest
import zmq

from kvplane.cli import sidechannel
from kvplane.cli.main import main
from kvplane.flows.disagg.wire.auth import SECRET_ENV, check
from kvplane.flows.disagg.wire.config import DisaggConfig
from kvplane.flows.disagg.wire.errors import DisaggConfigError
from kvplane.integrations.vllm.config import ConnectorConfig, ConnectorConfigError


@pytest.fixture(autouse=True)
def no_secret_in_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)


def make_keys(prefix: Path, *extra: str) -> tuple[str, str]:
    """``kvplane keys PREFIX``: the (public, secret) it wrote."""
    assert main(["keys", str(prefix), *extra]) == 0
    return Path(f"{prefix}.pub").read_text().strip(), Path(f"{prefix}.key").read_text().strip()


def config(**fields: Any) -> DisaggConfig:
    return DisaggConfig.from_dict({"engine_id": "e", "host": "10.0.0.7", **fields}, path="$.disagg", env={})


def test_keys_writes_a_matching_pair_with_a_private_secret(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    public, secret = make_keys(tmp_path / "prefill")
    assert len(public) == len(secret) == 40
    assert zmq.curve_public(secret.encode()).decode() == public
    assert stat.S_IMODE((tmp_path / "prefill.key").stat().st_mode) == 0o600
    out = capsys.readouterr().out
    assert public in out and secret not in out and "prefill.key" in out


def test_keys_refuses_to_overwrite_without_force(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    public, secret = make_keys(tmp_path / "decode")
    assert main(["keys", str(tmp_path / "decode")]) == 2
    err = capsys.readouterr().err
    assert "decode.key" in err and "--force" in err
    assert (tmp_path / "decode.pub").read_text().strip() == public  # untouched
    (tmp_path / "decode.key").chmod(0o644)
    new_public, new_secret = make_keys(tmp_path / "decode", "--force")
    assert (new_public, new_secret) != (public, secret)
    assert stat.S_IMODE((tmp_path / "decode.key").stat().st_mode) == 0o600


def test_keys_refuses_when_only_the_public_file_is_there(tmp_path: Path) -> None:
    (tmp_path / "p.pub").write_text("keep me\n")
    assert main(["keys", str(tmp_path / "p")]) == 2
    assert not (tmp_path / "p.key").exists() and (tmp_path / "p.pub").read_text() == "keep me\n"


def test_key_files_give_both_sides_their_keys(tmp_path: Path) -> None:
    prefill_pub, prefill_sec = make_keys(tmp_path / "prefill")
    decode_pub, decode_sec = make_keys(tmp_path / "decode")
    other_pub, _ = make_keys(tmp_path / "decode-b")
    allowed = tmp_path / "decodes.pub"
    allowed.write_text(f"# decode instances\n{decode_pub}\n\n{other_pub}\n")
    prefill = config(curve_secret_key_file=str(tmp_path / "prefill.key"), curve_allowed_clients_file=str(allowed))
    decode = config(curve_secret_key_file=str(tmp_path / "decode.key"),
                    curve_server_key_file=str(tmp_path / "prefill.pub"))
    keys = check(prefill, "prefill", env={})
    assert keys is not None and keys.public.decode() == prefill_pub
    assert keys.allowed == {decode_pub.encode(), other_pub.encode()}
    keys = check(decode, "decode", env={})
    assert keys is not None and keys.server.decode() == prefill_pub and keys.public.decode() == decode_pub
    assert prefill_sec not in repr(prefill) and decode_sec not in repr(decode)


def test_allowed_clients_from_a_file_add_to_the_listed_ones(tmp_path: Path) -> None:
    a, _ = make_keys(tmp_path / "a")
    b, _ = make_keys(tmp_path / "b")
    _, secret = make_keys(tmp_path / "p")
    built = config(curve_secret_key=secret, curve_allowed_clients=[a],
                   curve_allowed_clients_file=str(tmp_path / "b.pub"))
    assert built.curve_allowed_clients == (a, b)


def refusal(**fields: Any) -> str:
    with pytest.raises(DisaggConfigError) as info:
        config(**fields)
    return str(info.value)


def test_a_key_file_that_cannot_serve_names_the_field_the_path_and_the_fix(tmp_path: Path) -> None:
    public, secret = make_keys(tmp_path / "p")
    missing = tmp_path / "nowhere.key"
    message = refusal(curve_secret_key_file=str(missing), curve_allowed_clients=[public])
    assert f"$.disagg.curve_secret_key_file={str(missing)!r}" in message and "kvplane keys" in message
    bad = tmp_path / "bad.pub"
    bad.write_text("not a key\n")
    message = refusal(curve_secret_key=secret, curve_server_key_file=str(bad))
    assert f"$.disagg.curve_server_key_file={str(bad)!r}" in message and "Z85" in message
    message = refusal(curve_secret_key_file=str(tmp_path / "p.pub"), curve_allowed_clients=[public])
    assert "curve_secret_key_file" in message and "p.key" in message  # the public file named by mistake
    message = refusal(curve_secret_key=secret, curve_server_key_file=str(tmp_path / "p.key"))
    assert "curve_server_key_file" in message and "p.pub" in message and secret not in message
    empty = tmp_path / "empty.pub"
    empty.write_text("# nobody yet\n")
    message = refusal(curve_secret_key=secret, curve_allowed_clients_file=str(empty))
    assert "curve_allowed_clients_file" in message and str(empty) in message


def test_a_secret_file_is_never_quoted(tmp_path: Path) -> None:
    public, secret = make_keys(tmp_path / "p")
    wrong = tmp_path / "wrong.key"
    wrong.write_text(secret[:-1] + "\n")
    message = refusal(curve_secret_key_file=str(wrong), curve_allowed_clients=[public])
    assert "curve_secret_key_file" in message and secret[:-1] not in message


def test_a_key_and_a_different_key_file_for_one_field_is_refused(tmp_path: Path) -> None:
    public, secret = make_keys(tmp_path / "p")
    _, other = make_keys(tmp_path / "q")
    message = refusal(curve_secret_key=other, curve_secret_key_file=str(tmp_path / "p.key"),
                      curve_allowed_clients=[public])
    assert "curve_secret_key" in message and "curve_secret_key_file" in message and other not in message


def test_the_connector_reads_the_files_when_it_parses_its_config(tmp_path: Path) -> None:
    public, _ = make_keys(tmp_path / "p")
    extra = {"disagg": {"host": "10.0.0.7", "curve_secret_key_file": str(tmp_path / "p.key"),
                        "curve_allowed_clients_file": str(tmp_path / "p.pub")}}
    parsed = ConnectorConfig.from_extra(extra, role="kv_producer", engine_id="e", env={})
    assert parsed.disagg_for(0).curve_allowed_clients == (public,)
    extra["disagg"]["curve_secret_key_file"] = str(tmp_path / "gone.key")
    with pytest.raises(ConnectorConfigError, match=r"\$\.disagg\.curve_secret_key_file=.*gone\.key"):
        ConnectorConfig.from_extra(extra, role="kv_producer", engine_id="e", env={})


def test_info_says_curve_for_configs_made_of_key_files(tmp_path: Path) -> None:
    make_keys(tmp_path / "prefill")
    make_keys(tmp_path / "decode")
    prefill = {"kv_role": "kv_producer", "kv_connector_extra_config": {"disagg": {
        "host": "10.0.0.7", "curve_secret_key_file": str(tmp_path / "prefill.key"),
        "curve_allowed_clients_file": str(tmp_path / "decode.pub")}}}
    decode = {"kv_role": "kv_consumer", "kv_connector_extra_config": {"disagg": {
        "host": "10.0.0.8", "curve_secret_key_file": str(tmp_path / "decode.key"),
        "curve_server_key_file": str(tmp_path / "prefill.pub")}}}
    for whole in (prefill, decode):
        side = sidechannel.report(json.dumps(whole), 1, 1, env={})
        assert side.get("authenticated") is True, side
