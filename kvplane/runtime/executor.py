"""``Executor``: one named daemon thread that runs jobs in submission order.

The building block for kvplane's ordered workers: the cpu backend's streams (``backend/cpu/streams.py``, which
add tickets and events on top) and the store tier's I/O and query workers (``flows/offload/store.py``). The
jobs and what happens when one raises are ``JobQueue``'s (``jobs.py``): ``submit`` gives a future, ``post``
does not, an exception is logged once with the job's name and handed to the future if there is one.

One thread per executor, never one per call. It is a daemon, so a job stuck in a foreign call (a store master
that stopped answering) never keeps the process from exiting, and nothing is joined at exit. ``close`` says
what becomes of queued work: run first (the default) or dropped (``discard_pending``), and whether to wait
for the thread. An executor dropped without ``close`` finishes its queue and ends its thread too: the thread
holds the queue, not the executor, and the executor's finalizer closes the queue.

Not built on it, on purpose: the disaggregation I/O loop (it polls ZMQ sockets and runs a tick between jobs,
so it drains a ``JobQueue`` from its own thread), the P/D transfer thread (``flows/disagg/wire/mover.py``: it polls
transfers in flight between new plans), the peer probes (``flows/disagg/wire/peers.py``: one short-lived thread
per connect, so a hung connect never delays the next) and Mooncake's per-transfer threads.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

from kvplane.runtime.jobs import JobQueue

T = TypeVar("T")


class Executor:
    """Jobs run one after another on a daemon thread named ``name``."""

    post: Callable[..., None]
    """``post(fn, *args, name=None)``: run ``fn(*args)`` like ``submit``, with no future; an exception it raises
    is logged with ``name`` and goes no further. The cheap form for hot paths: it is the queue's own method."""

    def __init__(self, name: str, fix: str = "") -> None:
        """``fix`` ends the error raised for work handed over after ``close`` (default: "create a new one")."""
        self.name = name
        self._jobs = JobQueue(name, fix)
        self.post = self._jobs.post
        self._thread = threading.Thread(target=self._jobs.drain, name=name, daemon=True)
        self._thread.start()  # it holds the queue, not this executor
        self._finalizer = weakref.finalize(self, self._jobs.close)
        self._finalizer.atexit = False  # at exit the daemon thread is simply left, as any stuck job would be

    @property
    def alive(self) -> bool:
        """Whether the thread still runs (it ends once closed and drained)."""
        return self._thread.is_alive()

    @property
    def closed(self) -> bool:
        return self._jobs.closed

    def submit(self, fn: Callable[[], T], name: str | None = None) -> Future[T]:
        """Run ``fn`` after everything queued before it; its result or exception lands on the future.
        Raises ``ExecutorClosed`` after ``close``."""
        return self._jobs.submit(fn, name)

    def close(self, *, discard_pending: bool = False, wait: bool = True, timeout_s: float | None = None) -> bool:
        """Refuse new work; run what is queued (or drop it, cancelling its futures, with ``discard_pending``);
        then, with ``wait``, wait up to ``timeout_s`` for the thread to end. True when the thread has ended.
        Closing twice is harmless; closing from a job of this executor never waits on itself."""
        self._jobs.close()
        if discard_pending:
            self._jobs.discard()
        if wait and threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<Executor {self.name!r} {state}, thread {'alive' if self.alive else 'ended'}>"
