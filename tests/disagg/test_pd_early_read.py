"""vLLM hands ``kv_transfer_params`` to the proxy one step before its worker hands the request to ``PrefillSide``
(the scheduler returns them from ``request_finished``; the worker hears of it in the next step's metadata), so a
fast decode can finish its READ and send ``ReadDone`` before ``PrefillSide.request_finished`` runs."""

from __future__ import annotations

import time
import uuid

import pytest
from kvfill import digest
from pair import free_port_run, make, push_params, small_spec

from kvplane.flows.disagg import TransferParams
from kvplane.flows.disagg.wire import limits
from kvplane.flows.disagg.wire.tokens import new_token

pytestmark = pytest.mark.integration


def test_a_read_done_that_beats_request_finished_still_releases_the_blocks_at_once() -> None:
    spec = small_spec()
    prefill = make("prefill", spec, seed=3, lease_s=20.0)
    decode = make("decode", spec, lease_s=20.0)
    try:
        src = prefill.allocate(40)
        params = TransferParams(  # exactly what request_finished will return, known before it runs
            remote_engine_id=prefill.side.config.engine_id, remote_request_id="early", remote_block_ids=[src],
            remote_host="127.0.0.1", remote_port=prefill.side.base_port, tp_size=1, remote_block_size=16,
            remote_num_tokens=40, remote_boot_id=prefill.side.local.boot_id, kvplane_token=new_token(),
        )
        dst = decode.allocate(40)
        decode.side.start_pull("d-early", params, dst)
        assert decode.wait("d-early").state == "done"
        time.sleep(0.2)  # the ReadDone is at the prefill now, for a request it has not been handed
        assert prefill.side.request_finished("early", src, 40, token=params.kvplane_token) == params
        done = prefill.wait("early", within_s=5.0)  # not the 20 s lease
        assert done.state == "done", done
        assert digest(spec, decode.cache, decode.layout, {0: dst}, 40) == \
            digest(spec, prefill.cache, prefill.layout, {0: src}, 40)
    finally:
        prefill.close()
        decode.close()


def test_a_push_the_prefill_has_no_room_to_keep_word_of_fails_naming_that() -> None:
    """Issue 28: a decode registers more pushes than a prefill rank keeps word of before its engine hands the
    requests over (``limits.MAX_EARLY_PER_PEER`` per decode connection). The one past the cap is refused: the
    decode's request fails at once with the prefill's reason, not at its push timeout, and the others stay
    registered."""
    spec = small_spec()
    cap = limits.MAX_EARLY_PER_PEER
    prefill = make("prefill", spec, seed=3, mode="push", push_timeout_s=600.0)
    decode = make("decode", spec, mode="push", num_blocks=cap + 8, push_timeout_s=600.0)
    try:
        for i in range(cap + 1):
            rid = f"r{i}"
            decode.side.register_push(rid, push_params(prefill.side.base_port, rid, prefill.side.config.engine_id),
                                      decode.allocate(1), 1)
        refused = decode.wait(f"r{cap}", within_s=120.0)  # far past the reply's time; the push timeout is 600 s
        assert refused.state == "failed", refused
        assert "too many requests registered that this prefill rank was not handed yet" in refused.reason, refused
        assert all(prefill.side.push_registered(f"r{i}") for i in range(cap))
        assert f"r{cap - 1}" not in decode.collect()
    finally:
        decode.close()
        prefill.close()


def test_pushes_registered_while_the_handshake_is_pending_reach_the_prefill_in_the_order_they_were_registered() -> None:
    """The decode registers ``MAX_EARLY_PER_PEER + 1`` pushes before the prefill rank even listens, so every one
    waits on the handshake; once it is answered they go out first come, first served, and the one refused for
    room is the last registered. (On main they went out in the hash order of a set, and the cap refused whichever
    came last there: the clean-clone CI of 46387ea saw r220 refused, not r256.)"""
    spec = small_spec()
    cap = limits.MAX_EARLY_PER_PEER
    base, eid = free_port_run(1), f"prefill-{uuid.uuid4().hex[:6]}"
    decode = make("decode", spec, mode="push", num_blocks=cap + 8, push_timeout_s=600.0, handshake_timeout_s=120.0)
    prefill = None
    try:
        for i in range(cap + 1):
            rid = f"r{i}"
            decode.side.register_push(rid, push_params(base, rid, eid), decode.allocate(1), 1)
        prefill = make("prefill", spec, seed=3, mode="push", push_timeout_s=600.0, port=base, engine_id=eid)
        end = time.monotonic() + 180.0  # the handshake's 120 s bound, and the reply's time
        while not decode.collect():
            assert time.monotonic() < end, "no request was refused"
            time.sleep(0.002)
        assert list(decode.collect()) == [f"r{cap}"], decode.collect()
        refused = decode.collect()[f"r{cap}"]
        assert refused.state == "failed", refused
        assert "too many requests registered that this prefill rank was not handed yet" in refused.reason, refused
        assert all(prefill.side.push_registered(f"r{i}") for i in range(cap))
    finally:
        decode.close()
        if prefill is not None:
            prefill.close()
