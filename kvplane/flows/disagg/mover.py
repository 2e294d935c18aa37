"""The transfer thread of one side: submits and polls its plans off the I/O loop.

NIXL's ``transfer()`` and ``check_xfer_state`` copy synchronously on the calling thread when UCX uses cma
(same-host peers), for as long as a whole chunk takes; Mooncake's status calls block too. Run on the I/O loop,
they held handshakes, heartbeats and every engine call behind a transfer. So a ``Mover`` runs an ``Outbox`` on
a thread of its own: the loop ``put``s plans (returns at once), and each plan's callback is handed back to the
loop (``deliver``), where the request's state lives. ``moving`` counts plans put and not yet called back; it
is read and written on the loop thread only.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

from kvplane.descriptors import CopyPlan
from kvplane.errors import KvplaneError
from kvplane.flows.disagg.outbox import Callback, Outbox
from kvplane.metrics import recorder
from kvplane.transports.base import Op, Transport

logger = logging.getLogger("kvplane.disagg")
POLL_S = 0.0005  # how often transfers in flight are polled; a new plan wakes the thread at once


class Mover:
    def __init__(self, name: str, transport: Transport, op: Op, max_inflight: int,
                 deliver: Callable[[Callable[[], None]], object], flow: str = "") -> None:
        self.flow = flow or ("pull" if op == "READ" else "push")  # the metrics' flow label
        self._outbox = Outbox(transport, op, max_inflight)
        self._deliver = deliver
        self._inbox: deque[tuple[str, CopyPlan, Callback]] = deque()
        self._wake = threading.Condition()
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

    def stop(self, timeout_s: float = 10.0) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._inbox and not self._outbox.busy and not self._stopping:
                    self._wake.wait()
                if self._stopping:
                    return
                items = list(self._inbox)
                self._inbox.clear()
            for peer, plan, ended in items:
                self._outbox.put(peer, plan, ended)
            try:
                self._outbox.pump()
            except Exception:  # the outbox calls every callback itself; this is a bug, not a transfer error
                logger.exception("kvplane transfer thread: pump failed; carrying on")
            if self._outbox.busy:
                with self._wake:
                    if not self._inbox and not self._stopping:
                        self._wake.wait(POLL_S)
