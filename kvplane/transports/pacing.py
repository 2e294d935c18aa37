"""When to start waiting on an engine whose status call spins: Mooncake's.

Mooncake's Python binding waits for a batch by calling the engine's status in a loop without sleeping
(``get_batch_transfer_status`` and ``batch_transfer_sync`` in ``transfer_engine_py.cpp``): the waiting thread
holds a whole core for as long as the batch moves. The batch moves on Mooncake's own worker threads whether or
not anyone waits, so a waiter that sleeps through most of the expected time and only then calls the status
leaves that core to the engine's workers, the peer and the inference engine.

``Pace`` learns how fast batches to a peer move, per descriptor size class (a batch of many small descriptors
moves slower than one of few large ones), and says how long to sleep before a batch's status call: ``SHARE``
of its expected time. Sleeping too little only spins, sleeping too long delays the request, so the estimate
leans fast: the best rate among the last ``KEPT`` batches that took at least ``MIN_LEARN_S`` (shorter ones are
mostly fixed costs). A class or peer not seen yet gets no sleep. A batch that ends while the waiter sleeps
shows a rate above the estimate (bytes over the sleep), so the estimate climbs when the link gets faster.
"""

from __future__ import annotations

import threading
from collections import deque

SHARE = 0.75  # of a batch's expected time slept before its status call
MIN_SLEEP_S = 0.002  # shorter sleeps are not worth the wake-up
MIN_LEARN_S = 0.005  # batches shorter than this do not teach a rate
KEPT = 8  # batches remembered per peer and size class

Key = tuple[str, int]  # (peer, size class: bit length of the mean descriptor's bytes)


def _key(peer: str, nbytes: int, descriptors: int) -> Key:
    return peer, (nbytes // max(descriptors, 1)).bit_length()


class Pace:
    def __init__(self) -> None:
        self._rates: dict[Key, deque[float]] = {}  # bytes per second of the last batches
        self._lock = threading.Lock()

    def head_start_s(self, peer: str, nbytes: int, descriptors: int) -> float:
        """Seconds to sleep after submitting a batch to ``peer``, before calling its status."""
        with self._lock:
            seen = self._rates.get(_key(peer, nbytes, descriptors))
            rate = max(seen) if seen else 0.0
        if rate <= 0:
            return 0.0
        sleep_s = SHARE * nbytes / rate
        return sleep_s if sleep_s >= MIN_SLEEP_S else 0.0

    def observe(self, peer: str, nbytes: int, descriptors: int, seconds: float) -> None:
        """A batch to ``peer`` completed ``seconds`` after it was submitted."""
        if nbytes <= 0 or seconds < MIN_LEARN_S:
            return
        with self._lock:
            self._rates.setdefault(_key(peer, nbytes, descriptors), deque(maxlen=KEPT)).append(nbytes / seconds)

    def forget(self) -> None:
        """The engine was replaced: what it showed says nothing of the new one."""
        with self._lock:
            self._rates.clear()
