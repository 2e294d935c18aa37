"""Streams and events for the cpu backend.

A ``WorkerStream`` is an ordered worker, like a device stream: its tasks run in submission order on an
``Executor`` of its own (``kvplane/runtime``: one daemon thread; a task that raises is logged there with its
name). What the stream adds is the device's view of that order: tickets, events and poisoning. A ``HostStream`` is the caller's own thread (cpu compute is synchronous), so work on it is done when
submitted. A failed task poisons its stream: the next ``synchronize`` or event wait raises the error instead
of hiding it or hanging.

Events are tickets, not tasks: a stream counts the steps submitted to it and the steps completed, and an
event recorded on it completes once the completed count reaches the submitted count at record time. Recording
enqueues nothing, and ``submit_parts`` runs several steps (one layer's copy each) as one task that completes
each step's event as it goes: one hand-off to the worker for a whole batch of layers.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvplane.errors import BackendError
from kvplane.runtime import Executor

DEFAULT_TIMEOUT_S = 600.0
POLL_S = 0.05  # how often a waiter re-checks its stream for a failure


class CpuEvent:
    __slots__ = ("_stream", "_ticket")

    def __init__(self, stream: WorkerStream | None = None, ticket: int = 0) -> None:
        self._stream = stream  # None: complete (never recorded, as with torch.Event, or recorded on the host)
        self._ticket = ticket

    def record(self, stream: Any = None) -> None:
        if isinstance(stream, WorkerStream):
            self._stream, self._ticket = stream, stream.submitted
        elif stream is None or isinstance(stream, HostStream):
            self._stream, self._ticket = None, 0
        else:
            raise BackendError(f"a cpu event cannot be recorded on {type(stream).__name__}")

    def query(self) -> bool:
        return self._stream is None or self._stream.reached(self._ticket)

    def synchronize(self, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        if self._stream is not None:
            self._stream.wait_for(self._ticket, timeout)

    def wait(self, stream: Any = None) -> None:
        """Make ``stream`` wait for this event (torch.Event.wait semantics)."""
        if isinstance(stream, WorkerStream):
            stream.wait_event(self)
        else:
            self.synchronize()


class WorkerStream:
    """Tasks run one after another on a dedicated daemon thread. A stream dropped without ``close`` still ends
    its thread once its queued tasks have run."""

    def __init__(self, name: str = "kvplane-cpu-stream") -> None:
        self._executor = Executor(name, fix="create a new one with backend.new_stream()")
        self._error: BaseException | None = None
        self.submitted = 0  # steps enqueued (written by the submitting thread, under the lock)
        self.completed = 0  # steps done or skipped (written by the worker, under the lock)
        self._good = 0  # steps that ran before a task failed: events past them never complete
        self._lock = threading.Lock()
        self._progress = threading.Condition(self._lock)
        self._waiting = 0  # threads in wait_for: a step completed with none of them notifies nobody
        self._closed = False

    @property
    def alive(self) -> bool:
        """Whether the stream's thread still runs (it ends once the stream is closed and drained)."""
        return self._executor.alive

    def submit(self, task: Callable[[], None]) -> None:
        self._enqueue(task, 1)

    def submit_parts(self, step: Callable[[int, int], None], bounds: Sequence[int]) -> list[CpuEvent]:
        """One task running ``step(bounds[i], bounds[i + 1])`` for each i in order; each step's event completes
        as soon as that step has run."""
        parts = len(bounds) - 1
        if parts <= 0:
            return []

        def run() -> None:
            lock, progress = self._lock, self._progress
            for i in range(parts):
                step(bounds[i], bounds[i + 1])
                with lock:  # _advance(1) inline: this runs once per layer
                    self.completed += 1
                    if self._waiting:
                        progress.notify_all()

        first = self._enqueue(run, 0, reserve=parts)
        return [CpuEvent(self, first + i + 1) for i in range(parts)]

    def wait_event(self, event: Any) -> None:
        if isinstance(event, CpuEvent) and event._stream is not None and event._stream is not self:
            self.submit(event.synchronize)

    def query(self) -> bool:
        return self.completed >= self.submitted

    def reached(self, ticket: int) -> bool:
        """Whether the first ``ticket`` steps ran (an event at ``ticket`` is complete)."""
        return self.completed >= ticket and (self._error is None or ticket <= self._good)

    def synchronize(self, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        self.wait_for(self.submitted, timeout)

    def wait_for(self, ticket: int, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        """Block until ``ticket`` steps have completed; raise if a task failed or the time ran out."""
        deadline = time.monotonic() + timeout
        with self._progress:
            while self.completed < ticket:  # after a failure the rest is skipped at once, so this ends soon
                left = deadline - time.monotonic()
                if left <= 0:
                    raise BackendError(
                        f"cpu stream: {ticket - self.completed} step(s) still pending after {timeout} s; "
                        f"a task on it is stuck"
                    )
                self._waiting += 1
                try:
                    self._progress.wait(min(POLL_S, left))
                finally:
                    self._waiting -= 1
        self.raise_if_failed()

    def close(self) -> None:
        """Run what is queued, then stop the worker thread; submitting afterwards is an error."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._executor.close()

    def raise_if_failed(self) -> None:
        if self._error is not None:
            raise BackendError(f"a task on this cpu stream failed: {self._error!r}") from self._error

    def _enqueue(self, task: Callable[[], None], steps: int, reserve: int = 0) -> int:
        """Queue ``task``; returns the submitted count before it. ``reserve`` steps are advanced by the task
        itself (``submit_parts``), ``steps`` by the worker once the task returns. Queued under the lock, so a
        task counted before ``close`` is always queued before the executor's stop mark (and runs), and tickets
        follow queue order whichever threads submit."""
        with self._lock:
            if self._closed:
                raise BackendError("this cpu stream was closed; create a new one with backend.new_stream()")
            before = self.submitted
            self.submitted += steps + reserve
            self._executor.post(self._run, task, steps + reserve)
        return before

    def _advance(self, steps: int) -> None:
        with self._lock:  # a step per layer: Condition.notify_all costs a few calls even with no one waiting
            self.completed += steps
            if self._waiting:
                self._progress.notify_all()

    def _run(self, task: Callable[[], None], steps: int) -> None:
        """On the worker: run ``task`` unless the stream failed before, then complete what it did not."""
        before = self.completed
        try:
            if self._error is None:  # once failed, later tasks are skipped, not run on bad state
                task()
        except BaseException as e:
            self._good = self.completed
            self._error = e
            raise  # the executor logs it once, naming the task
        finally:
            left = steps - (self.completed - before)  # a task of parts completed some steps itself
            if left:
                self._advance(left)
            elif self._error is not None:
                with self._progress:
                    self._progress.notify_all()


class HostStream:
    """The calling thread: work is done when it is submitted."""

    def submit(self, task: Callable[[], None]) -> None:
        task()

    def wait_event(self, event: Any) -> None:
        event.synchronize()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None
