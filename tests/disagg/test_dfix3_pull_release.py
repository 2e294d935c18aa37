"""A pull that fails before it asks the prefill anything (its handshake timed out while the prefill was stopped)
still tells the prefill, once it can reach it, so the prefill frees the request's blocks at once instead of at
its lease's end; and a Reject answering a timed-out handshake does not fail the retry sent after it. The prefill
is its own process (a rank worker), the decode runs here; real transports on 127.0.0.1, a lease far longer than
the test may wait."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import msgspec
import pytest
from kvfill import digest
from pair import LONG, Engine, make, small_spec, until
from rank_pool import spawn

SPEC = small_spec()
TOKENS = 40


def state(decode: Engine) -> str:
    conns = list(decode.side._conns.values())
    return conns[0].link.phase.value if conns else ""


def prefill_worker(tmp_path: Path, engine: str, tables: dict[str, list[int]]) -> tuple[Any, dict[str, Any]]:
    worker = spawn(tmp_path / "prefill.log")
    reply = worker.ask(cmd="setup_cache", role="prefill", spec=msgspec.msgpack.encode(SPEC), layout="packed_kv",
                       num_blocks=64, seed=2, config={"engine_id": "prefill-dfix3", "transport": engine,
                                                      "heartbeat_s": 0.5, **LONG})
    assert "error" not in reply, reply
    held = {rid: worker.ask(cmd="hold", request_id=rid, table={0: t}, num_tokens=TOKENS)["params"]
            for rid, t in tables.items()}
    return worker, held


@pytest.mark.parametrize("engine", ["mooncake", "nixl"])
def test_a_pull_whose_handshake_timed_out_frees_the_prefills_blocks_once_the_prefill_answers(
    tmp_path: Path, engine: str
) -> None:
    """The pull fails on its handshake's timeout while the prefill is stopped; after SIGCONT the engine makes no
    other call than ``get_finished``: the prefill must still free r1 long before its 600 s lease (on main it held
    it until then: nothing was ever sent for a pull that failed before asking anything)."""
    worker, held = prefill_worker(tmp_path, engine, {"r1": [0, 1, 2]})
    decode = make("decode", SPEC, engine=engine, handshake_timeout_s=1.0, **LONG)
    try:
        ids = decode.allocate(TOKENS)
        os.kill(worker.proc.pid, signal.SIGSTOP)
        try:
            decode.side.start_pull("a", held["r1"], {0: ids})
            first = decode.wait("a")
            assert first.state in ("failed", "timed_out") and "handshake" in first.reason, first
        finally:
            os.kill(worker.proc.pid, signal.SIGCONT)
        freed = worker.ask(cmd="wait", request_id="r1", within=20.0)
        assert freed["state"] == "failed" and "gave the request up" in freed["reason"], freed
        assert worker.ask(cmd="held")["held"] == 0
        decode.pool.free(ids)
        assert decode.whole and decode.side.pending_requests() == 0 and decode.side.local.arena.in_use == 0
    finally:
        decode.close()
        worker.kill()


@pytest.mark.parametrize("engine", ["mooncake", "nixl"])
def test_a_reject_answering_a_timed_out_handshake_does_not_fail_the_retry(tmp_path: Path, engine: str) -> None:
    """While the prefill is stopped, pull "a"'s handshake times out; this rank's engine is then reset (as the
    fence after a failed READ does), so the retry (pull "b", same connection) carries a new transport descriptor.
    Once the prefill resumes it refuses the first handshake (Mooncake: it cannot reach the old engine) and takes
    the second: b must be done with the prefill's bytes, and r1 freed (its Cancel went with b's handshake). On main
    the late Reject of the first handshake failed b too (Mooncake)."""
    worker, held = prefill_worker(tmp_path, engine, {"r1": [0, 1, 2], "r2": [5, 6, 7]})
    decode = make("decode", SPEC, engine=engine, handshake_timeout_s=1.0, **LONG)
    try:
        ids = {"a": decode.allocate(TOKENS), "b": decode.allocate(TOKENS)}
        os.kill(worker.proc.pid, signal.SIGSTOP)
        try:
            decode.side.start_pull("a", held["r1"], {0: ids["a"]})
            assert decode.wait("a").state in ("failed", "timed_out")
            side = decode.side
            generation = side.local.transport.generation
            side._loop.submit(lambda: side._mover.fence(lambda: None, "test: a reset between two handshakes"))
            until("the decode's engine was never reset", lambda: side.local.transport.generation != generation)
            side.start_pull("b", held["r2"], {0: ids["b"]})
            until("b's handshake was never sent", lambda: state(decode) == "handshaking")
        finally:
            os.kill(worker.proc.pid, signal.SIGCONT)
        done = decode.wait("b", within_s=60.0)
        assert done.state == "done", done
        assert digest(SPEC, decode.cache, "packed_kv", {0: ids["b"]}, TOKENS) == \
            worker.ask(cmd="digest", table={0: [5, 6, 7]}, tokens=TOKENS)["digest"]
        assert worker.ask(cmd="wait", request_id="r2", within=20.0)["state"] == "done"
        freed = worker.ask(cmd="wait", request_id="r1", within=20.0)
        assert freed["state"] == "failed" and "gave the request up" in freed["reason"], freed
        assert worker.ask(cmd="held")["held"] == 0
        for rid in ("a", "b"):
            decode.pool.free(ids[rid])
        assert decode.whole and decode.side.pending_requests() == 0
    finally:
        decode.close()
        worker.kill()


@pytest.mark.parametrize("engine", ["mooncake", "nixl"])
def test_an_answer_to_a_handshake_sent_before_this_ranks_reset_is_not_taken_for_the_new_descriptor(
    tmp_path: Path, engine: str
) -> None:
    """While the prefill is stopped, pull "a" fails on its handshake's timeout and the rank retries the handshake
    (to deliver a's Cancel); then this rank's engine is reset, and pull "b" waits on that retried handshake, which
    names the engine that is gone. Once the prefill resumes it refuses it (it cannot reach the old engine): that
    answer is about a descriptor this rank no longer has, so the rank handshakes again with the new one and b is
    done. Before, b failed with the refusal (seen once in a full CI run, NIXL)."""
    worker, held = prefill_worker(tmp_path, engine, {"r1": [0, 1, 2], "r2": [5, 6, 7]})
    # the resumed prefill must answer b's handshake within this: 1 s and then 4 s failed on a loaded machine (issue
    # 28; 4 s beside tests/serve's server starts), so the bound is far past the expected (well under 0.1 s) and the
    # test waits it out once, for a
    decode = make("decode", SPEC, engine=engine, handshake_timeout_s=15.0, **LONG)
    try:
        ids = {"a": decode.allocate(TOKENS), "b": decode.allocate(TOKENS)}
        side = decode.side
        os.kill(worker.proc.pid, signal.SIGSTOP)
        try:
            side.start_pull("a", held["r1"], {0: ids["a"]})
            assert decode.wait("a").state in ("failed", "timed_out")
            conn = lambda: next(iter(side._conns.values()))  # noqa: E731
            until("a's Cancel was never retried", lambda: conn().link.phase.value == "handshaking" and conn().link.attempt >= 2)
            generation = side.local.transport.generation
            side._loop.submit(lambda: side._mover.fence(lambda: None, "test: a reset under a retried handshake"))
            until("the decode's engine was never reset", lambda: side.local.transport.generation != generation)
            side._loop.submit(lambda: None).result(10.0)  # the loop saw the reset's aftermath, if it came
            side.start_pull("b", held["r2"], {0: ids["b"]})
        finally:
            os.kill(worker.proc.pid, signal.SIGCONT)
        done = decode.wait("b", within_s=60.0)
        assert done.state == "done", done
        assert digest(SPEC, decode.cache, "packed_kv", {0: ids["b"]}, TOKENS) == \
            worker.ask(cmd="digest", table={0: [5, 6, 7]}, tokens=TOKENS)["digest"]
        assert worker.ask(cmd="wait", request_id="r2", within=20.0)["state"] == "done"
        freed = worker.ask(cmd="wait", request_id="r1", within=20.0)
        assert freed["state"] == "failed" and "gave the request up" in freed["reason"], freed
        for rid in ("a", "b"):
            decode.pool.free(ids[rid])
        assert decode.whole and decode.side.pending_requests() == 0
    finally:
        decode.close()
        worker.kill()
