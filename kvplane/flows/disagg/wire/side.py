"""``SideLifecycle``: what a ``DecodeSide`` and a ``PrefillSide`` share once built: how many plans they have in
flight, how the loop takes in the messages waiting on a socket, and how they close (the guard, the IO loop, the
transfer thread, then the local KV and its transport).

Each side builds these parts itself, in its own order; the mixin only declares them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

import zmq

from kvplane.flows.disagg.wire import channel
from kvplane.flows.disagg.wire.auth import Guard
from kvplane.flows.disagg.wire.config import DisaggConfig
from kvplane.flows.disagg.wire.local import LocalKV
from kvplane.flows.disagg.wire.loop import IOLoop
from kvplane.flows.disagg.wire.messages import Message
from kvplane.flows.disagg.wire.mover import Mover
from kvplane.flows.disagg.wire.published import Published

_Side = TypeVar("_Side", bound="SideLifecycle")
logger = logging.getLogger("kvplane.disagg")


class SideLifecycle:
    config: DisaggConfig
    counters: channel.Counters
    local: LocalKV
    _out: Published
    _guard: Guard
    _loop: IOLoop
    _mover: Mover

    def transfers_in_flight(self, timeout_s: float = 10.0) -> int:
        """Plans of this side queued for or moving through the transport, as the loop last published."""
        return self._out.in_flight

    def _receive(self, sock: zmq.Socket[bytes], routed: bool, dispatch: Callable[[bytes, str, Message], None]
                 ) -> None:
        """Hand every message waiting on ``sock`` to ``dispatch(identity, key, message)`` (``channel.receive``);
        one that trips a bug is
        counted as rejected and logged, and never drops the ones behind it. On the loop thread."""
        for identity, key, message in channel.receive(sock, self.config.max_message_bytes, self.counters, routed):
            try:
                dispatch(identity, key, message)
            except Exception:
                self.counters.rejected += 1
                logger.exception("%s rank %d: handling %s failed; dropped", self.local.role, self.config.rank,
                                 type(message).__name__)

    def close(self) -> None:
        self._guard.stop()
        self._loop.stop()
        self._mover.stop()
        self.local.close()

    def __enter__(self: _Side) -> _Side:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
