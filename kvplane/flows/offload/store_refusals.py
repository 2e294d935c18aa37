"""Puts the store refuses (a full segment): counted by return code and logged once per stretch, not once each.

Under write-through a full segment refuses nearly every put, and a warning per put would flood the log. A
``RefusalLog`` writes one line when a stretch of refusals starts, one per ``every_s`` while it goes on (what
was refused since the last line), and one when puts are taken again with none refused for that long. Its
``refused`` counter is ``StoreTier.refused``.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Sequence

from kvplane.flows.offload.config import StoreConfig
from kvplane.flows.offload.store_client import NO_AVAILABLE_HANDLE

logger = logging.getLogger("kvplane.offload.store")

REFUSAL_LOG_EVERY_S = 60.0  # while puts keep being refused, one summary line per this many seconds


class RefusalLog:
    def __init__(self, config: StoreConfig) -> None:
        self.config = config
        # puts the store refused, by Mooncake return code (NO_AVAILABLE_HANDLE: no segment had room), since start
        self.refused: Counter[int] = Counter()
        self.every_s = REFUSAL_LOG_EVERY_S
        self._refusing_since: float | None = None  # the first refusal of the stretch now running
        self._refusal_logged_at = self._last_refusal = 0.0
        self._refused_unlogged: Counter[int] = Counter()  # refused since the stretch's last line
        self._refused_in_stretch = 0

    def _hint(self, refused: Counter[int]) -> str:
        if NO_AVAILABLE_HANDLE in refused:
            return (f"{NO_AVAILABLE_HANDLE} means no segment has room: raise StoreConfig.segment_bytes="
                    f"{self.config.segment_bytes} or start more clients that lend memory (right after a master "
                    "restart it means the clients have not yet mounted their segments again: that passes by itself)")
        return "see Mooncake's log for what the codes mean"

    def note(self, codes: Sequence[int]) -> None:
        """Count refused puts and log them once per stretch: its first refusal, then one line per
        ``every_s`` while they go on, and one when a put is taken with none refused for that long.
        A full segment under write-through refuses nearly every put (the master's eviction frees a few objects
        now and then, so taken puts come in between: they do not end the stretch)."""
        refused = Counter(rc for rc in codes if rc < 0)
        now = time.monotonic()
        every = self.every_s
        if not refused:
            if self._refusing_since is not None and codes and now - self._last_refusal >= every:
                logger.warning("Mooncake store at %s takes puts again (none refused for %g s), after refusing %d in "
                               "%.1f s", self.config.master_address, every, self._refused_in_stretch,
                               self._last_refusal - self._refusing_since)
                self._refusing_since = None
            return
        self.refused.update(refused)
        self._last_refusal = now
        if self._refusing_since is None:
            self._refusing_since, self._refusal_logged_at = now, now
            self._refused_in_stretch, self._refused_unlogged = refused.total(), Counter()
            logger.warning(
                "Mooncake store at %s refused %d put(s) (codes %s); those blocks stay host-only. Further refusals "
                "are counted (StoreTier.refused) and logged every %g s until puts are taken again; %s",
                self.config.master_address, refused.total(), _codes(refused), every, self._hint(refused),
            )
            return
        self._refused_in_stretch += refused.total()
        self._refused_unlogged.update(refused)
        if now - self._refusal_logged_at >= every:
            logger.warning("Mooncake store at %s refused %d more put(s) in the last %.0f s (codes %s); %s",
                           self.config.master_address, self._refused_unlogged.total(), now - self._refusal_logged_at,
                           _codes(self._refused_unlogged), self._hint(self._refused_unlogged))
            self._refusal_logged_at, self._refused_unlogged = now, Counter()


def _codes(refused: Counter[int]) -> str:
    return ", ".join(f"{rc} x{n}" for rc, n in sorted(refused.items()))
