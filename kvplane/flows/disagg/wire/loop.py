"""The I/O loop of one side: a daemon thread that owns its ZMQ sockets, runs the engine's commands, and ticks.

All of a side's state is touched by this thread alone, so the flow needs no locks: the engine's thread hands
work over with ``submit`` (returns at once), and a wake-up socket ends the poll early. The engine thread never
waits on the loop: after every pass the loop calls ``publish``, which hands what the engine may read
(completions, counts) to it through thread-safe structures. Between messages the loop calls ``tick`` (expire
leases, send heartbeats), which says how soon it wants to run again. Work that may block (transfers, probing a
peer's transport) runs on other threads and comes back through ``submit``. A handler that raises is logged and
the loop carries on: one bad message or bug in one request never takes the listener down.

The commands are a ``JobQueue`` (``kvplane/runtime``), the same queue an ``Executor`` drains, so they behave as
every other hand-off does: in order, a command that raises is logged with its name (the sides drop the futures
``submit`` returns) as well as set on its future, and a stopped loop refuses work. The loop is not an
``Executor`` itself: its thread waits in a ZMQ poll, not on the queue, and runs the tick and the socket
handlers between commands; ``submit`` wakes the poll through an inproc socket.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

import zmq

from kvplane.flows.disagg.wire.errors import DisaggError
from kvplane.runtime import ExecutorClosed, JobQueue

T = TypeVar("T")
logger = logging.getLogger("kvplane.disagg")
MAX_WAIT_S = 0.05  # the longest the loop sleeps with nothing to do (leases and heartbeats are coarser)
_ids = itertools.count()


class IOLoop:
    def __init__(self, name: str, tick: Callable[[], float], publish: Callable[[], None] = lambda: None) -> None:
        self.name = name
        self.context = zmq.Context()
        self._tick = tick
        self._publish = publish
        self._commands = JobQueue(name, "create a new side")
        address = f"inproc://kvplane-wake-{next(_ids)}"
        self._wake_rx = self.context.socket(zmq.PAIR)
        self._wake_rx.bind(address)
        self._wake_tx = self.context.socket(zmq.PAIR)
        self._wake_tx.connect(address)
        self._wake_lock = threading.Lock()
        self._poller = zmq.Poller()
        self._poller.register(self._wake_rx, zmq.POLLIN)
        self._handlers: dict[zmq.Socket[bytes], Callable[[zmq.Socket[bytes]], None]] = {}
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def on_loop(self) -> bool:
        return threading.current_thread() is self._thread

    # -- from any thread ----------------------------------------------------------------------------------
    def submit(self, fn: Callable[[], T], name: str | None = None) -> Future[T]:
        """Run ``fn`` on the loop thread soon; returns at once. An exception it raises is logged (with ``name``,
        or the callable's) and set on the future."""
        try:
            future = self._commands.submit(fn, name)
        except ExecutorClosed:
            future = Future()
            future.set_exception(DisaggError(f"{self.name} is closed; create a new side"))
            return future
        self._wake()
        return future

    def stop(self, timeout_s: float = 10.0) -> None:
        """Run the commands queued so far, then end the thread (waiting up to ``timeout_s`` unless called from
        the loop itself). Stopping twice is harmless."""
        if not self._commands.close():
            return
        self._wake()
        if self._thread.is_alive() and not self.on_loop:
            self._thread.join(timeout_s)
        with self._wake_lock:
            self._wake_tx.close(linger=0)
        if not self._thread.is_alive():
            self.context.term()

    def _wake(self) -> None:
        with self._wake_lock:
            if self._wake_tx.closed:  # stopped meanwhile: the loop drains the queue once more before it ends
                return
            try:
                self._wake_tx.send(b"", zmq.NOBLOCK)
            except zmq.Again:  # the loop is already due to wake: a pending wake-up is enough
                pass

    # -- on the loop thread -------------------------------------------------------------------------------
    def watch(self, socket: zmq.Socket[bytes], handler: Callable[[zmq.Socket[bytes]], None]) -> None:
        self._handlers[socket] = handler
        self._poller.register(socket, zmq.POLLIN)

    def unwatch(self, socket: zmq.Socket[bytes]) -> None:
        if self._handlers.pop(socket, None) is not None:
            self._poller.unregister(socket)
        socket.close(linger=0)

    def _run(self) -> None:
        while True:
            stopping = self._commands.closed  # read first: every command accepted before stop is queued now
            self._commands.run_pending()
            if stopping:
                break
            try:
                wait_s = min(max(self._tick(), 0.0), MAX_WAIT_S)
            except Exception:
                logger.exception("%s: tick failed; carrying on", self.name)
                wait_s = MAX_WAIT_S
            ready = dict(self._poller.poll(math.ceil(wait_s * 1000)))  # ms; a short wait rounds up to 1
            if self._wake_rx in ready:
                while True:
                    try:
                        self._wake_rx.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
            for socket, handler in list(self._handlers.items()):
                if socket in ready:
                    try:
                        handler(socket)
                    except Exception:
                        logger.exception("%s: a message handler failed; the message is dropped", self.name)
            self._commands.run_pending()
            try:
                self._publish()
            except Exception:
                logger.exception("%s: publishing state failed; carrying on", self.name)
        for socket in list(self._handlers):
            self.unwatch(socket)
        self._wake_rx.close(linger=0)
