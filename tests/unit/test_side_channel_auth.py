"""The side channel's authentication rule is one function (``auth.check``): the sides call it through
``curve_keys``, ``DisaggConfig`` calls its role-free part, and ``kvplane info`` calls it for the roles the
config will run, so ``info`` never reports ``auth CURVE`` for a config a side refuses. The secret key in
``$KVPLANE_CURVE_SECRET_KEY`` overrides the config's, as every other environment override does."""

from __future__ import annotations

import json
from typing import Any

import pytest
import zmq

from kvplane.cli import sidechannel
from kvplane.flows.disagg.wire.auth import SECRET_ENV, curve_keys
from kvplane.flows.disagg.wire.config import DisaggConfig
from kvplane.flows.disagg.wire.errors import DisaggConfigError


def keypair() -> tuple[str, str]:
    public, secret = zmq.curve_keypair()
    return public.decode(), secret.decode()


PUB, SEC = keypair()
OTHER_PUB, OTHER_SEC = keypair()


@pytest.fixture(autouse=True)
def no_secret_in_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)


def info(disagg: dict[str, Any], kv_role: str) -> dict[str, Any]:
    config = {"kv_role": kv_role, "kv_connector_extra_config": {"disagg": disagg}}
    return sidechannel.report(json.dumps(config), 1, 1)


def side_refusal(disagg: dict[str, Any], role: str) -> str:
    """What the side (``PrefillSide`` / ``DecodeSide``, through ``curve_keys``) says when it starts, or that
    building the config already refused it."""
    try:
        config = DisaggConfig.from_dict({"engine_id": "e", **disagg}, path="$.disagg", env={})
        curve_keys(config, role)
    except DisaggConfigError as e:
        return str(e)
    raise AssertionError(f"the {role} side accepted {disagg}")


REFUSED = {
    "prefill_without_allowed_clients": ({"curve_secret_key": SEC}, "prefill", "curve_allowed_clients"),
    "decode_without_server_key": ({"curve_secret_key": SEC}, "decode", "curve_server_key"),
    "peer_keys_without_secret": ({"curve_allowed_clients": [PUB]}, "prefill", "curve_secret_key"),
    "short_secret": ({"curve_secret_key": SEC[:39], "curve_allowed_clients": [PUB]}, "prefill",
                     "curve_secret_key"),
    "secret_not_z85": ({"curve_secret_key": "~" * 40, "curve_allowed_clients": [PUB]}, "prefill",
                       "curve_secret_key"),
    "allowed_client_not_z85": ({"curve_secret_key": SEC, "curve_allowed_clients": ["~" * 40]}, "prefill",
                               "curve_allowed_clients"),
    "server_key_short": ({"curve_secret_key": SEC, "curve_server_key": PUB[:20]}, "decode", "curve_server_key"),
    "public_bind_without_keys": ({"bind_host": "0.0.0.0"}, "prefill", "allow_unauthenticated"),
}
ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_info_reports_every_config_the_side_refuses_with_the_sides_own_error(case: str) -> None:
    disagg, role, field = REFUSED[case]
    refusal = side_refusal(disagg, role)
    assert field in refusal  # a DisaggConfigError naming the field and the fix, not a bare ZMQError
    side = info(disagg, ROLES[role])
    assert side.get("error", "").endswith(refusal.split(": ", 1)[-1]), side
    assert "authenticated" not in side
    text = "\n".join(sidechannel.render(side))
    assert "auth CURVE" not in text and "error:" in text
    assert SEC not in text and SEC not in json.dumps(side)


def test_info_says_curve_for_a_config_both_sides_accept() -> None:
    prefill = {"curve_secret_key": SEC, "curve_allowed_clients": [OTHER_PUB]}
    assert curve_keys(DisaggConfig(engine_id="e", curve_secret_key=SEC, curve_allowed_clients=(OTHER_PUB,)),
                      "prefill") is not None
    side = info(prefill, "kv_producer")
    assert side["authenticated"] is True and "auth CURVE" in "\n".join(sidechannel.render(side))
    side = info({}, "kv_both")
    assert side["authenticated"] is False and "auth off" in "\n".join(sidechannel.render(side))


def test_info_checks_both_roles_of_a_kv_both_instance_and_says_how_to_check_one() -> None:
    side = info({"curve_secret_key": SEC, "curve_allowed_clients": [OTHER_PUB]}, "kv_both")
    assert "curve_server_key" in side["error"]
    assert "authenticated" not in side


def test_the_secret_key_in_the_environment_overrides_the_one_in_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SECRET_ENV, OTHER_SEC)
    config = DisaggConfig(engine_id="e", curve_secret_key=SEC, curve_allowed_clients=(PUB,))
    keys = curve_keys(config, "prefill")
    assert keys is not None and keys.public.decode() == OTHER_PUB


def test_a_bad_secret_in_the_environment_names_the_variable_and_never_prints_the_key(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SECRET_ENV, "~" * 40)
    with pytest.raises(DisaggConfigError, match=rf"\${SECRET_ENV}") as e:
        DisaggConfig(engine_id="e", curve_secret_key=SEC, curve_allowed_clients=(PUB,))
    assert "~~~~" not in str(e.value) and SEC not in str(e.value)
