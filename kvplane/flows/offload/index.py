"""Which host block holds which prefix: one kvplane ``BlockPool`` per KV-cache group, keyed by prefix hash.

A host block is free, referenced (being stored, loaded, or written to the store: never evicted), or cached
(keyed by its prefix hash, evictable least recently used first). ``lookup`` only reads. ``allocate`` hands
out at most what is free or evictable, never raising for a full pool: a cache stores what fits. Before it
evicts, it shows the victims to ``before_evict`` (the store tier writes them back, and may pin some while
that write is in flight). Pure bookkeeping: no memory, no device.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import numpy.typing as npt

from kvplane.blocks.groups import Ids
from kvplane.blocks.pool import BlockPool
from kvplane.errors import BlockError

EvictHook = Callable[[int, list[int], list[int]], None]  # (group, victim block ids, their prefix hashes)


class _LruPool(BlockPool):
    """A ``BlockPool`` that also shows its eviction order, which the base class keeps to itself."""

    def oldest_cached(self, n: int) -> list[int]:
        return list(itertools.islice(self._lru, n))

    def cache_many(self, block_ids: Ids, hashes: Sequence[int]) -> npt.NDArray[np.bool_]:
        """``cache`` for many blocks in order, with the range and refcount checks done once on the array.

        What is left per block is a few dict operations (the prefix map is a dict): no numpy call per block.
        """
        ids = self._checked(block_ids)
        idle = ids[self._refs[ids] == 0]
        if idle.size:
            raise BlockError(f"block {int(idle[0])} is not referenced; only a block being filled can be cached")
        block_of, hash_of = self._block_of, self._hash_of
        out = np.ones(ids.size, dtype=np.bool_)
        for i, (b, h) in enumerate(zip(ids.tolist(), hashes)):
            holder = block_of.get(h)
            if holder is not None:
                out[i] = holder == b
                continue
            old = hash_of.pop(b, None)
            if old is not None:
                del block_of[old]
            hash_of[b] = h
            block_of[h] = b
        return out

    def blocks_of(self, hashes: Sequence[int]) -> Ids:
        """The block caching each hash, -1 where none does (no side effects)."""
        get = self._block_of.get
        return np.array([get(h, -1) for h in hashes], dtype=np.int64)

    @property
    def num_unused(self) -> int:
        """Blocks holding nothing (taken before any cached block is evicted)."""
        return len(self._free)


class HostIndex:
    def __init__(self, groups: Iterable[int], num_blocks: int) -> None:
        self.pools: dict[int, _LruPool] = {g: _LruPool(num_blocks) for g in groups}

    # -- queries (no side effects) ------------------------------------------------------------------------
    def cached_prefix(self, group: int, hashes: Sequence[int]) -> int:
        """How many leading ``hashes`` the host tier holds."""
        missing = np.flatnonzero(self.pools[group].blocks_of(hashes) < 0)
        return int(missing[0]) if missing.size else len(hashes)

    def blocks_of(self, group: int, hashes: Sequence[int]) -> Ids:
        """The host block caching each hash, -1 where none does (no side effects)."""
        return self.pools[group].blocks_of(hashes)

    def block_of(self, group: int, block_hash: int) -> int | None:
        return self.pools[group].lookup(block_hash)

    def num_referenced(self) -> int:
        return sum(p.num_referenced for p in self.pools.values())

    # -- state changes ------------------------------------------------------------------------------------
    def pin(self, group: int, hashes: Sequence[int]) -> Ids:
        """Reference the cached blocks of ``hashes`` (all must be cached): they cannot be evicted until released."""
        pool = self.pools[group]
        ids = pool.blocks_of(hashes)
        if ids.size and int(ids.min()) < 0:
            raise BlockError(f"hash {hashes[int(np.argmin(ids))]:#x} is not cached; pin only what lookup found")
        pool.ref(ids)
        return ids

    def allocate(self, group: int, n: int, before_evict: EvictHook | None = None) -> Ids:
        """Up to ``n`` blocks with refcount 1: unused ones first, then the least recently used cached ones."""
        pool = self.pools[group]
        to_evict = max(0, min(n, pool.num_free) - pool.num_unused)
        if to_evict and before_evict is not None:
            victims = pool.oldest_cached(to_evict)
            before_evict(group, victims, [int(pool.hash_of(b) or 0) for b in victims])
        return np.asarray(pool.allocate(min(n, pool.num_free)), dtype=np.int64)

    def ref(self, group: int, ids: Ids) -> None:
        self.pools[group].ref(ids)

    def cache(self, group: int, ids: Ids, hashes: Sequence[int]) -> npt.NDArray[np.bool_]:
        """Key filled blocks by their hashes; False where another block already holds that prefix."""
        return self.pools[group].cache_many(ids, [int(h) for h in hashes])

    def release(self, group: int, ids: Ids) -> None:
        """Drop one reference each: keyed blocks become evictable, unkeyed ones free."""
        if len(ids):
            self.pools[group].unref(ids)
