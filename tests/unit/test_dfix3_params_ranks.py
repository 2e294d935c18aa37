"""``kv_transfer_params`` name the prefill ranks a decode rank connects to (``remote_port + r`` for r below
``tp_size``): a count that would open more side-channel sockets than any instance has, or ports past 65535, is
refused where the params are built (``start_pull``, ``register_push`` and ``decline`` raise in the caller's thread),
naming the fields, before the I/O loop opens a socket. On main ``tp_size=100000`` was taken, and the loop opened a
DEALER per rank until libzmq ran out of sockets or a port went past 65535 (leaking every socket made until then)."""

from __future__ import annotations

import pytest

from kvplane.flows.disagg import TransferParams
from kvplane.flows.disagg.wire.errors import TransferParamsError
from kvplane.flows.disagg.wire.limits import MAX_PREFILL_TP
from kvplane.flows.disagg.wire.tokens import new_token


def params(**over: object) -> dict[str, object]:
    return {"remote_engine_id": "prefill", "remote_request_id": "r", "remote_host": "127.0.0.1",
            "remote_port": 5600, "tp_size": 2, "kvplane_token": new_token(), **over}


@pytest.mark.parametrize("over, named", [
    ({"tp_size": 100_000}, "tp_size=100000"),
    ({"tp_size": MAX_PREFILL_TP + 1}, f"tp_size={MAX_PREFILL_TP + 1}"),
    ({"remote_port": 65530, "tp_size": 8}, "remote_port=65530"),
])
def test_params_naming_more_prefill_ranks_than_ports_or_sockets_are_refused_naming_the_fields(
    over: dict[str, object], named: str
) -> None:
    with pytest.raises(TransferParamsError, match=named) as e:
        TransferParams.from_dict(params(**over))
    assert "tp_size" in str(e.value) and "remote_port" in str(e.value)


def test_the_last_prefill_rank_may_listen_on_port_65535() -> None:
    assert TransferParams.from_dict(params(remote_port=65534, tp_size=2)).tp_size == 2
    assert TransferParams.from_dict(params(tp_size=MAX_PREFILL_TP)).tp_size == MAX_PREFILL_TP
