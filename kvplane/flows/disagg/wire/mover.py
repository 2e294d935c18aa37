"""The transfer thread of one side: submits and polls its plans off the I/O loop.

NIXL's ``transfer()`` and ``check_xfer_state`` copy synchronously on the calling thread when UCX uses cma
(same-host peers), for as long as a whole chunk takes; Mooncake's status calls block too. Run on the I/O loop,
they held handshakes, heartbeats and every engine call behind a transfer. So a ``Mover`` runs an ``Outbox`` on
a thread of its own: the loop ``put``s plans (returns at once), and each plan's callback is handed back to the
loop (``deliver``), where the request's state lives. ``moving`` counts plans put and not yet called back; it
is read and written on the loop thread only. The thread is not a ``kvplane.runtime.Executor``: it does not
wait for the next job but polls the transfers in flight (every ``POLL_S``; transfers that say when they end,
Mooncake's, wake it instead), and a fence or a restart may be due with no plan queued.

The fence: a plan's callback runs only once the engine can no longer move a byte of it. A transfer that ended
unsettled (timed out while the engine kept it queued, as over a link that is down) makes the mover reset the
transport (``Transport.reset``), which ends everything in flight through it, before any of those callbacks
run; ``fence`` asks for the same reset from the loop (a push whose writer is out of reach). ``on_reset`` then
runs on the loop, so the side can have peers load its new transport descriptor. A reset that fails is
retried every ``RESET_RETRY_S``, and the plans stay unreported meanwhile. An engine that cannot start again at
once (UCX finds no usable device while the link is down) is started from here, with the transport's back-off,
and ``on_reset`` runs again when it does.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from kvplane.descriptors import CopyPlan
from kvplane.errors import KvplaneError
from kvplane.flows.disagg.wire.outbox import Callback, Outbox
from kvplane.metrics import recorder
from kvplane.transports.base import Op, Transport

logger = logging.getLogger("kvplane.disagg")
POLL_S = 0.0005  # how often transfers in flight are polled; a new plan wakes the thread at once
WOKEN_POLL_S = 0.05  # the same while every transfer in flight wakes the thread itself as it ends (a safety net)
RESET_RETRY_S = 1.0
RESTART_POLL_S = 0.1  # an engine a reset left down is tried this often (the transport keeps its own back-off)


class Mover:
    def __init__(self, name: str, transport: Transport, op: Op, max_inflight: int,
                 deliver: Callable[[Callable[[], None]], object], flow: str = "",
                 on_reset: Callable[[str], None] | None = None) -> None:
        self.flow = flow or ("pull" if op == "READ" else "push")  # the metrics' flow label
        self._outbox = Outbox(transport, op, max_inflight, wake=self._kick)
        self._transport = transport
        self._deliver = deliver
        self._on_reset = on_reset
        self._fences: list[Callable[[], None]] = []  # asked for by the loop
        self._retry_reset_at = 0.0
        self._down = False  # reset, and the engine could not start again yet
        self.resets = 0
        self._inbox: deque[tuple[str, CopyPlan, Callback]] = deque()
        self._wake = threading.Condition()
        self._kicked = False  # a transfer in flight ended since the last pump: poll at once
        self._stopping = False
        self.moving = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, peer: str, plan: CopyPlan, callback: Callback) -> None:
        """Move ``plan`` to or from ``peer``; ``callback(error or None)`` runs on the loop once it ended."""
        self.moving += 1
        callback = recorder().timed(self.flow, self._outbox.transport.name, self._outbox.op.lower(), plan.total_bytes,
                                    callback)

        def ended(error: KvplaneError | None) -> None:  # on this mover's thread
            def on_loop() -> None:
                self.moving -= 1
                callback(error)

            self._deliver(on_loop)

        with self._wake:
            self._inbox.append((peer, plan, ended))
            self._wake.notify()

    def fence(self, done: Callable[[], None], why: str) -> None:
        """Reset the transport so nothing queued before can land; ``done()`` runs on the loop afterwards."""
        logger.warning("kvplane %s: resetting the %s engine: %s", self._thread.name, self._transport.name, why)
        with self._wake:
            self._fences.append(done)
            self._wake.notify()

    def _kick(self) -> None:
        """A transfer says it ended (from the engine's thread): pump now rather than at the next poll."""
        with self._wake:
            self._kicked = True
            self._wake.notify()

    def stop(self, timeout_s: float = 10.0) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._inbox and not self._outbox.busy and not self._stopping and not self._fences \
                        and not self._outbox.unsettled and not self._down:
                    self._wake.wait()
                if self._stopping:
                    return
                items = list(self._inbox)
                self._inbox.clear()
                self._kicked = False
            for peer, plan, ended in items:
                self._outbox.put(peer, plan, ended)
            try:
                self._outbox.pump()
            except Exception:  # the outbox calls every callback itself; this is a bug, not a transfer error
                logger.exception("kvplane transfer thread: pump failed; carrying on")
            if (self._outbox.unsettled or self._fences) and time.monotonic() >= self._retry_reset_at:
                self._reset()
            if self._down and self._transport.restart():
                self._down = False
                logger.warning("kvplane %s: the %s engine runs again", self._thread.name, self._transport.name)
                if self._on_reset is not None:
                    on_reset = self._on_reset
                    self._deliver(lambda: on_reset("the engine started again"))
            if self._outbox.busy or self._outbox.unsettled or self._fences or self._down:
                pause = self._pause()
                with self._wake:
                    if not self._inbox and not self._stopping and not self._kicked:
                        self._wake.wait(pause)

    def _pause(self) -> float:
        """How long the thread sleeps before its next pump, unless a plan, a kick or a stop comes first."""
        if self._outbox.busy:
            return POLL_S if self._outbox.polled else WOKEN_POLL_S
        if self._down:
            return RESTART_POLL_S
        return max(POLL_S, self._retry_reset_at - time.monotonic())

    def _reset(self) -> None:
        """The fence: reset the engine, then end every parked plan and tell the loop."""
        with self._wake:
            fences, self._fences = self._fences, []
        why = f"{len(self._outbox.unsettled)} transfers ended while the engine still had them queued" \
            if self._outbox.unsettled else "asked for by the flow"
        started = time.monotonic()
        try:
            self._transport.reset()
        except Exception as e:
            logger.error("kvplane %s: resetting the %s engine failed (%s: %s); retried in %.0f s, the requests "
                         "it moves stay draining", self._thread.name, self._transport.name, type(e).__name__, e,
                         RESET_RETRY_S)
            self._retry_reset_at = time.monotonic() + RESET_RETRY_S
            with self._wake:
                self._fences[:0] = fences
            return
        self.resets += 1
        self._down = not self._transport.restart()  # a device still down: started again from _run
        logger.warning("kvplane %s: the %s engine was reset in %.2f s (%s); nothing queued before can land",
                       self._thread.name, self._transport.name, time.monotonic() - started, why)
        self._outbox.release_unsettled(f"the {self._transport.name} engine was reset")
        self._outbox.pump()  # transfers the reset ended: their callbacks run now
        for done in fences:
            self._deliver(done)
        if self._on_reset is not None:
            on_reset = self._on_reset
            self._deliver(lambda: on_reset(why))
