"""``TierEvents``: the worker half's ``TierListener``: what kvplane's tiers did, as vLLM's KV events.

The offload engine calls it on the worker's thread under the worker's lock (``flows/offload/listener.py``): each
call turns host block ids into the vLLM hashes the scheduler half sent with the store (``BlockJob.tags``),
kept per host block while it is cached, and queues one event, never waiting on anything. vLLM's model runner
takes the queue every step (``take``); if nothing takes it, it keeps the newest ``limit`` events, counts the
ones it drops in ``dropped`` and says so once.

What is announced, and when: ``BlockStored`` CPU once a store's copy completed and the block is keyed (a
lookup finds it); ``BlockRemoved`` CPU just before its host block is reused; ``BlockStored`` MOONCAKE once the
store answered the block's put with success (each block is its own object, loadable alone); ``BlockRemoved``
MOONCAKE when a load's get found no object under the key (Mooncake evicts without telling its clients, so
that is the first kvplane knows of it). A failed or refused save announces nothing. Blocks brought back from
the store into the host tier are not announced as CPU (their vLLM hash is not known on that path).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from kvplane.blocks.groups import Ids
from kvplane.flows.offload.listener import Tags
from kvplane.integrations.vllm.events import HOST_MEDIUM, STORE_MEDIUM, block_removed, block_stored
from kvplane.integrations.vllm.metadata import BlockJob

logger = logging.getLogger("kvplane.vllm")
EVENTS_LIMIT = 10_000  # events kept for vLLM to take; the oldest go first


class TierEvents:
    def __init__(self, host_blocks: Mapping[int, int], before: TierEvents | None = None,
                 limit: int = EVENTS_LIMIT) -> None:
        """``before``: the events of a host tier this one replaces (sleep mode), not yet taken: they go on."""
        # each group's host blocks: the vLLM hash of the prefix a block caches, None while it caches none known
        self._hash = {g: np.full(n, None, dtype=object) for g, n in host_blocks.items()}
        self._queue: deque[Any] = before._queue if before is not None else deque()
        self.limit = limit
        self.dropped: int = before.dropped if before is not None else 0
        self._loads: list[BlockJob] = []  # this step's loads, read only when a get finds an object gone

    @classmethod
    def over(cls, pools: Mapping[int, Any], before: TierEvents | None = None) -> TierEvents:
        """Events for the host index's ``pools`` (group -> its ``KeyedPool``)."""
        return cls({g: int(pool.num_blocks) for g, pool in pools.items()}, before)

    # -- TierListener -------------------------------------------------------------------------------------
    def host_cached(self, group: int, host_ids: Ids, tags: Tags | None) -> None:
        column = self._hash[group]
        column[host_ids] = tags if tags is not None else None
        if tags is not None:
            self._put(block_stored, _known(tags), HOST_MEDIUM, group)

    def host_evicted(self, group: int, host_ids: Ids) -> None:
        column = self._hash[group]
        hashes = _known(column[host_ids])
        column[host_ids] = None
        self._put(block_removed, hashes, HOST_MEDIUM, group)

    def store_written(self, group: int, host_ids: Ids) -> None:
        self._put(block_stored, _known(self._hash[group][host_ids]), STORE_MEDIUM, group)

    def store_missing(self, group: int, hashes: list[Any]) -> None:
        tag = {h: t for job in self._loads if job.tags for h, t in zip(job.hashes.get(group, ()),
                                                                      job.tags.get(group, ()))}
        known = [tag.get(int(h)) for h in hashes]
        self._put(block_removed, [h for h in known if h is not None], STORE_MEDIUM, group)

    # -- the worker half ----------------------------------------------------------------------------------
    def expect_loads(self, loads: Iterable[BlockJob]) -> None:
        """This step's loads, whose vLLM hashes ``store_missing`` looks up (no work per block on the step)."""
        self._loads = list(loads)

    def host_cleared(self) -> None:
        """The host tier closed (its contents gone): every block it announced is removed."""
        for g, column in self._hash.items():
            self.host_evicted(g, np.flatnonzero(column != None))  # noqa: E711 (elementwise, on objects)

    def take(self) -> list[Any]:
        out = list(self._queue)
        self._queue.clear()
        return out

    def _put(self, build: Any, hashes: list[Any], medium: str, group: int) -> None:
        if not hashes:
            return
        if len(self._queue) >= self.limit:
            self._queue.popleft()
            self.dropped += 1
            if self.dropped == 1:
                logger.warning("kvplane: %d KV events are waiting for vLLM to take them; dropping the oldest from "
                               "now on (vLLM takes them each step through get_kv_connector_kv_cache_events)",
                               self.limit)
        self._queue.append(build(hashes, medium, group))


def _known(hashes: Any) -> list[Any]:
    return [h for h in hashes.tolist() if h is not None]
