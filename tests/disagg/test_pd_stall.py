"""A prefill that stalls (a GC pause, a long model step; SIGSTOP here) past a decode's handshake timeout and then
resumes: the decode's next request to it must handshake again at once and be accepted, not refused because the
prefill still holds the timed-out handshake under the decode's name. The prefill is its own process (a rank
worker), the decode runs here; real transports on 127.0.0.1, a lease far longer than the test may wait."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import msgspec
import pytest
from kvfill import digest
from pair import LONG, Engine, make, small_spec, until
from rank_pool import spawn

from kvplane.flows.disagg.decode.records import Conn

SPEC = small_spec()
TOKENS = 40


def conn(decode: Engine) -> Conn | None:
    """The decode's connection to the one prefill rank, once the loop made it."""
    conns = list(decode.side._conns.values())
    return conns[0] if conns else None


def state(decode: Engine) -> str:
    c = conn(decode)
    return "" if c is None else c.link.phase.value


@pytest.mark.parametrize("engine", ["mooncake", "nixl"])
@pytest.mark.parametrize("second", ["after_resume", "while_stopped"])
def test_a_pull_right_after_a_stalled_prefill_resumes_handshakes_again_and_is_accepted(
    tmp_path: Path, engine: str, second: str
) -> None:
    """Pull "a" starts while the prefill is stopped, so its handshake times out and it fails. Pull "b" of another
    request then starts either at once after SIGCONT or while the prefill is still stopped (its handshake waiting
    in the socket when the prefill resumes, beside the timed-out one): it must be done, with the prefill's
    bytes; both sides end with nothing held. On ``lat`` the prefill refused b's handshake ("a handshake under
    this name is being checked already"): the decode had opened a new socket, a second connection under its
    name, while the prefill still checked the first."""
    worker = spawn(tmp_path / "prefill.log")
    decode = make("decode", SPEC, engine=engine, handshake_timeout_s=1.0, **LONG)
    try:
        reply = worker.ask(cmd="setup_cache", role="prefill", spec=msgspec.msgpack.encode(SPEC), layout="packed_kv",
                           num_blocks=64, seed=2, config={"engine_id": "prefill-stalled", "transport": engine,
                                                          "heartbeat_s": 0.5, **LONG})
        assert "error" not in reply, reply
        tables = {"r1": [0, 1, 2], "r2": [5, 6, 7]}
        held = {rid: worker.ask(cmd="hold", request_id=rid, table={0: t}, num_tokens=TOKENS)["params"]
                for rid, t in tables.items()}
        ids = {"a": decode.allocate(TOKENS), "b": decode.allocate(TOKENS)}
        os.kill(worker.proc.pid, signal.SIGSTOP)
        try:
            decode.side.start_pull("a", held["r1"], {0: ids["a"]})
            until("the handshake to the stopped prefill never timed out", lambda: state(decode) == "failed")
            first = decode.wait("a")
            assert first.state in ("failed", "timed_out"), first
            if second == "while_stopped":
                before = conn(decode)
                decode.side.start_pull("b", held["r2"], {0: ids["b"]})
                until("b's handshake was never sent", lambda: state(decode) == "handshaking")
                assert before is not None and conn(decode) is not None
        finally:
            os.kill(worker.proc.pid, signal.SIGCONT)
        if second == "after_resume":
            decode.side.start_pull("b", held["r2"], {0: ids["b"]})
        done = decode.wait("b", within_s=30.0)
        assert done.state == "done", done
        assert digest(SPEC, decode.cache, "packed_kv", {0: ids["b"]}, TOKENS) == \
            worker.ask(cmd="digest", table={0: tables["r2"]}, tokens=TOKENS)["digest"]
        freed = worker.ask(cmd="wait", request_id="r2", within=20.0)
        assert freed["state"] == "done", freed
        # "a" failed before it asked anything of the prefill, which holds r1 under its lease: the engine declines
        # it (as a connector does for a request it will not receive), over the connection b handshook on
        decode.side.decline(held["r1"])
        freed = worker.ask(cmd="wait", request_id="r1", within=20.0)
        assert freed["state"] == "failed" and "gave the request up" in freed["reason"], freed
        assert worker.ask(cmd="held")["held"] == 0
        for rid in ("a", "b"):
            decode.pool.free(ids[rid])
        assert decode.whole and decode.side.pending_requests() == 0 and decode.side.local.arena.in_use == 0
    finally:
        decode.close()
        worker.kill()
