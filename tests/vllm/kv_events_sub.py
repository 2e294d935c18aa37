"""A subscriber to vLLM's ``ZmqEventPublisher``: a zmq SUB socket, each batch decoded with vLLM's own
``msgspec`` decoder for ``KVEventBatch`` (the wire form is ``(topic, seq, payload)``, kv_events.py); batches a late
SUB missed come from the publisher's replay socket (``replay``: vLLM's own protocol, a start sequence number in,
the buffered batches and an end marker out)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch


class Subscriber:
    def __init__(self, endpoint: str) -> None:
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.SUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._socket.connect(endpoint)
        self._decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self.events: list[Any] = []
        self.seqs: set[int] = set()

    def join(self, publisher: Any, within_s: float = 30.0) -> None:
        """Publish empty batches through vLLM's publisher until one arrives: the subscription is live (a SUB
        that joins late misses what was published before)."""
        end = time.monotonic() + within_s
        while time.monotonic() < end:
            publisher.publish(KVEventBatch(ts=time.time(), events=[]))
            if self._socket.poll(100):
                self._read()
                return
        raise AssertionError(f"no batch from vLLM's publisher within {within_s} s")

    def _read(self) -> list[float]:
        stamps = []
        while self._socket.poll(0):
            stamps += self._take(*self._socket.recv_multipart()[1:])
        return stamps

    def _take(self, seq: bytes, payload: bytes) -> list[float]:
        n = int.from_bytes(seq, "big")
        if n in self.seqs:
            return []
        self.seqs.add(n)
        batch = self._decoder.decode(payload)
        self.events.extend(batch.events)
        return [batch.ts]

    def replay(self, endpoint: str, within_s: float = 30.0) -> None:
        """Every batch the publisher still buffers that this SUB missed (read from sequence number 0)."""
        self._read()
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(endpoint)
        try:
            dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            end = time.monotonic() + within_s
            while time.monotonic() < end:
                if not dealer.poll(100):
                    continue
                _, _topic, seq, payload = dealer.recv_multipart()
                if not payload:  # the end marker
                    return
                self._take(seq, payload)
            raise AssertionError(f"the publisher's replay did not end within {within_s} s")
        finally:
            dealer.close()

    def flush(self, publisher: Any, within_s: float = 30.0) -> None:
        """Read everything vLLM's publisher was given so far: it sends in order, so once a marker batch
        published now arrives, every batch before it has."""
        marker = -time.monotonic()
        publisher.publish(KVEventBatch(ts=marker, events=[]))
        end = time.monotonic() + within_s
        while marker not in self._read():
            if time.monotonic() > end:
                raise AssertionError(f"vLLM's publisher did not deliver a batch within {within_s} s")
            self._socket.poll(100)

    def until(self, done: Callable[[list[Any]], bool], step: Callable[[], None], within_s: float = 30.0) -> None:
        """Read batches (stepping the engine between reads) until ``done(self.events)``."""
        end = time.monotonic() + within_s
        for _ in itertools.count():
            self._read()
            if done(self.events):
                return
            if time.monotonic() > end:
                raise AssertionError(f"not seen within {within_s} s; events so far: {self.events}")
            step()
            self._socket.poll(20)

    def stored(self, medium: str, group: int | None = None) -> list[Any]:
        """The hashes of every ``BlockStored`` of ``medium`` (and group), in order."""
        return [h for e in self.events if isinstance(e, BlockStored) and e.medium == medium
                and (group is None or e.group_idx == group) for h in e.block_hashes]

    def removed(self, medium: str, group: int | None = None) -> list[Any]:
        return [h for e in self.events if isinstance(e, BlockRemoved) and e.medium == medium
                and (group is None or e.group_idx == group) for h in e.block_hashes]

    def of(self, cls: type, medium: str) -> list[Any]:
        return [e for e in self.events if isinstance(e, cls) and e.medium == medium]

    def close(self) -> None:
        self._socket.close()
        self._context.term()
