"""``JobQueue``: a FIFO of named callables, and the one rule for running a job.

Every hand-off of work to another kvplane thread goes through one of these: an ``Executor`` drains it on a
thread of its own; the disaggregation I/O loop (``flows/disagg/wire/loop.py``) drains it between socket polls. Both
then behave alike:

- ``submit`` returns a ``concurrent.futures.Future``; ``post`` is fire-and-forget (no future is made, and the
  arguments ride in the job, so a hot path builds no closure or ``partial``). Jobs run in the order queued.
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

# (work, its arguments, its future or None for fire-and-forget, its name or None to describe the callable)
Job = tuple[Callable[..., Any], tuple[Any, ...], "Future[Any] | None", "str | None"]
_NO_ARGS: tuple[Any, ...] = ()


class ExecutorClosed(KvplaneError, RuntimeError):
    """Work was handed to an executor or loop after it was closed."""


def describe(fn: Callable[..., Any], args: tuple[Any, ...] = ()) -> str:
    """A readable name for a job that was given none: its qualified name (or repr, for a ``partial``), followed
    by the names of the callables among its arguments, so a wrapper names the work it wraps."""
    name = getattr(fn, "__qualname__", None) or repr(fn)
    inner = [describe(arg) for arg in args if callable(arg)]
    return f"{name}({', '.join(inner)})" if inner else name


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
        with self._lock:
            if self._closed:
                raise self._refusal()
            self._queue.put((fn, _NO_ARGS, future, name))
        return future

    def post(self, fn: Callable[..., object], *args: Any, name: str | None = None) -> None:
        """Queue ``fn(*args)`` with no future: an exception it raises is logged, and that is all."""
        with self._lock:  # inline, not a helper: this is the cpu stream's hot path
            if self._closed:
                raise self._refusal()
            self._queue.put((fn, args, None, name))

    def close(self) -> bool:
        """Refuse work from now on and queue the stop mark; False when it was already closed."""
        with self._lock:
            if self._closed:
                return False
            self._closed = True
            self._queue.put(None)
        return True

    def drain(self) -> None:
        """Run jobs on the calling thread until the stop mark, waiting for each (an ``Executor``'s thread)."""
        get, run, report = self._queue.get, self.run, self._report
        while True:
            job = get()
            if job is None:
                return
            fn, args, future, name = job
            if future is None:  # run() inlined for the fire-and-forget hot path
                try:
                    fn(*args)
                except BaseException as e:
                    report(fn, args, name, e)
            else:
                run(job)
            del fn, args, future  # hold nothing while waiting: a finished job's owner can be collected
            job = None

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
                if job[2] is not None:
                    job[2].cancel()
        if self._closed:
            self._queue.put(None)
        if dropped:
            logger.warning("%s: %d queued job(s) dropped unrun at close", self.owner, dropped)
        return dropped

    def run(self, job: Job) -> None:
        """Run one job here: its result or exception goes to its future; an exception is logged once."""
        fn, args, future, name = job
        if future is None:
            try:
                fn(*args)
            except BaseException as e:  # the draining thread must outlive any job
                self._report(fn, args, name, e)
            return
        if not future.set_running_or_notify_cancel():
            return  # cancelled while queued
        try:
            result = fn(*args)
        except BaseException as e:
            self._report(fn, args, name, e)
            future.set_exception(e)
        else:
            future.set_result(result)

    def _refusal(self) -> ExecutorClosed:
        return ExecutorClosed(f"{self.owner} is closed and takes no more work; {self._fix}")

    def _report(self, fn: Callable[..., Any], args: tuple[Any, ...], name: str | None, error: BaseException) -> None:
        logger.error("%s: job %s raised %s: %s", self.owner, name or describe(fn, args), type(error).__name__,
                     error, exc_info=error)
