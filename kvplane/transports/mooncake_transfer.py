"""One plan in flight through Mooncake: a worker thread walks its chunks, retrying each with back-off.

``MooncakeTransport.submit`` creates and starts it, handing it what it needs: the transport's config (retries,
back-off) and ``move``, one engine batch to the peer; the transfer knows nothing else of the transport. Callers
only see ``poll``/``wait``. The thread exists because Mooncake's binding offers no non-blocking status for a
batch; it blocks in C++ with the GIL released.

A batch whose status call failed may still be moving: Mooncake's status gives up at its own timeout while the
slices stay queued on their TCP session, and a link that comes back resumes them. Such a transfer ends
unsettled (``settled`` False), even when a retry then succeeded, until the transport resets the engine.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from kvplane.errors import TransferFailed, TransferTimeout, TransportError
from kvplane.transports.base import TransportConfig
from kvplane.transports.batching import backoff_s
from kvplane.transports.chunked import ChunkedTransfer, Job

# one engine batch to the peer: (local, remote, lengths, notify) -> 0 when every descriptor landed,
# NOT_SUBMITTED when nothing reached the engine, anything else when the engine failed it (it may still move)
NOT_SUBMITTED = -2
MoveBatch = Callable[[list[int], list[int], list[int], "bytes | None"], int]


class MooncakeTransfer(ChunkedTransfer):
    engine = "mooncake"

    def __init__(self, move: MoveBatch, config: TransportConfig, job: Job) -> None:
        super().__init__(config, job)
        self._move = move
        self._cancelled = threading.Event()
        self._done = threading.Event()
        self._wake: Callable[[], None] | None = None  # call_when_done's, run as _done is set
        self._wake_lock = threading.Lock()
        # _unsettled: an engine batch failed, its slices may still be queued in the engine
        self._engine_gone = False
        self._thread = threading.Thread(target=self._run, name=f"kvplane-mooncake-{job.op.lower()}", daemon=True)

    # -- caller side --------------------------------------------------------------------------------------
    def start(self) -> None:
        if not self._chunks:
            self._finish()
            return
        self._thread.start()

    @property
    def finished(self) -> bool:
        return self._done.is_set()

    @property
    def settled(self) -> bool:
        return self._done.is_set() and (not self._unsettled or self._engine_gone)

    def engine_reset(self) -> None:
        """The transport tore the engine down after this transfer's thread ended: nothing of it can move."""
        self._engine_gone = True

    def poll(self) -> bool:
        if not self._done.is_set():
            return False
        if self._error is not None:
            raise self._error
        return True

    def wait(self, timeout_s: float | None = None) -> None:
        limit = self._limit_s(timeout_s)
        if not self._done.wait(limit):
            self.cancel()
            raise self._timed_out(limit)
        self.poll()

    def cancel(self) -> None:
        """Stop after the engine call in flight; Mooncake cannot abort a batch it has started."""
        self._cancelled.set()

    def call_when_done(self, wake: Callable[[], None]) -> bool:
        with self._wake_lock:
            if not self._done.is_set():
                self._wake = wake
                return True
        wake()
        return True

    def join(self, timeout_s: float) -> bool:
        return self._done.wait(timeout_s)

    # -- worker side --------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            last = len(self._chunks) - 1
            for index, (start, stop) in enumerate(self._chunks):
                self._index = index
                self._move_chunk(start, stop, self._notify if index == last else None)
        except TransportError as e:
            self._error = e
        except Exception as e:  # the binding raised (bad argument, engine torn down): never lose it
            self._error = TransferFailed(f"mooncake {self._op} with {self._peer}: engine raised {e!r}")
        finally:
            self._finish()

    def _finish(self) -> None:
        with self._wake_lock:
            self._done.set()
            wake, self._wake = self._wake, None
        if wake is not None:
            wake()

    def _move_chunk(self, start: int, stop: int, notify: bytes | None) -> None:
        local = self._local[start:stop].tolist()
        remote = self._remote[start:stop].tolist()
        lengths = self._length[start:stop].tolist()
        config = self._config
        rc = 0
        for attempt in range(config.retries + 1):
            if self._cancelled.is_set() or self._deadline.expired():
                raise TransferTimeout(self._where(f"deadline passed before attempt {attempt + 1}"))
            rc = self._move(local, remote, lengths, notify)
            if rc == 0:
                return
            if rc != NOT_SUBMITTED:
                self._unsettled = True
            if attempt < config.retries:
                pause = min(backoff_s(config, attempt), self._deadline.remaining())
                if self._cancelled.wait(pause):
                    raise TransferTimeout(self._where("cancelled while backing off"))
        raise TransferFailed(
            self._where(f"failed {config.retries + 1} times (last rc={rc})")
            + "; the peer may be gone, or an address lies outside its registered memory"
        )
