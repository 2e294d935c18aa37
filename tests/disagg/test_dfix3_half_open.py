"""Half-open side-channel connections: a decode process gone silent (SIGSTOP here; a dropped network looks the
same to TCP) must not keep its name at the prefill until TCP notices (hours for an idle connection). ZMQ
heartbeats (``DisaggConfig.peer_timeout_s``) close the dead connection in bounded time; a decode that comes back
reconnects under the same routing id, so its word still counts. The stopped decode is its own process (a rank
worker); the prefill and the second decode run here, real transports on 127.0.0.1, a lease far longer than the
test may wait."""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from kvfill import digest
from pair import LONG, Engine, make, small_spec
from rank_pool import spawn
from zmq.utils.monitor import recv_monitor_message

from kvplane.flows.disagg import TransferParams

SPEC = small_spec()
TOKENS = 40
PEER_TIMEOUT_S = 2.0  # short, yet long enough that a loaded 2-core machine does not starve a live peer


@pytest.fixture(params=["mooncake", "nixl"])
def engine(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def decode_worker(tmp_path: Path, engine: str, engine_id: str) -> Any:
    worker = spawn(tmp_path / "decode.log")
    reply = worker.ask(cmd="setup_cache", role="decode", spec=msgspec.msgpack.encode(SPEC), layout="packed_kv",
                       num_blocks=64, seed=3, config={"engine_id": engine_id, "transport": engine,
                                                      "peer_timeout_s": PEER_TIMEOUT_S, **LONG})
    assert "error" not in reply, reply
    return worker


def pull_in_worker(worker: Any, prefill: Engine, rid: str, table: list[int]) -> dict[str, Any]:
    params = prefill.side.request_finished(f"p-{rid}", prefill.allocate(TOKENS), TOKENS)
    assert worker.ask(cmd="pull", request_id=rid, params=params.to_dict(), table={0: table}, num_tokens=TOKENS) == {}
    done: dict[str, Any] = worker.ask(cmd="wait", request_id=rid, within=20.0)
    return done


@pytest.fixture
def prefill(engine: str) -> Iterator[Engine]:
    side = make("prefill", SPEC, seed=1, engine=engine, peer_timeout_s=PEER_TIMEOUT_S, **LONG)
    yield side
    side.close()


def same_bytes(prefill: Engine, decode: Engine, params: TransferParams, ids: list[int]) -> bool:
    source = [int(b) for b in params.remote_block_ids[0]]
    return bool(digest(SPEC, prefill.cache, "packed_kv", {0: source}, TOKENS) ==
                digest(SPEC, decode.cache, "packed_kv", {0: ids}, TOKENS))


def test_a_stopped_decodes_name_is_freed_for_its_successor_without_waiting_for_tcp(
    tmp_path: Path, engine: str, prefill: Engine
) -> None:
    """Decode A (a process) pulled once, so the prefill knows engine E rank 0 by A's connection; A is stopped.
    Decode B, the same engine id (a replacement), pulls: refused while A's connection counts as alive, which on
    main is until TCP notices (never here: the kernel still ACKs for a stopped process). With heartbeats the
    prefill drops A's connection within ``peer_timeout_s``: B's given-up pull is then declined on B's retried
    handshake (r-b1 freed long before its lease), and B's next pull is done with the prefill's bytes."""
    eid = f"decode-{uuid.uuid4().hex[:6]}"
    worker = decode_worker(tmp_path, engine, eid)
    successor = make("decode", SPEC, engine=engine, engine_id=eid, handshake_timeout_s=5.0, **LONG)
    try:
        assert pull_in_worker(worker, prefill, "a1", [0, 1, 2])["state"] == "done"
        assert prefill.wait("p-a1", within_s=20.0).state == "done"
        os.kill(worker.proc.pid, signal.SIGSTOP)
        try:
            first = prefill.side.request_finished("r-b1", prefill.allocate(TOKENS), TOKENS)
            ids = successor.allocate(TOKENS)
            successor.side.start_pull("b1", first, {0: ids})
            b1 = successor.wait("b1", within_s=20.0)
            if b1.state == "done":  # the prefill had found A's connection dead already (a slow machine)
                assert prefill.wait("r-b1", within_s=20.0).state == "done"
            else:
                assert "connected already" in b1.reason, b1
                freed = prefill.wait("r-b1", within_s=20.0)  # on main: refused until TCP notices, so never here
                assert freed.state == "failed" and "gave the request up" in freed.reason, freed
            successor.pool.free(ids)
            second = prefill.side.request_finished("r-b2", prefill.allocate(TOKENS), TOKENS)
            ids = successor.allocate(TOKENS)
            successor.side.start_pull("b2", second, {0: ids})
            b2 = successor.wait("b2", within_s=20.0)
            assert b2.state == "done", b2
            assert same_bytes(prefill, successor, second, ids)
            assert prefill.wait("r-b2", within_s=20.0).state == "done"
            successor.pool.free(ids)
        finally:
            os.kill(worker.proc.pid, signal.SIGCONT)
        assert prefill.side.held_requests() == 0 and successor.whole and successor.side.pending_requests() == 0
    finally:
        successor.close()
        worker.kill()


def test_a_decode_that_resumes_after_its_connection_was_dropped_still_speaks_for_its_requests(
    tmp_path: Path, engine: str, prefill: Engine
) -> None:
    """Decode A is stopped until the prefill's heartbeat drops its connection (seen on a ZMQ monitor of the
    prefill's socket), then resumed: A's ZMQ socket reconnects by itself, and its next pull must count at the
    prefill (its ReadDone frees the request at once, not at the 600 s lease): the prefill knows A by the routing
    id A's socket keeps across reconnections. (On main no heartbeat dropped the connection at all.)"""
    eid = f"decode-{uuid.uuid4().hex[:6]}"
    worker = decode_worker(tmp_path, engine, eid)
    side = prefill.side
    events = zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
    monitor: zmq.Socket[bytes] = side._loop.submit(lambda: side._socket.get_monitor_socket(events)).result(10.0)
    try:
        assert pull_in_worker(worker, prefill, "a1", [0, 1, 2])["state"] == "done"
        assert prefill.wait("p-a1", within_s=20.0).state == "done"
        while monitor.poll(0):  # the first connection's handshake
            recv_monitor_message(monitor)
        os.kill(worker.proc.pid, signal.SIGSTOP)
        try:
            assert monitor.poll(20_000), "the prefill never dropped the stopped decode's connection"
            assert recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
        finally:
            os.kill(worker.proc.pid, signal.SIGCONT)
        # A's socket reconnects by itself; what it sends before its libzmq has seen the old connection closed goes
        # down that connection and is lost (the lease still frees it): the claim here is about A once reconnected
        assert monitor.poll(20_000), "the resumed decode never reconnected"
        assert recv_monitor_message(monitor)["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED
        again = pull_in_worker(worker, prefill, "a2", [5, 6, 7])
        assert again["state"] == "done", again
        freed = prefill.wait("p-a2", within_s=20.0)
        assert freed.state == "done", freed
        assert prefill.side.held_requests() == 0
    finally:
        side._loop.submit(side._socket.disable_monitor).result(10.0)
        monitor.close(linger=0)
        worker.kill()
