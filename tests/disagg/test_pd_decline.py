"""A decode that will never receive a request (its client went away before the engine scheduled it) declines it:
the prefill ranks holding its blocks free them at once instead of at the end of their lease, and the decline
counts only with the request's token. Real sides on 127.0.0.1, a lease far longer than the test may wait."""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from pair import LONG, Engine, free_port_run, make, push_params, ready_prefill_ranks, small_spec, token_for
from rank_pool import spawn

from kvplane.flows.disagg.decode.decode_link import LinkPhase
from kvplane.kv.spec import KVSpec

SPEC = small_spec()


@pytest.fixture
def sides() -> Iterator[tuple[Engine, Engine]]:
    spec = small_spec()
    prefill, decode = make("prefill", spec, seed=1, **LONG), make("decode", spec, **LONG)
    yield prefill, decode
    decode.close()
    prefill.close()


def test_a_declined_pull_frees_the_prefills_blocks_before_the_lease(sides: tuple[Engine, Engine]) -> None:
    prefill, decode = sides
    params = prefill.side.request_finished("r1", prefill.allocate(40), 40)
    decode.side.decline(params)
    done = prefill.wait("r1", within_s=20.0)  # the lease would hold them for 600 s
    assert done.state == "failed" and "gave the request up" in done.reason
    assert decode.side.pending_requests() == 0 and decode.collect() == {}  # nothing to report on the decode


def test_a_decline_with_another_token_frees_nothing(sides: tuple[Engine, Engine]) -> None:
    prefill, decode = sides
    params = prefill.side.request_finished("r2", prefill.allocate(40), 40)
    forged = params.to_dict() | {"kvplane_token": token_for("someone else")}
    decode.side.decline(forged)
    decode.side.decline(push_params(prefill.side.base_port, "r3", prefill.side.config.engine_id))  # never held
    later = prefill.side.request_finished("r4", prefill.allocate(40), 40)
    decode.side.decline(later)
    assert prefill.wait("r4", within_s=20.0).state == "failed"  # the later, honest decline was taken
    assert "r2" not in prefill.collect()  # the forged one was not


def test_a_push_declined_before_it_registered_frees_the_prefills_blocks(sides: tuple[Engine, Engine]) -> None:
    prefill, decode = sides
    params = push_params(prefill.side.base_port, "r5", prefill.side.config.engine_id)
    prefill.side.request_finished("r5", prefill.allocate(40), 40, token=token_for("r5"))
    decode.side.decline(params)
    assert prefill.wait("r5", within_s=20.0).state == "failed"


@pytest.mark.parametrize("engine", ["mooncake", "nixl"])
def test_a_decline_whose_handshake_failed_is_sent_with_the_next_successful_handshake(
    tmp_path: Path, engine: str
) -> None:
    """The prefill (its own process) is stopped while the decode declines two of its requests, so the handshake the
    decline started times out. The Cancels are kept, and go with the next handshake that succeeds (a later
    decline's): the prefill frees both requests long before their 600 s lease (on main the first two were
    dropped with the failed handshake and held until the lease)."""
    worker = spawn(tmp_path / "prefill.log")
    decode = make("decode", SPEC, engine=engine, handshake_timeout_s=1.0, **LONG)
    try:
        reply = worker.ask(cmd="setup_cache", role="prefill", spec=msgspec.msgpack.encode(SPEC), layout="packed_kv",
                           num_blocks=64, seed=2, config={"engine_id": "prefill-stopped", "transport": engine,
                                                          "heartbeat_s": 0.5, **LONG})
        assert "error" not in reply, reply
        held = {rid: worker.ask(cmd="hold", request_id=rid, table={0: list(range(3 * i, 3 * i + 3))},
                                num_tokens=40)["params"] for i, rid in enumerate(("r1", "r2", "r3"))}
        os.kill(worker.proc.pid, signal.SIGSTOP)
        try:
            decode.side.decline(held["r1"])
            decode.side.decline(held["r2"])
            wait_failed = time.monotonic() + 20.0
            while not any(c.link.phase is LinkPhase.FAILED for c in list(decode.side._conns.values())):
                assert time.monotonic() < wait_failed, "the handshake to the stopped prefill never failed"
                time.sleep(0.01)
        finally:
            os.kill(worker.proc.pid, signal.SIGCONT)
        # A new handshake at once, on the same connection: accepted although the prefill may still be checking the
        # timed-out one (test_pd_stall.py); no retry is needed
        decode.side.decline(held["r3"])
        for rid in ("r3", "r1", "r2"):
            done = worker.ask(cmd="wait", request_id=rid, within=20.0)
            assert done["state"] == "failed" and "gave the request up" in done["reason"], (rid, done)
        assert worker.ask(cmd="held")["held"] == 0
    finally:
        decode.close()
        worker.kill()


def test_declines_kept_for_later_are_bounded_per_rank_and_in_ranks_and_age_out() -> None:
    from kvplane.flows.disagg.decode.declines import PendingDeclines
    from kvplane.flows.disagg.wire.limits import MAX_DECLINE_PEERS, MAX_DECLINES
    from kvplane.flows.disagg.wire.messages import Cancel

    pending = PendingDeclines(horizon_s=60.0)
    for i in range(MAX_DECLINES + 5):
        pending.add(("127.0.0.1", 1), Cancel(f"r{i}", "d", 0, token_for(f"r{i}")), now=float(i) / 1000)
    assert len(pending) == MAX_DECLINES  # the oldest 5 went
    for port in range(2, MAX_DECLINE_PEERS + 2):
        pending.add(("127.0.0.1", port), Cancel("x", "d", 0, token_for("x")), now=100.0)
    assert len(pending) == MAX_DECLINE_PEERS  # port 1 went: it was declined to longest ago
    assert pending.take(("127.0.0.1", 1), now=100.0, boot_id="b1") == []
    pending.add(("127.0.0.1", 7), Cancel("y", "d", 0, token_for("y")), now=150.0)
    assert [c.request_id for c in pending.take(("127.0.0.1", 7), 170.0, "b1")] == ["y"]  # "x" is past the horizon
    assert pending.take(("127.0.0.1", 7), now=170.0, boot_id="b1") == []  # taken once
    for boot in ("b1", "b2", ""):  # a pull's names the lifetime holding it; a push's names none yet
        pending.add(("127.0.0.1", 8), Cancel(f"of-{boot}", "d", 0, token_for(boot)), now=200.0, boot_id=boot)
    assert [c.request_id for c in pending.take(("127.0.0.1", 8), 200.0, "b2")] == ["of-b2", "of-"]


@pytest.mark.parametrize("engine", ["mooncake", "nixl"])
def test_a_push_aborted_while_a_prefill_rank_still_handshakes_cancels_there_once_the_handshake_succeeds(
    tmp_path: Path, engine: str
) -> None:
    """A TP-2 prefill: rank 0 in this process, rank 1 its own process, stopped while the decode registers a push,
    so only rank 0 has handshaken when the decode aborts (still in CONNECT). Rank 0 is cancelled at once; rank 1
    once its handshake, answered after it resumes, succeeds: both free the request long before their 600 s push
    timeout (on main rank 1 got no Cancel and held it until then)."""
    share = KVSpec.gqa(4, 2, 32, tokens_per_block=16, dtype="float32")  # one rank's 2 of small_spec's 4 heads
    base, boot, eid = free_port_run(2), uuid.uuid4().hex[:8], f"prefill-{uuid.uuid4().hex[:6]}"
    common = {"engine_id": eid, "boot_id": boot, "tp_size": 2, "port": base, "transport": engine, **LONG}
    worker = spawn(tmp_path / "rank1.log")
    rank0 = make("prefill", share, seed=4, rank=0, **common)
    decode = make("decode", small_spec(), engine=engine, handshake_timeout_s=30.0, **LONG)
    try:
        reply = worker.ask(cmd="setup_cache", role="prefill", spec=msgspec.msgpack.encode(share), layout="packed_kv",
                           num_blocks=64, seed=5, config={**common, "rank": 1, "heartbeat_s": 0.5})
        assert "error" not in reply, reply
        rank0.side.request_finished("p", rank0.allocate(40), 40, token=token_for("p"))
        worker.ask(cmd="hold", request_id="p", table={0: [0, 1, 2]}, num_tokens=40, token=token_for("p"))
        os.kill(worker.proc.pid, signal.SIGSTOP)
        try:
            decode.side.register_push("d", push_params(base, "p", eid, tp=2), decode.allocate(40), 40)
            end = time.monotonic() + 20.0
            while ready_prefill_ranks(decode) < 1:  # rank 0 answered; rank 1 cannot
                assert time.monotonic() < end, "rank 0 never finished its handshake"
                time.sleep(0.005)
            decode.side.abort("d")
            assert decode.wait("d").state == "failed"
            assert rank0.wait("p", within_s=20.0).state == "failed"
        finally:
            os.kill(worker.proc.pid, signal.SIGCONT)
        done = worker.ask(cmd="wait", request_id="p", within=20.0)
        assert done["state"] == "failed" and "gave the request up" in done["reason"], done
        assert worker.ask(cmd="held")["held"] == 0 and rank0.side.held_requests() == 0
    finally:
        decode.close()
        rank0.close()
        worker.kill()
