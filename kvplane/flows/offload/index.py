"""Which host block holds which prefix: one kvplane ``BlockPool`` per KV-cache group, keyed by prefix hash.

A host block is free, referenced (being stored, loaded, or written to the store: never evicted), or cached
(keyed by its prefix hash, evictable least recently used first). ``lookup`` only reads. ``allocate`` hands
out at most what is free or evictable, never raising for a full pool: a cache stores what fits. Every block
it evicts was shown to ``before_evict`` first (the store tier writes them back, and keeps referenced those
whose write is still in flight; the allocation then shows the next oldest, never evicting one unseen).
Pure bookkeeping: no memory, no device; every call is array work over the request's
blocks (``KeyedPool``: ``BlockPool`` with its prefix keys in an int64 table), with no Python statement per
block. Hashes may come as a list or an int64 array; the engine converts a request's list once and passes the
array on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import numpy as np
import numpy.typing as npt

from kvplane.blocks.groups import Ids
from kvplane.errors import BlockError
from kvplane.flows.offload.keyed_pool import KeyedPool
from kvplane.flows.offload.listener import TierListener

EvictHook = Callable[[int, Ids, Ids], None]  # (group, victim block ids, their prefix hashes), int64 arrays


class HostIndex:
    def __init__(self, groups: Iterable[int], num_blocks: int) -> None:
        self.pools: dict[int, KeyedPool] = {g: KeyedPool(num_blocks) for g in groups}
        self.listener: TierListener | None = None  # told which cached blocks an allocation evicts

    # -- queries (no side effects) ------------------------------------------------------------------------
    def cached_prefix(self, group: int, hashes: Sequence[int] | Ids) -> int:
        """How many leading ``hashes`` the host tier holds."""
        return self.pools[group].find(hashes)[2]

    def blocks_of(self, group: int, hashes: Sequence[int] | Ids) -> Ids:
        """The host block caching each hash, -1 where none does (no side effects)."""
        return self.pools[group].blocks_of(hashes)

    def find(self, group: int, hashes: Sequence[int] | Ids) -> tuple[Ids, int, int]:
        """``blocks_of``, with how many were found and the index of the first not found (or the count)."""
        return self.pools[group].find(hashes)

    def block_of(self, group: int, block_hash: int) -> int | None:
        return self.pools[group].lookup(block_hash)

    def num_referenced(self) -> int:
        return sum(p.num_referenced for p in self.pools.values())

    # -- state changes ------------------------------------------------------------------------------------
    def pin(self, group: int, hashes: Sequence[int] | Ids) -> Ids:
        """Reference the cached blocks of ``hashes`` (all must be cached): they cannot be evicted until released."""
        pool = self.pools[group]
        ids = pool.blocks_of(hashes)
        if ids.size and int(ids.min()) < 0:
            raise BlockError(f"hash {hashes[int(np.argmin(ids))]:#x} is not cached; pin only what lookup found")
        pool.ref(ids)
        return ids

    def allocate(self, group: int, n: int, before_evict: EvictHook | None = None) -> Ids:
        """Up to ``n`` blocks with refcount 1: unused ones first, then the least recently used cached ones.

        ``before_evict`` sees every victim before it goes, each once. It may reference some (a write-back in
        flight): those stay cached, and the blocks that take their place are shown to it in turn, one array
        call per round (one round; another after each round whose hook left a write-back in flight)."""
        pool = self.pools[group]
        shown: Ids | None = None
        while before_evict is not None:
            free, unused = pool.counts()
            to_evict = min(n, free) - unused
            if to_evict <= 0:
                break
            victims = pool.oldest_array(to_evict)
            if shown is not None:  # still evictable from an earlier round: shown already
                victims = victims[~np.isin(victims, shown)]
            if not victims.size:
                break
            before_evict(group, victims, pool.keys_of(victims))
            shown = victims if shown is None else np.concatenate((shown, victims))
        if self.listener is not None:  # the unused blocks go first, then the oldest cached ones, in order
            free, unused = pool.counts()
            evicted = pool.oldest_array(min(n, free) - unused) if min(n, free) > unused else None
            if evicted is not None and evicted.size:
                self.listener.host_evicted(group, evicted)
        return pool.allocate_upto(n)

    def ref(self, group: int, ids: Ids) -> None:
        self.pools[group].ref(ids)

    def cache(self, group: int, ids: Ids, hashes: Sequence[int] | Ids) -> npt.NDArray[np.bool_]:
        """Key filled blocks by their hashes; False where another block already holds that prefix."""
        return self.pools[group].cache_many(ids, hashes)

    def release(self, group: int, ids: Ids) -> None:
        """Drop one reference each: keyed blocks become evictable, unkeyed ones free."""
        if len(ids):
            self.pools[group].unref(ids)
