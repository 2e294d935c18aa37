"""Pages in and out of Mooncake Store through kvplane's ``StoreTier``, answered per page, never hanging.

The SGLang backend (``backend.py``) calls this with keys (``keys.py``) and host ranges (``pages.py``); it knows
nothing of SGLang. Each call is one batched store call (``batch_is_exist`` / ``batch_put_from`` /
``batch_get_into``) straight from or into the host pages SGLang registered, and its answer is one bool per page:
a page counts only when every part of it moved. A store that is down, refuses a put (a full segment) or does
not answer in its bound costs a miss or a failed write, not an exception.

A call past its bound is reported failed, but the Mooncake call may still be moving bytes. SGLang releases the
host pages of a prefetch or a backup only once the backend call returns, so before returning the call waits up
to ``late_wait_s`` more for the straggler (the tier is already off by then, so later calls do not queue behind
it); one that outlives even that is logged as an error.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

import numpy as np
import numpy.typing as npt

from kvplane.flows.offload.store import StoreTier, StoreWrite, leading
from kvplane.integrations.sglang.pages import PageSpans, inside

logger = logging.getLogger("kvplane.sglang")

Bools = npt.NDArray[np.bool_]


class PageStore:
    def __init__(self, tier: StoreTier, late_wait_s: float) -> None:
        self.tier = tier
        self.late_wait_s = late_wait_s
        self._ranges: list[tuple[int, int]] = []  # host memory registered with the tier: (start, nbytes)
        self._lock = threading.Lock()

    # -- memory -------------------------------------------------------------------------------------------
    def register(self, buffers: Iterable[tuple[int, int]]) -> None:
        """Register host buffers ``(start, nbytes)``: adjacent ones as one range, ones already inside a
        registered range not again (Mooncake refuses an overlapping registration)."""
        with self._lock:
            for start, nbytes in _merged(buffers):
                if any(s <= start and start + nbytes <= s + n for s, n in self._ranges):
                    continue
                if any(start < s + n and s < start + nbytes for s, n in self._ranges):
                    logger.error("host buffer %#x+%d overlaps one registered before; its pages will not be moved",
                                 start, nbytes)
                    continue
                self._ranges.append((start, nbytes))
                self.tier.register(start, nbytes)

    def covers(self, spans: PageSpans) -> bool:
        """Whether every span lies in registered host memory (anything else is refused, never moved)."""
        return inside(self._ranges, spans)

    # -- calls --------------------------------------------------------------------------------------------
    def found(self, keys: list[str], parts: int) -> Bools:
        """Which pages the store holds whole (every part); none when the store is down or slow."""
        pages = len(keys) // parts if parts else 0
        held = self.tier.exists(keys) if keys else None
        if held is None:
            return np.zeros(pages, dtype=bool)
        return np.asarray(np.asarray(held, dtype=bool).reshape(pages, parts).all(axis=1), dtype=bool)

    def leading(self, keys: list[str], parts: int) -> int:
        """How many leading pages the store holds whole."""
        return leading(self.found(keys, parts).tolist()) if keys else 0

    def put(self, keys: list[str], spans: PageSpans) -> list[bool]:
        """Put the pages at ``spans`` under ``keys`` (parts the store holds already are not moved again); True
        per stored page."""
        pages = spans.addrs.shape[0]
        if not self.covers(spans):
            logger.error("refusing to put %d page(s): their host ranges are not in registered host memory", pages)
            return [False] * pages
        codes = self._put(keys, spans.addrs.ravel(), spans.sizes.ravel())  # parts the store holds answer 0
        return [False] * pages if codes is None else _per_page(codes == 0, pages)

    def _put(self, keys: list[str], addrs: npt.NDArray[np.int64],
             sizes: npt.NDArray[np.int64]) -> npt.NDArray[np.int64] | None:
        nbytes = int(sizes.sum())
        future = self.tier.put(keys, addrs.tolist(), sizes.tolist(), missing_only=True)
        if future is None:
            return None
        write = StoreWrite(future, self.tier.put_deadline(nbytes), 0, None, nbytes)
        if not self._settle(future, write.deadline - time.monotonic(), "put"):
            self.tier.check_put(write)  # past its deadline: turns the tier off
            if not self._settle(future, self.late_wait_s, "put"):
                logger.error("a put of %d B still runs %.0f s past its bound; SGLang may reuse its host pages",
                             nbytes, self.late_wait_s)
                return None
        self.tier.check_put(write)  # counts refusals, turns the tier off when the master did not answer
        if future.exception() is not None:
            return None
        return np.asarray(future.result(), dtype=np.int64)

    def get(self, keys: list[str], spans: PageSpans) -> list[bool]:
        """Get the pages under ``keys`` into ``spans``; True per page whose every part arrived whole."""
        pages = spans.addrs.shape[0]
        if not self.covers(spans):
            logger.error("refusing to get %d page(s): their host ranges are not in registered host memory", pages)
            return [False] * pages
        ok, future = self.tier.get(keys, spans.addrs.ravel().tolist(), spans.sizes.ravel().tolist())
        if future is not None and not future.done() and not self._settle(future, self.late_wait_s, "get"):
            logger.error("a get into %d page(s) still runs %.0f s past its bound; SGLang may reuse its host pages",
                         pages, self.late_wait_s)
        return _per_page(np.asarray(ok, dtype=bool), pages)

    @staticmethod
    def _settle(future: Future[list[int]], seconds: float, what: str) -> bool:
        """Whether ``future`` finished (well or not) within ``seconds``."""
        try:
            future.result(max(0.0, seconds))
        except FutureTimeout:
            return False
        except Exception as e:  # the tier's executor logged it; the page fails
            logger.debug("store %s raised %r", what, e)
        return True


def _per_page(done: Bools, pages: int) -> list[bool]:
    """One bool per page from one per part: a page counts only when all of its parts do."""
    whole: Bools = np.asarray(done.reshape(pages, -1).all(axis=1), dtype=bool)
    return [bool(b) for b in whole]


def _merged(buffers: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """``(start, nbytes)`` ranges with adjacent or overlapping ones joined."""
    merged: list[tuple[int, int]] = []
    for start, nbytes in sorted((int(s), int(n)) for s, n in buffers if n > 0):
        if merged and start <= merged[-1][0] + merged[-1][1]:
            s, n = merged[-1]
            merged[-1] = (s, max(s + n, start + nbytes) - s)
        else:
            merged.append((start, nbytes))
    return merged
