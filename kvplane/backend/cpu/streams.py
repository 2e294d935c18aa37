"""Streams and events for the cpu backend.

A ``WorkerStream`` is an ordered worker: one thread runs submitted tasks in submission order, like a device
stream. A ``HostStream`` is the caller's own thread (cpu compute is synchronous), so work on it is done when
submitted. An event marks a point in a stream. A failed task poisons its stream: the next ``synchronize`` or
event wait raises the error instead of hiding it or hanging.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

from kvplane.errors import BackendError

DEFAULT_TIMEOUT_S = 600.0


class CpuEvent:
    def __init__(self) -> None:
        self._done = threading.Event()
        self._done.set()  # an event never recorded is complete, as with torch.Event
        self._stream: WorkerStream | None = None

    def record(self, stream: Any = None) -> None:
        if isinstance(stream, WorkerStream):
            done = threading.Event()
            self._done, self._stream = done, stream
            stream.submit(done.set)
        elif stream is None or isinstance(stream, HostStream):
            self._done, self._stream = threading.Event(), None
            self._done.set()
        else:
            raise BackendError(f"a cpu event cannot be recorded on {type(stream).__name__}")

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        stream = self._stream
        while not self._done.wait(0.05):
            if stream is not None:
                stream.raise_if_failed()
            timeout -= 0.05
            if timeout <= 0:
                raise BackendError("cpu event did not complete in time; a task on its stream is stuck")
        if stream is not None:
            stream.raise_if_failed()

    def wait(self, stream: Any = None) -> None:
        """Make ``stream`` wait for this event (torch.Event.wait semantics)."""
        if isinstance(stream, WorkerStream):
            stream.wait_event(self)
        else:
            self.synchronize()


class WorkerStream:
    """Tasks run one after another on a dedicated daemon thread."""

    def __init__(self, name: str = "kvplane-cpu-stream") -> None:
        self._queue: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._pending = 0
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, task: Callable[[], None]) -> None:
        with self._lock:
            if self._closed:
                raise BackendError("this cpu stream was closed; create a new one with backend.new_stream()")
            self._pending += 1
        self._queue.put(task)

    def wait_event(self, event: Any) -> None:
        if isinstance(event, CpuEvent) and event._stream is not self:
            self.submit(event.synchronize)

    def query(self) -> bool:
        with self._lock:
            return self._pending == 0

    def synchronize(self, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        with self._idle:
            if not self._idle.wait_for(lambda: self._pending == 0, timeout):
                raise BackendError(f"cpu stream still had {self._pending} task(s) after {timeout} s")
        self.raise_if_failed()

    def close(self) -> None:
        """Run what is queued, then stop the worker thread; submitting afterwards is an error."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._queue.put(None)
        self._thread.join()

    def raise_if_failed(self) -> None:
        if self._error is not None:
            raise BackendError(f"a task on this cpu stream failed: {self._error!r}") from self._error

    def _run(self) -> None:
        while True:
            task = self._queue.get()
            if task is None:
                return
            try:
                if self._error is None:  # once failed, later tasks are skipped, not run on bad state
                    task()
            except BaseException as e:
                self._error = e
            finally:
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()


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
