"""``JobQueue``: a FIFO of named callables, and the one rule for running a job.

Every hand-off of work to another kvplane thread goes through one of these: an ``Executor`` drains it on a
thread of its own; the disaggregation I/O loop (``flows/disagg/loop.py``) drains it between socket polls. Both
then behave alike:

- ``submit`` returns a ``concurrent.futures.Future``; ``post`` is fire-and-forget (no future is made, for the
  hot paths). Jobs run in the order they were queued.
- A job that raises is logged once, at ERROR with its traceback, naming the queue's owner and the job; a
  submitted job's exception is also set on its future, so the caller still gets it. Nothing a job raises
  escapes to the draining thread, which carries on with the next job.
- ``close`` refuses later work with ``ExecutorClosed``; what was accepted before stays queued, and the owner
  either runs it (``run_pending`` / its thread drains to the stop mark) or drops it explicitly (``discard``,
  which cancels the futures and says how many jobs it dropped).

The job's name is worked out only when it is needed for a log line, so naming costs nothing on the hot path.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from kvplane.errors import KvplaneError

T = TypeVar("T")
logger = logging.getLogger("kvplane.runtime")

# (work, its future or None for fire-and-forget, its name or None to describe the callable)
Job = tuple[Callable[[], Any], "Future[Any] | None", "str | None"]


class ExecutorClosed(KvplaneError, RuntimeError):
    """Work was handed to an executor or loop after it was closed."""


def describe(fn: Callable[..., Any]) -> str:
    """A readable name for a job that was given none: its qualified name, or its repr (a ``partial``)."""
    return getattr(fn, "__qualname__", None) or repr(fn)


class JobQueue:
    """Jobs for one owner (an executor's or a loop's thread), in submission order; thread-safe."""

    def __init__(self, owner: str, fix: str = "") -> None:
        self.owner = owner  # the thread's name: every log line and error names it
        self._fix = fix or "create a new one"
        self._queue: queue.SimpleQueue[Job | None] = queue.SimpleQueue()  # None: the stop mark
        self._lock = threading.Lock()  # a job is either refused or queued before the stop mark, never after it
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def submit(self, fn: Callable[[], T], name: str | None = None) -> Future[T]:
        """Queue ``fn``; its result or exception lands on the returned future."""
        future: Future[T] = Future()
        self._put((fn, future, name))
        return future

    def post(self, fn: Callable[[], object], name: str | None = None) -> None:
        """Queue ``fn`` with no future: an exception it raises is logged, and that is all."""
        self._put((fn, None, name))

    def close(self) -> bool:
        """Refuse work from now on and queue the stop mark; False when it was already closed."""
        with self._lock:
            if self._closed:
                return False
            self._closed = True
            self._queue.put(None)
        return True

    def take(self, timeout_s: float | None = None) -> Job | None:
        """The next job, waiting for one; None at the stop mark (or when ``timeout_s`` passed)."""
        try:
            return self._queue.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def run_pending(self) -> int:
        """Run every job queued now, on the calling thread, without waiting for more; how many ran."""
        ran = 0
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return ran
            if job is not None:
                self.run(job)
                ran += 1

    def discard(self) -> int:
        """Drop every job still queued (their futures are cancelled); how many were dropped. Puts the stop mark
        back, so a thread draining this queue still stops."""
        dropped = 0
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                dropped += 1
                if job[1] is not None:
                    job[1].cancel()
        if self._closed:
            self._queue.put(None)
        if dropped:
            logger.warning("%s: %d queued job(s) dropped unrun at close", self.owner, dropped)
        return dropped

    def run(self, job: Job) -> None:
        """Run one job here: its result or exception goes to its future; an exception is logged once."""
        fn, future, name = job
        if future is None:
            try:
                fn()
            except BaseException as e:  # the draining thread must outlive any job
                self._report(fn, name, e)
            return
        if not future.set_running_or_notify_cancel():
            return  # cancelled while queued
        try:
            result = fn()
        except BaseException as e:
            self._report(fn, name, e)
            future.set_exception(e)
        else:
            future.set_result(result)

    def _put(self, job: Job) -> None:
        with self._lock:
            if self._closed:
                raise ExecutorClosed(f"{self.owner} is closed and takes no more work; {self._fix}")
            self._queue.put(job)

    def _report(self, fn: Callable[..., Any], name: str | None, error: BaseException) -> None:
        logger.error("%s: job %s raised %s: %s", self.owner, name or describe(fn), type(error).__name__, error,
                     exc_info=error)
