"""How the scheduler asks the worker's host tier what it holds, across processes, without waiting for it.

vLLM runs the scheduler-side connector in the engine-core process and the worker-side connectors beside the
KV caches (the same process with one GPU, other processes with TP > 1). ``OffloadEngine.lookup`` lives with
the caches, so TP rank 0's worker serves it on a ZMQ ROUTER socket (``ipc://``, named after the engine) and the
scheduler's ``get_num_new_matched_tokens`` asks it through ``LookupClient``: ``ask`` sends and returns at once,
``answer`` reads what has arrived (vLLM asks again next step while it says "not yet"), so a busy worker delays
the request, never the scheduler. The answer is a promise: the worker holds the host blocks it counted for that
request until the load, the request's end or a preemption (``holds.LookupHolds``). A lookup not answered within
``timeout_s`` counts as a miss (0 tokens). Each lookup carries that deadline (``CLOCK_MONOTONIC``, one clock for
every process of the host the ``ipc://`` socket lives on): the worker holds nothing for a lookup it takes up
after it, so a release the scheduler sends once the answer came or the deadline passed (``releasable``) always
lands after any hold. Ranks store the same blocks in lockstep, so rank 0's answer stands for all; only rank
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
from typing import Any

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
    seq: int = 0


class HoldReply(msgspec.Struct, frozen=True):
    seq: int
    tokens: int


Presence = Callable[[Hashes], Any]  # the store tier's answer for a lookup's hashes, asked without the lock
Hold = Callable[[str, Hashes, dict[int, int], Any], int]  # ... and the hold under it, given that answer


def lookup_address(engine_id: str, dp_rank: int = 0) -> str:
    """The ``ipc://`` address rank 0 of data-parallel rank ``dp_rank`` of engine ``engine_id`` serves on."""
    return f"ipc://{os.path.join(tempfile.gettempdir(), f'kvplane-lookup-{engine_id}-{dp_rank}.sock')}"


def block_hash_int(block_hash: bytes | int) -> int:
    """vLLM's block hash (bytes, chained over the prefix) as the int64 key kvplane's index uses."""
    if isinstance(block_hash, int):
        return block_hash
    return int.from_bytes(bytes(block_hash)[:8], "little", signed=True)


class LookupServer:
    """Answers lookups on a daemon thread; ``hold`` is called under ``lock`` (the engine's own lock), after
    ``presence`` asked the store tier outside it: a slow store holds up this thread only, never the engine's
    calls that take the lock (``wait_for_layer_load``, ``save_kv_layer``, ``get_finished``...)."""

    def __init__(self, address: str, hold: Hold, lock: threading.Lock, presence: Presence | None = None) -> None:
        self.address = address
        self._hold, self._lock, self._presence = hold, lock, presence
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
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
            frames = self._socket.recv_multipart()
            seq = tokens = 0
            try:
                ask = decoder.decode(frames[-1])
                seq = ask.seq
                in_store = None
                if self._presence is not None and time.monotonic() <= ask.deadline:
                    in_store = self._presence(ask.hashes)  # the store, outside the lock
                with self._lock:  # the deadline is read under the lock: a release after it cannot come first
                    late = time.monotonic() > ask.deadline
                    tokens = 0 if late else self._hold(ask.request_id, ask.hashes, ask.block_tokens, in_store)
            except Exception as e:  # a bad request or a failing lookup is a miss, never a dead server
                logger.warning("kvplane lookup failed, answering 0 tokens: %s", e)
            self._socket.send_multipart([frames[0], msgspec.msgpack.encode(HoldReply(seq, tokens))])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
        self._socket.close()
        self._context.term()
        path = self.address.removeprefix("ipc://")
        if os.path.exists(path):
            os.unlink(path)


class LookupClient:
    """The scheduler's end. ``ask(request_id, hashes, block_tokens)`` sends a lookup (a newer one replaces the
    request's previous one); ``answer(request_id)`` is then the leading tokens the host tier (or store) holds
    for it, held for that request, 0 once ``timeout_s`` passed unanswered (then ``releasable`` names it), or None
    while it may still come. ``abandon`` drops the lookup of a request that ended; ``releasable`` names the
    requests whose holds, if any, can be released now (answered or past the deadline). Never blocks."""

    def __init__(self, address: str, timeout_s: float) -> None:
        self.address, self.timeout_s = address, timeout_s
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(address)
        self._decoder = msgspec.msgpack.Decoder(HoldReply)
        self._seq = 0
        self._by_seq: dict[int, str] = {}  # lookups sent and not answered, timed out or replaced
        self._asked: dict[str, tuple[int, float]] = {}  # request -> (its latest lookup, that lookup's deadline)
        self._answers: dict[str, int] = {}  # request -> tokens, for its latest lookup
        self._abandoned: dict[str, tuple[int, float]] = {}  # ended with a lookup unanswered

    def ask(self, request_id: str, hashes: Hashes, block_tokens: dict[int, int]) -> None:
        self._forget(request_id)  # the server takes lookups in order: this one replaces any earlier one
        self._seq += 1
        deadline = time.monotonic() + self.timeout_s
        self._asked[request_id] = (self._seq, deadline)
        ask = HoldRequest(request_id, hashes, block_tokens, deadline, self._seq)
        try:  # a worker that is not there takes no lookups: once its queue is full, a miss at once, never a wait
            self._socket.send(msgspec.msgpack.encode(ask), zmq.NOBLOCK)
        except zmq.Again:
            logger.warning("kvplane lookup at %s for request %s not sent (no worker takes lookups): counting a "
                           "miss", self.address, request_id)
            self._answers[request_id] = 0
            return
        self._by_seq[self._seq] = request_id

    def asked(self, request_id: str) -> bool:
        return request_id in self._asked

    def answered(self, request_id: str) -> bool:
        """Whether the answer to ``request_id``'s latest lookup is in (``answer`` then returns it). Never waits."""
        self._drain()
        return request_id in self._answers

    def answer(self, request_id: str) -> int | None:
        self._drain()
        if request_id not in self._asked:
            raise KeyError(f"no lookup was asked for request {request_id!r}; call ask() first")
        if request_id in self._answers:
            del self._asked[request_id]
            return self._answers.pop(request_id)
        if time.monotonic() <= self._asked[request_id][1]:
            return None
        self.abandon(request_id)  # a hold the worker made before the deadline is released after it
        logger.warning("kvplane lookup at %s for request %s not answered in %g s: counting a miss", self.address,
                       request_id, self.timeout_s)
        return 0

    def abandon(self, request_id: str) -> None:
        """The request ended: its lookup's hold, if any, is released once ``releasable`` names it."""
        asked = self._asked.pop(request_id, None)
        if asked is not None:
            answered = self._answers.pop(request_id, None) is not None
            self._abandoned[request_id] = (asked[0], -math.inf if answered else asked[1])

    def releasable(self) -> list[str]:
        """Abandoned requests whose lookup was answered or is past its deadline: no hold can come after now."""
        self._drain()
        now = time.monotonic()
        ready = [rid for rid, (_, deadline) in self._abandoned.items() if deadline < now]
        for rid in ready:
            self._by_seq.pop(self._abandoned.pop(rid)[0], None)  # a late answer changes nothing now
        return ready

    def pending(self) -> set[str]:
        """Requests with a lookup asked and not taken, or abandoned and not yet releasable (the tests check it)."""
        return set(self._asked) | set(self._answers) | set(self._abandoned)

    def _forget(self, request_id: str) -> None:
        for table in (self._asked, self._abandoned):
            seq_deadline = table.pop(request_id, None)
            if seq_deadline is not None:
                self._by_seq.pop(seq_deadline[0], None)
        self._answers.pop(request_id, None)

    def _drain(self) -> None:
        while self._socket.poll(0):
            reply = self._decoder.decode(self._socket.recv())
            rid = self._by_seq.pop(reply.seq, None)
            if rid is None:  # replaced, or past its deadline: nothing waits for it
                continue
            if rid in self._asked:
                self._answers[rid] = reply.tokens
            elif rid in self._abandoned:  # answered: its hold, if any, exists now and may be released
                self._abandoned[rid] = (reply.seq, -math.inf)

    def close(self) -> None:
        self._socket.close()
        self._context.term()
