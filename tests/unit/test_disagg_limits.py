"""Limits and checks at the edges of the disaggregation flow: what an engine passes (every KV-cache group,
distinct destinations, well-formed parameters and tokens) and what a peer sends (bounded fields, block ids that
fit, plans only inside memory the peer registered). No engines or sockets beyond one side's own."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from kvplane.backend import get_backend
from kvplane.descriptors import CopyPlan
from kvplane.errors import PlanError
from kvplane.flows.disagg import (
    DisaggConfig,
    DisaggError,
    PrefillSide,
    ProtocolError,
    TransferParams,
)
from kvplane.flows.disagg.wire import messages
from kvplane.flows.disagg.wire.errors import TransferParamsError
from kvplane.flows.disagg.wire.limits import PerPeer, RateLimit
from kvplane.flows.disagg.wire.tokens import is_token, new_token, same_token
from kvplane.kv.binding import allocate_cache
from kvplane.kv.bound import bind
from kvplane.kv.spec import KVSpec
from kvplane.transports.batching import check_plan

TWO_GROUPS = KVSpec.gqa(2, 2, 8, dtype="float32", tokens_per_block=16, layer_groups=[0, 1],
                        group_tokens_per_block={0: 16, 1: 32})


def test_request_finished_with_one_group_of_two_is_refused_at_the_call_before_any_hold() -> None:
    cache = allocate_cache(TWO_GROUPS, "packed_kv", 8)
    with PrefillSide(bind(get_backend("cpu"), TWO_GROUPS, cache, "packed_kv"), DisaggConfig(engine_id="p")) as side:
        with pytest.raises(DisaggError, match=r"missing \[1\]"):
            side.request_finished("r", {0: [1, 2]}, 20)
        assert side.held_requests() == 0 and side.get_finished() == []
        params = side.request_finished("r", {0: [1, 2], 1: [3]}, 20)  # both groups: held
        assert params.remote_block_ids == [[1, 2], [3]] and side.held_requests() == 1


def test_block_ids_beyond_the_cache_are_refused_at_the_call() -> None:
    cache = allocate_cache(TWO_GROUPS, "packed_kv", 8)
    with PrefillSide(bind(get_backend("cpu"), TWO_GROUPS, cache, "packed_kv"), DisaggConfig(engine_id="p")) as side:
        with pytest.raises(DisaggError, match=r"must lie in 0..7"):
            side.request_finished("r", {0: [1, 8], 1: [3]}, 20)


def test_a_push_prefill_without_the_proxys_token_is_refused_naming_the_fix() -> None:
    cache = allocate_cache(TWO_GROUPS, "packed_kv", 8)
    config = DisaggConfig(engine_id="p", mode="push")
    with PrefillSide(bind(get_backend("cpu"), TWO_GROUPS, cache, "packed_kv"), config) as side:
        with pytest.raises(DisaggError, match="for_push"):
            side.request_finished("r", {0: [1, 2], 1: [3]}, 20)


def base(**over: object) -> dict[str, object]:
    return {"remote_engine_id": "p", "remote_request_id": "r", "remote_host": "h", "remote_port": 5600,
            "tp_size": 1, **over}


@pytest.mark.parametrize("over,match", [
    ({"remote_port": 0}, "remote_port=0"),
    ({"tp_size": 0}, "tp_size=0"),
    ({"kvplane_mode": "fax"}, "kvplane_mode"),
    ({"kvplane_token": "short"}, "kvplane_token"),
    ({"remote_block_ids": [[1, -2]]}, "holds block id -2"),
    ({"remote_request_id": ""}, "remote_request_id"),
])
def test_transfer_params_check_their_fields_in_the_constructor_as_from_dict_does(over: dict[str, object],
                                                                                  match: str) -> None:
    with pytest.raises(TransferParamsError, match=match):
        TransferParams(**base(**over))  # type: ignore[arg-type]
    with pytest.raises(TransferParamsError, match=match):
        TransferParams.from_dict(base(**over))


def test_for_push_draws_a_token_or_keeps_the_one_given() -> None:
    p = TransferParams.for_push("p", "r", "127.0.0.1", 5600, tp_size=2, mode="layerwise")
    assert is_token(p.kvplane_token) and p.kvplane_mode == "layerwise" and p.tp_size == 2
    token = new_token()
    assert TransferParams.for_push("p", "r", "h", 5600, token=token).kvplane_token == token
    assert TransferParams.from_dict(p.to_dict()) == p


def test_tokens_are_128_random_bits_and_an_empty_one_never_matches() -> None:
    a, b = new_token(), new_token()
    assert a != b and len(a) == 32 and same_token(a, a) and not same_token(a, b)
    assert not same_token("", "")


def test_destination_block_ids_given_twice_are_refused() -> None:
    from kvplane.flows.disagg import DecodeSide

    spec = KVSpec.gqa(2, 2, 8, dtype="float32", tokens_per_block=16)
    cache = allocate_cache(spec, "packed_kv", 8)
    with DecodeSide(bind(get_backend("cpu"), spec, cache, "packed_kv"), DisaggConfig(engine_id="d", mode="push")) as side:
        with pytest.raises(DisaggError, match="appears twice"):
            side.register_push("r", TransferParams.for_push("p", "r", "127.0.0.1", 5600), [3, 3], 20)
        with pytest.raises(DisaggError, match="kvplane_token"):
            side.register_push("r", TransferParams(**base(kvplane_mode="push")), [3, 4], 20)  # type: ignore[arg-type]


@pytest.mark.parametrize("message,match", [
    ({"type": "push_register", "request_id": "r", "engine_id": "e", "rank": 0, "tp_size": 1,
      "block_ids": {0: [2**64 - 1]}, "num_tokens": 1, "staging_addr": 0, "staging_bytes": 0, "expect_boot": "b"},
     "block_ids"),
    ({"type": "heartbeat", "engine_id": "e", "rank": 0, "requests": [["r", "t"]] * 4097}, "requests"),
    ({"type": "read_done", "request_id": "r" * 600, "engine_id": "e", "rank": 0, "tp_size": 1, "ok": True,
      "expect_boot": "b"}, "request_id"),
    ({"type": "cancel", "request_id": "r", "engine_id": "e", "rank": -1}, "rank"),
])
def test_out_of_bound_fields_are_refused_while_decoding(message: dict[str, object], match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        messages.decode(msgspec.msgpack.encode(message), 1 << 26)


def test_a_plan_with_a_peer_that_published_no_spans_is_refused() -> None:
    plan = CopyPlan(np.array([4096], dtype=np.int64), np.array([8192], dtype=np.int64),
                    np.array([64], dtype=np.int64))
    with pytest.raises(PlanError, match="remote"):
        check_plan("WRITE", plan, [(4096, 4096)], None, "peer")
    check_plan("WRITE", plan, [(4096, 4096)], [(8192, 64)], "peer")


def test_the_rate_limit_allows_a_burst_then_counts_what_it_drops() -> None:
    limit = RateLimit(per_s=10)
    allowed = sum(limit.allow() for _ in range(1000))
    assert 10 <= allowed < 20 and limit.dropped == 1000 - allowed


def test_one_peers_flood_spends_only_its_own_reply_budget() -> None:
    replies = PerPeer(per_s=10, peers=2)
    flood = sum(replies.allow(b"evil") for _ in range(1000))
    assert 10 <= flood < 20
    assert replies.allow(b"honest")  # a full budget of its own
    assert replies.allow(b"third") and replies.allow(b"evil")  # "evil" was forgotten (2 kept): a fresh budget


def test_early_records_are_capped_per_connection_and_in_total_with_a_floor_for_every_connection() -> None:
    from kvplane.flows.disagg.wire.limits import EARLY_FLOOR, MAX_EARLY, MAX_EARLY_PER_PEER, EarlyRecords

    early = EarlyRecords()
    for p in range(MAX_EARLY // MAX_EARLY_PER_PEER):  # peers at their own cap fill the total
        for i in range(MAX_EARLY_PER_PEER):
            assert early.refusal(bytes([p])) == ""
            early.add(f"{p}-{i}", bytes([p]))
        assert f"this decode connection's word of {MAX_EARLY_PER_PEER} requests" in early.refusal(bytes([p]))
    assert len(early) == MAX_EARLY
    for i in range(EARLY_FLOOR):  # a quiet connection still gets its floor once the total is reached
        assert early.refusal(b"quiet") == ""
        early.add(f"q{i}", b"quiet")
    assert early.refusal(b"quiet") == f"word of {MAX_EARLY + EARLY_FLOOR} requests not handed over yet is kept already"
    early.discard("0-0")
    early.discard("0-0")  # twice: counted once
    assert len(early) == MAX_EARLY + EARLY_FLOOR - 1  # peer 0 is under its own cap now, over the total still
    assert early.refusal(bytes([0])).startswith(f"word of {MAX_EARLY + EARLY_FLOOR - 1} requests")
