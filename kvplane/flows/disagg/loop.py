"""The I/O loop of one side: a daemon thread that owns its ZMQ sockets, runs the engine's commands, and ticks.

All of a side's state is touched by this thread alone, so the flow needs no locks: the engine's thread hands
work over with ``submit`` (returns at once), and a wake-up socket ends the poll early. The engine thread never
waits on the loop: after every pass the loop calls ``publish``, which hands what the engine may read
(completions, counts) to it through thread-safe structures. Between messages the loop calls ``tick`` (expire
leases, send heartbeats), which says how soon it wants to run again. Work that may block (transfers, probing a
peer's transport) runs on other threads and comes back through ``submit``. A handler that raises is logged and
the loop carries on: one bad message or bug in one request never takes the listener down.
"""

from __future__ import annotations

import itertools
import logging
import math
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

import zmq

from kvplane.flows.disagg.errors import DisaggError

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
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = queue.SimpleQueue()
        address = f"inproc://kvplane-wake-{next(_ids)}"
        self._wake_rx = self.context.socket(zmq.PAIR)
        self._wake_rx.bind(address)
        self._wake_tx = self.context.socket(zmq.PAIR)
        self._wake_tx.connect(address)
        self._wake_lock = threading.Lock()
        self._poller = zmq.Poller()
        self._poller.register(self._wake_rx, zmq.POLLIN)
        self._handlers: dict[zmq.Socket[bytes], Callable[[zmq.Socket[bytes]], None]] = {}
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def on_loop(self) -> bool:
        return threading.current_thread() is self._thread

    # -- from any thread ----------------------------------------------------------------------------------
    def submit(self, fn: Callable[[], T]) -> Future[T]:
        """Run ``fn`` on the loop thread soon; returns at once."""
        future: Future[T] = Future()
        if self._stopping:
            future.set_exception(DisaggError(f"{self.name} is closed; create a new side"))
            return future
        self._commands.put((fn, future))
        with self._wake_lock:
            try:
                self._wake_tx.send(b"", zmq.NOBLOCK)
            except zmq.Again:  # the loop is already due to wake: a pending wake-up is enough
                pass
        return future

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._stopping:
            return
        self.submit(lambda: None)
        self._stopping = True
        with self._wake_lock:
            try:
                self._wake_tx.send(b"", zmq.NOBLOCK)
            except zmq.Again:
                pass
        if self._thread.is_alive() and not self.on_loop:
            self._thread.join(timeout_s)
        with self._wake_lock:
            self._wake_tx.close(linger=0)
        if not self._thread.is_alive():
            self.context.term()

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
            self._run_commands()
            if self._stopping:
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
            self._run_commands()
            try:
                self._publish()
            except Exception:
                logger.exception("%s: publishing state failed; carrying on", self.name)
        for socket in list(self._handlers):
            self.unwatch(socket)
        self._wake_rx.close(linger=0)

    def _run_commands(self) -> None:
        while True:
            try:
                fn, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as e:  # handed to whoever waits on the future
                future.set_exception(e)
