"""How the scheduler asks the worker's host tier what it holds, across processes.

vLLM runs the scheduler-side connector in the engine-core process and the worker-side connectors beside the
KV caches (the same process with one GPU, other processes with TP > 1). ``OffloadEngine.lookup`` lives with
the caches, so TP rank 0's worker serves it on a ZMQ REP socket (``ipc://``, named after the engine) and the
scheduler's ``get_num_new_matched_tokens`` asks it. The answer is a promise: the worker holds the host blocks
it counted for that request until the load, the request's end or a preemption (``holds.LookupHolds``). A
lookup not answered within ``timeout_s`` counts as a miss (0 tokens), so a slow or absent worker costs a
recompute, never a hang. Its answer is then lost, so each lookup carries its deadline (``CLOCK_MONOTONIC``, one
clock for every process of the host the ``ipc://`` socket lives on): the worker holds nothing for a lookup it
takes up after the deadline, and the scheduler releases whatever one answered before it may hold. Ranks store the same blocks in lockstep, so rank 0's answer stands for all; only rank
0 holds blocks, and a rank that evicted a block since reports it through ``get_block_ids_with_load_errors``.
"""

from __future__ import annotations

import logging
import math
import os
import tempfile
import threading
import time
from collections.abc import Callable

import msgspec
import zmq

logger = logging.getLogger("kvplane.vllm")
Hashes = dict[int, list[int]]


class HoldRequest(msgspec.Struct, frozen=True):
    """One lookup: the request's chained block hashes and the tokens per block, per KV-cache group; after
    ``deadline`` (``time.monotonic()``) the scheduler no longer waits for the answer."""

    request_id: str
    hashes: Hashes
    block_tokens: dict[int, int]
    deadline: float = math.inf


Hold = Callable[[str, Hashes, dict[int, int]], int]


def lookup_address(engine_id: str, dp_rank: int = 0) -> str:
    """The ``ipc://`` address rank 0 of data-parallel rank ``dp_rank`` of engine ``engine_id`` serves on."""
    return f"ipc://{os.path.join(tempfile.gettempdir(), f'kvplane-lookup-{engine_id}-{dp_rank}.sock')}"


def block_hash_int(block_hash: bytes | int) -> int:
    """vLLM's block hash (bytes, chained over the prefix) as the int64 key kvplane's index uses."""
    if isinstance(block_hash, int):
        return block_hash
    return int.from_bytes(bytes(block_hash)[:8], "little", signed=True)


class LookupServer:
    """Answers lookups on a daemon thread; ``hold`` is called under ``lock`` (the engine's own lock)."""

    def __init__(self, address: str, hold: Hold, lock: threading.Lock) -> None:
        self.address = address
        self._hold, self._lock = hold, lock
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.REP)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(address)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kvplane-lookup", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        decoder = msgspec.msgpack.Decoder(HoldRequest)
        while not self._stop.is_set():
            if not self._socket.poll(100):
                continue
            try:
                ask = decoder.decode(self._socket.recv())
                with self._lock:  # the deadline is read under the lock: a release after it cannot come first
                    late = time.monotonic() > ask.deadline
                    tokens = 0 if late else self._hold(ask.request_id, ask.hashes, ask.block_tokens)
            except Exception as e:  # a bad request or a failing lookup is a miss, never a dead server
                logger.warning("kvplane lookup failed, answering 0 tokens: %s", e)
                tokens = 0
            self._socket.send(msgspec.msgpack.encode(tokens))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
        self._socket.close()
        self._context.term()
        path = self.address.removeprefix("ipc://")
        if os.path.exists(path):
            os.unlink(path)


class LookupClient:
    """The scheduler's end: ``hold(request_id, hashes, block_tokens)`` -> leading tokens the host tier (or
    store) holds, held for that request; None when not answered in time (a miss, whose blocks the worker may
    hold all the same: release them)."""

    def __init__(self, address: str, timeout_s: float) -> None:
        self.address, self.timeout_ms = address, int(timeout_s * 1000)
        self._context = zmq.Context()
        self._socket = self._connect()

    def _connect(self) -> zmq.Socket[bytes]:
        sock = self._context.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.address)
        return sock

    def hold(self, request_id: str, hashes: Hashes, block_tokens: dict[int, int]) -> int | None:
        deadline = time.monotonic() + self.timeout_ms / 1000
        self._socket.send(msgspec.msgpack.encode(HoldRequest(request_id, hashes, block_tokens, deadline)))
        if not self._socket.poll(self.timeout_ms):
            logger.warning("kvplane lookup at %s not answered in %d ms: counting a miss", self.address,
                           self.timeout_ms)
            self._socket.close()
            self._socket = self._connect()  # a REQ socket that missed its reply cannot send again
            return None
        return int(msgspec.msgpack.decode(self._socket.recv()))

    def close(self) -> None:
        self._socket.close()
        self._context.term()
