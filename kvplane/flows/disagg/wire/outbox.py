"""Plans waiting for, and moving through, the transport: per peer, a few transfers in flight, the rest queued.

Both sides hand plans to an ``Outbox`` on the I/O loop: a prefill rank its pushes (WRITE), a decode rank its
pulls (READ). At most ``max_inflight`` transfers run per peer; plans queued behind them leave together as one
transfer (one coalesced engine batch for many requests). ``pump`` polls what is in flight and calls each
plan's callback exactly once, with ``None`` on success or the error, so every request learns how its bytes
fared even when the transport raised for the whole batch.

A callback means the engine can no longer move a byte of its plan. A transfer that ended unsettled (it
timed out while the engine still had it queued) is parked in ``unsettled`` instead: its callbacks run only
after the owner fenced the engine (``Mover`` resets the transport, then calls ``release_unsettled``).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvplane.descriptors import CopyPlan
from kvplane.errors import KvplaneError, TransferFailed
from kvplane.transports.base import Op, Transfer, Transport

logger = logging.getLogger("kvplane.disagg")
Callback = Callable[[KvplaneError | None], None]


@dataclass
class _Batch:
    transfer: Transfer
    callbacks: list[Callback]
    wakes: bool = False  # the transfer calls the outbox's wake when it ends: no need to poll it often


@dataclass
class _Peer:
    queued: deque[tuple[CopyPlan, Callback]] = field(default_factory=deque)
    inflight: list[_Batch] = field(default_factory=list)


class Outbox:
    def __init__(self, transport: Transport, op: Op, max_inflight: int,
                 wake: Callable[[], None] | None = None) -> None:
        self.transport, self.op, self.max_inflight = transport, op, max_inflight
        self._wake = wake  # handed to each transfer: called once it can be retired (engines that can tell)
        self._peers: dict[str, _Peer] = {}
        self.unsettled: list[tuple[_Batch, KvplaneError | None]] = []

    def put(self, peer: str, plan: CopyPlan, callback: Callback) -> None:
        """Queue ``plan`` for ``peer``; an empty plan succeeds at once."""
        if not len(plan):
            callback(None)
            return
        self._peers.setdefault(peer, _Peer()).queued.append((plan, callback))

    @property
    def busy(self) -> bool:
        return any(p.queued or p.inflight for p in self._peers.values())

    @property
    def polled(self) -> bool:
        """Whether something in flight must be polled to learn it ended (its transfer cannot wake the owner)."""
        return any(not b.wakes for p in self._peers.values() for b in p.inflight)

    @property
    def moving(self) -> int:
        """Plans queued or in flight, unsettled ones included."""
        parked = sum(len(b.callbacks) for b, _ in self.unsettled)
        return parked + sum(len(p.queued) + sum(len(b.callbacks) for b in p.inflight) for p in self._peers.values())

    def release_unsettled(self, why: str) -> None:
        """The engine was reset: every parked plan ends (with its own error, or ``why``)."""
        parked, self.unsettled = self.unsettled, []
        for batch, error in parked:
            for callback in batch.callbacks:
                self._call(callback, error or TransferFailed(why))

    def pump(self) -> None:
        """Retire finished transfers (callbacks run here), start what the limits allow, and retire again: an
        engine that copies inside ``submit`` (NIXL over cma, same host) has finished the new ones already, and
        their requests should not wait a poll interval to learn it."""
        if self._pass():
            self._pass()

    def _pass(self) -> bool:
        """One pass of ``pump``: retire, then start; whether it started a transfer."""
        started = False
        for peer, state in self._peers.items():
            still = []
            for batch in state.inflight:
                done, error = self._outcome(batch.transfer)
                if not done:
                    still.append(batch)
                    continue
                if not batch.transfer.settled:
                    self.unsettled.append((batch, error))
                    continue
                for callback in batch.callbacks:
                    self._call(callback, error)
            state.inflight = still
            while state.queued and len(state.inflight) < self.max_inflight:
                items = list(state.queued)
                state.queued.clear()
                plan = CopyPlan.concat([p for p, _ in items]) if len(items) > 1 else items[0][0]
                callbacks = [c for _, c in items]
                try:
                    transfer = self.transport.submit(peer, self.op, plan)
                except KvplaneError as e:
                    for callback in callbacks:
                        self._call(callback, e)
                    continue
                wakes = self._wake is not None and transfer.call_when_done(self._wake)
                state.inflight.append(_Batch(transfer, callbacks, wakes))
                started = True
        return started

    @staticmethod
    def _outcome(transfer: Transfer) -> tuple[bool, KvplaneError | None]:
        """``(finished, error)``: ``(False, None)`` while it runs."""
        try:
            return transfer.poll(), None
        except KvplaneError as e:
            return True, e
        except Exception as e:  # an engine binding raising something untyped: never lose it
            return True, TransferFailed(f"transfer raised {type(e).__name__}: {e}")

    @staticmethod
    def _call(callback: Callback, error: KvplaneError | None) -> None:
        try:
            callback(error)
        except Exception:
            logger.exception("a transfer callback failed")
