"""The disaggregation flow's data: side-channel messages, transfer parameters, config bounds, staging arena.

No sockets or engines here: what travels must round-trip exactly, and anything malformed must be refused with
a typed error that names the problem (the integration tests in ``tests/disagg`` drive the real paths).
"""

from __future__ import annotations

import json

import msgspec
import pytest

from kvplane.backend import get_backend
from kvplane.flows.disagg import (
    DisaggConfig,
    DisaggConfigError,
    PrefillSide,
    ProtocolError,
    TransferParams,
    TransferParamsError,
)
from kvplane.flows.disagg.wire import messages
from kvplane.flows.disagg.wire.errors import DisaggError
from kvplane.flows.disagg.wire.staging import StagingArena
from kvplane.kv.binding import allocate_cache
from kvplane.kv.bound import bind
from kvplane.kv.spec import KVSpec

ALL = [
    messages.Handshake("e", "b", "decode", 0, 2, b"m", b"p", "f"),
    messages.Reject("layers", "a", "b", "why"),
    messages.Heartbeat("e", 1, [("r1", "t1"), ("r2", "t2")]),
    messages.ReadDone("r", "e", 1, 2, True, "b", "t"),
    messages.PushRegister("r", "e", 0, 1, {0: [1, 2], 1: [3]}, 40, 4096, 128, "b", "t"),
    messages.Cancel("r", "e", 0, "t"),
    messages.PushResult("r", 1, False, "gone"),
    messages.Problem("r", 0, "stale"),
]


@pytest.mark.parametrize("message", ALL, ids=[type(m).__name__ for m in ALL])
def test_every_message_round_trips_through_msgpack(message: messages.Message) -> None:
    assert messages.decode(messages.encode(message), 1 << 20) == message


@pytest.mark.parametrize(
    "payload,match",
    [
        (b"\xc1\x00", "malformed"),
        (msgspec.msgpack.encode({"type": "shutdown"}), "malformed"),
        (msgspec.msgpack.encode({"type": "cancel", "request_id": 1, "engine_id": "e", "rank": 0}), "malformed"),
        (msgspec.msgpack.encode([1, 2, 3]), "malformed"),
        (b"x" * 5000, "exceeds max_message_bytes=4096"),
    ],
    ids=["not-msgpack", "unknown-type", "wrong-field-type", "not-a-map", "oversized"],
)
def test_bad_bytes_are_a_protocol_error_naming_the_problem(payload: bytes, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        messages.decode(payload, 4096)


def params(**over: object) -> dict[str, object]:
    base = TransferParams(remote_engine_id="p", remote_request_id="r", remote_host="10.0.0.1", remote_port=5600,
                          tp_size=2, remote_block_ids=[[1, 2], [7]], remote_block_size=16, remote_num_tokens=30,
                          remote_boot_id="b").to_dict()
    return {**base, **over}


def test_push_params_say_nothing_of_what_only_a_finished_prefill_knows() -> None:
    """A decode reads a missing ``remote_num_tokens`` as "the whole prompt"; a 0 made it receive nothing."""
    raw = TransferParams.for_push("p", "r", "10.0.0.1", 5600, mode="layerwise").to_dict()
    assert not {"remote_num_tokens", "remote_block_ids", "remote_block_size", "remote_boot_id"} & raw.keys()
    back = TransferParams.from_dict(json.loads(json.dumps(raw)))
    assert back.kvplane_mode == "layerwise" and back.kvplane_token == raw["kvplane_token"]
    assert back.remote_num_tokens == 0 and back.remote_block_ids == []


def test_transfer_params_survive_json_as_a_proxy_forwards_them() -> None:
    raw = params()
    assert raw["do_remote_prefill"] is True and raw["do_remote_decode"] is False
    back = TransferParams.from_dict(json.loads(json.dumps(raw)))
    assert back.remote_block_ids == [[1, 2], [7]] and back.block_ids([0, 1]) == {0: [1, 2], 1: [7]}


def test_transfer_params_ignore_keys_a_proxy_adds() -> None:
    assert TransferParams.from_dict(params(proxy_trace="abc")).remote_port == 5600


@pytest.mark.parametrize(
    "over,match",
    [
        ({"remote_port": "5600x"}, "remote_port"),
        ({"remote_port": 0}, "remote_port=0"),
        ({"tp_size": 0}, "tp_size=0"),
        ({"kvplane_mode": "teleport"}, "kvplane_mode"),
        ({"remote_block_ids": [[1], ["x"]]}, "remote_block_ids"),
    ],
)
def test_wrong_transfer_params_name_the_field(over: dict[str, object], match: str) -> None:
    with pytest.raises(TransferParamsError, match=match):
        TransferParams.from_dict(params(**over))


def test_missing_transfer_params_field_is_named() -> None:
    raw = params()
    del raw["remote_host"]
    with pytest.raises(TransferParamsError, match="remote_host"):
        TransferParams.from_dict(raw)


def test_block_ids_for_a_model_with_other_groups_are_refused() -> None:
    with pytest.raises(TransferParamsError, match="has 2 group"):
        TransferParams.from_dict(params()).block_ids([0])


@pytest.mark.parametrize(
    "fields,match",
    [
        ({"engine_id": ""}, "engine_id"),
        ({"engine_id": "e", "rank": 2, "tp_size": 2}, "rank=2"),
        ({"engine_id": "e", "mode": "fax"}, "mode"),
        ({"engine_id": "e", "lease_s": 0}, "lease_s"),
        ({"engine_id": "e", "heartbeat_s": 30, "lease_s": 30}, "heartbeat_s"),
        ({"engine_id": "e", "port": 70000}, "port"),
        ({"engine_id": "e", "max_inflight": 0}, "max_inflight"),
    ],
)
def test_config_out_of_range_names_the_field(fields: dict[str, object], match: str) -> None:
    with pytest.raises(DisaggConfigError, match=match):
        DisaggConfig(**fields)  # type: ignore[arg-type]


def test_config_from_dict_names_unknown_keys_and_ports_count_up_by_rank() -> None:
    with pytest.raises(DisaggConfigError, match="lease_seconds"):
        DisaggConfig.from_dict({"engine_id": "e", "lease_seconds": 3})
    config = DisaggConfig.from_dict({"engine_id": "e", "port": 5600, "rank": 1, "tp_size": 2})
    assert config.rank_port() == 5601 and config.rank_port(0) == 5600


def test_staging_arena_lends_disjoint_aligned_ranges_and_merges_them_back() -> None:
    arena = StagingArena(1024)
    a, b = arena.take(100), arena.take(200)
    assert a == 0 and b == 128 and arena.in_use == 128 + 256
    assert arena.take(1024) is None  # full for now: the caller waits
    arena.give(a)
    arena.give(b)
    assert arena.in_use == 0 and arena.take(1024) == 0


def test_staging_more_than_the_arena_is_an_error_naming_the_setting() -> None:
    with pytest.raises(DisaggError, match="staging_bytes=64"):
        StagingArena(64).take(65)


def test_a_tp_prefill_without_a_base_port_is_refused_before_binding() -> None:
    spec = KVSpec.gqa(2, 4, 32, tokens_per_block=16, dtype="float32")
    cache = allocate_cache(spec, "packed_kv", 4)
    with pytest.raises(DisaggConfigError, match=r"port=0 with tp_size=2.*fixed base port"):
        PrefillSide(bind(get_backend("cpu"), spec, cache, "packed_kv"), DisaggConfig(engine_id="p", rank=1, tp_size=2))
