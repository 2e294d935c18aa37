"""``Recorder``: where kvplane's flows count and time what they do, once per transfer or request.

There is one per process (``recorder()``), like ``prometheus_client``'s default registry: the flows call it in one
line wherever a transfer or a request ends, without being handed anything. It records nothing until a consumer
``enable``s it (the vLLM worker connector, a ``MetricsServer``), so an engine that exports no metrics pays one
attribute check per call. Observations wait in lists until ``take`` hands them out; a consumer takes them every
step (vLLM) or every scrape, and ``MAX_OBSERVATIONS`` bounds them if it stops. Gauges are read, not pushed:
``watch`` registers an object and a function that reads it, called only when a consumer takes a payload.
Thread-safe: transfers end on transfer threads, I/O loops and the engine's thread.
"""

from __future__ import annotations

import os
import re
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from kvplane.metrics import payload
from kvplane.metrics.names import DROPPED_OBSERVATIONS, FAILURES, LEASES_EXPIRED, OFFLOAD_HIT, OFFLOAD_QUERIED

E = TypeVar("E", bound=BaseException)
Gauge = tuple[str, tuple[str, ...], float]  # metric name, label values, value
Reader = Callable[[Any], Iterable[Gauge]]
MAX_OBSERVATIONS = 100_000  # per flow|transport|direction between two takes; more are dropped (and counted)
STORE_TRANSPORT = "mooncake_store"


def cause_of(error: BaseException) -> str:
    """A failure cause label from an exception's class: ``TransferTimeout`` -> ``transfer_timeout``."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", type(error).__name__).lower()


class Recorder:
    def __init__(self, source: str | None = None) -> None:
        self.source = source or str(os.getpid())
        self.enabled = False
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}
        self._transfers: dict[str, list[list[float]]] = {}
        self._totals: dict[str, int] = {}  # bytes per flow|transport|direction since the start, never taken
        self._watched: list[tuple[weakref.ref[Any], Reader]] = []

    def enable(self) -> None:
        self.enabled = True

    def disable(self) -> None:
        """Record nothing from now on, and drop what no consumer took (totals and watched objects stay)."""
        with self._lock:
            self.enabled = False
            self._counts, self._transfers = {}, {}

    # -- recording (any thread) ---------------------------------------------------------------------------
    def transfer(self, flow: str, transport: str, direction: str, nbytes: int, seconds: float) -> None:
        """One completed transfer of ``nbytes`` that took ``seconds`` (submit to seen complete)."""
        if not self.enabled:
            return
        k = payload.key(flow, transport, direction)
        with self._lock:
            self._totals[k] = self._totals.get(k, 0) + int(nbytes)
            observations = self._transfers.setdefault(k, [])
            if len(observations) < MAX_OBSERVATIONS:
                observations.append([int(nbytes), float(seconds)])
            else:
                self._add(DROPPED_OBSERVATIONS.name, 1)

    def count(self, name: str, *labels: str, n: int = 1) -> None:
        if self.enabled and n:
            with self._lock:
                self._add(payload.key(name, *labels), n)

    def _add(self, k: str, n: int) -> None:
        self._counts[k] = self._counts.get(k, 0) + n

    def failure(self, flow: str, cause: str) -> None:
        self.count(FAILURES.name, flow, cause)

    def lease_expired(self) -> None:
        self.count(LEASES_EXPIRED.name)

    def request_ended(self, flow: str, state: str) -> None:
        """A P/D request ended ``done``, ``failed`` or ``timed_out``: the last two count as failures."""
        if state != "done":
            self.failure(flow, f"request_{state}")

    def lookup(self, queried_tokens: int, hit_tokens: int) -> None:
        """An offload lookup: ``hit_tokens`` of ``queried_tokens`` found in the host or store tier."""
        if self.enabled:
            with self._lock:
                self._add(OFFLOAD_QUERIED.name, int(queried_tokens))
                self._add(OFFLOAD_HIT.name, int(hit_tokens))

    def timed(self, flow: str, transport: str, direction: str, nbytes: int,
              callback: Callable[[E | None], None]) -> Callable[[E | None], None]:
        """``callback`` wrapped to record the transfer (or its failure, by the error's class) when it is called
        with ``None`` (success) or the error; the clock starts now."""
        if not self.enabled or not nbytes:  # an empty plan moves nothing: not a transfer
            return callback
        started = time.monotonic()

        def ended(error: E | None) -> None:
            if error is None:
                self.transfer(flow, transport, direction, nbytes, time.monotonic() - started)
            else:
                self.failure(flow, cause_of(error))
            callback(error)

        return ended

    def store_call(self, direction: str, sizes: Sequence[int], call: Callable[[], list[int]]) -> Callable[[], list[int]]:
        """A Mooncake Store batch call (``write``: put, ``read``: get) wrapped to record the bytes of the keys it
        moved (put: return code 0; get: the object's size), its duration, and each failed key by return code."""
        if not self.enabled:
            return call

        def timed_call() -> list[int]:
            started = time.monotonic()
            try:
                codes = call()
            except Exception as e:
                self.failure("store", cause_of(e))
                raise
            good = [rc == 0 if direction == "write" else rc == size for rc, size in zip(codes, sizes)]
            moved = sum(size for ok, size in zip(good, sizes) if ok)
            if moved:
                self.transfer("store", STORE_TRANSPORT, direction, moved, time.monotonic() - started)
            for rc, ok in zip(codes, good):
                if not ok:
                    self.failure("store", f"{direction}_rc{rc}")
            return codes

        return timed_call

    def total_bytes(self, flow: str, transport: str, direction: str) -> int:
        """Bytes recorded for this flow, transport and direction since the recorder was enabled."""
        with self._lock:
            return self._totals.get(payload.key(flow, transport, direction), 0)

    # -- gauges -------------------------------------------------------------------------------------------
    def watch(self, obj: Any, read: Reader) -> None:
        """Read gauges from ``obj`` with ``read(obj)`` at every take, for as long as ``obj`` lives."""
        with self._lock:
            self._watched = [(ref, r) for ref, r in self._watched if ref() is not None]
            self._watched.append((weakref.ref(obj), read))

    def gauges(self) -> dict[str, float]:
        """``source|name|labels`` -> value, summed over the objects watched now (a read that fails is skipped)."""
        with self._lock:
            watched = [(ref(), read) for ref, read in self._watched]
        out: dict[str, float] = {}
        for obj, read in watched:
            if obj is None:
                continue
            try:
                for name, labels, value in read(obj):
                    k = payload.key(self.source, name, *labels)
                    out[k] = out.get(k, 0.0) + float(value)
            except Exception:  # a closed side or engine: no gauges from it
                continue
        return out

    # -- consuming ----------------------------------------------------------------------------------------
    def take(self) -> payload.Payload:
        """Counts and observations since the last take (handed over, then cleared), and the gauges now."""
        with self._lock:
            counts, self._counts = self._counts, {}
            transfers, self._transfers = self._transfers, {}
        return {"counts": counts, "transfers": transfers, "gauges": self.gauges()}


_RECORDER = Recorder()


def recorder() -> Recorder:
    """This process's recorder."""
    return _RECORDER
