"""``SideLifecycle``: what a ``DecodeSide`` and a ``PrefillSide`` share once built: how many plans they have in
flight, and how they close (the guard, the IO loop, the transfer thread, then the local KV and its transport).

Each side builds these parts itself, in its own order; the mixin only declares them.
"""

from __future__ import annotations

from typing import TypeVar

from kvplane.flows.disagg.auth import Guard
from kvplane.flows.disagg.local import LocalKV
from kvplane.flows.disagg.loop import IOLoop
from kvplane.flows.disagg.mover import Mover
from kvplane.flows.disagg.published import Published

_Side = TypeVar("_Side", bound="SideLifecycle")


class SideLifecycle:
    local: LocalKV
    _out: Published
    _guard: Guard
    _loop: IOLoop
    _mover: Mover

    def transfers_in_flight(self, timeout_s: float = 10.0) -> int:
        """Plans of this side queued for or moving through the transport, as the loop last published."""
        return self._out.in_flight

    def close(self) -> None:
        self._guard.stop()
        self._loop.stop()
        self._mover.stop()
        self.local.close()

    def __enter__(self: _Side) -> _Side:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
