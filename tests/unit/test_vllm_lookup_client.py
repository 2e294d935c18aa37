"""``LookupClient`` and ``LookupServer`` (kvplane/integrations/vllm/lookup.py) over a real ``ipc://`` socket:
the scheduler's end never waits, whatever the worker's end is doing, and a request that ended with its lookup
unanswered is named for release only once no hold can follow."""

from __future__ import annotations

import os
import tempfile
import threading
import time
import uuid

from kvplane.integrations.vllm.lookup import Hashes, LookupClient, LookupServer


def address() -> str:
    return f"ipc://{os.path.join(tempfile.gettempdir(), f'kvplane-lookup-test-{uuid.uuid4().hex[:8]}.sock')}"


def until(condition: object, within_s: float = 30.0) -> None:
    end = time.monotonic() + within_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < end, "not within the bound"
        time.sleep(0.001)


def test_lookups_to_a_worker_that_is_not_there_never_block_the_scheduler_and_count_as_misses() -> None:
    client = LookupClient(address(), timeout_s=600.0)
    try:
        for i in range(3000):  # past the socket's queue (1000 messages): send would block there
            client.ask(f"r{i}", {0: [i]}, {0: 16})
        assert client.answer("r0") is None  # queued, still within its deadline
        assert client.answer("r2999") == 0  # never sent: a miss at once
    finally:
        client.close()


def test_an_ended_request_is_released_only_after_its_lookup_was_answered() -> None:
    held: list[str] = []

    def hold(request_id: str, hashes: Hashes, block_tokens: dict[int, int], in_store: object = None) -> int:
        held.append(request_id)
        return 32

    lock = threading.Lock()
    where = address()
    server = LookupServer(where, hold, lock)
    client = LookupClient(where, timeout_s=600.0)
    try:
        with lock:  # the worker is busy
            client.ask("a", {0: [1, 2]}, {0: 16})
            assert client.answer("a") is None
            client.abandon("a")  # the request ended while its lookup waits in the worker
            assert client.releasable() == []  # a release now could land before the hold
            assert client.pending() == {"a"}
        until(lambda: client.releasable() == ["a"])
        assert held == ["a"] and client.pending() == set()
        client.ask("b", {0: [1, 2]}, {0: 16})
        until(lambda: client.answer("b") is not None)
        assert held == ["a", "b"] and client.pending() == set()
    finally:
        client.close()
        server.close()


def test_the_store_is_asked_outside_the_workers_lock() -> None:
    """A slow store tier holds up the lookup thread only: while it is being asked, the worker's calls, which take
    the same lock, go on; the hold that follows gets the store's answer."""
    lock = threading.Lock()
    asking, answer = threading.Event(), threading.Event()
    holds: list[object] = []

    def presence(hashes: Hashes) -> object:
        asking.set()
        assert answer.wait(30.0), "the test never let the store answer"
        return {0: [True, True]}

    def hold(request_id: str, hashes: Hashes, block_tokens: dict[int, int], in_store: object = None) -> int:
        holds.append(in_store)
        return 32

    where = address()
    server = LookupServer(where, hold, lock, presence)
    client = LookupClient(where, timeout_s=600.0)
    try:
        client.ask("a", {0: [1, 2]}, {0: 16})
        assert asking.wait(30.0)
        assert lock.acquire(timeout=10.0), "the worker's lock is held while the store is asked"
        lock.release()
        answer.set()
        got: list[int | None] = []
        until(lambda: got.append(client.answer("a")) or got[-1] is not None)
        assert got[-1] == 32 and holds == [{0: [True, True]}]
    finally:
        answer.set()
        client.close()
        server.close()
