"""The block pool: a free list, refcounts, and an LRU of unreferenced blocks that still hold a cached prefix.

Every block is in exactly one state: free (no data worth keeping), referenced (refcount > 0), or cached
(refcount 0, keyed by a prefix hash, evictable oldest first). Misuse raises ``BlockError`` and changes
nothing: a failed call never half-applies, and nothing is silently clamped.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable

import numpy as np
import numpy.typing as npt

from kvplane.errors import BlockError, PoolExhausted


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise BlockError(f"num_blocks={num_blocks} must be >= 1")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = np.zeros(num_blocks, dtype=np.int64)
        self._hash_of: dict[int, int] = {}
        self._block_of: dict[int, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; oldest first

    # -- queries (no side effects) -------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks an allocation can take now: free plus evictable cached ones."""
        return len(self._free) + len(self._lru)

    @property
    def num_referenced(self) -> int:
        return int(np.count_nonzero(self._refs))

    def refcount(self, block_id: int) -> int:
        return int(self._refs[self._checked([block_id])[0]])

    def lookup(self, block_hash: int) -> int | None:
        """The block caching ``block_hash``, or None. Does not touch LRU order or refcounts."""
        return self._block_of.get(block_hash)

    def hash_of(self, block_id: int) -> int | None:
        return self._hash_of.get(block_id)

    # -- state changes -------------------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """``n`` blocks with refcount 1, from the free list first, then by evicting the oldest cached."""
        if n < 0:
            raise BlockError(f"cannot allocate n={n} blocks")
        if n > self.num_free:
            raise PoolExhausted(
                f"asked for {n} blocks, {self.num_free} free or evictable of {self.num_blocks} "
                f"({self.num_referenced} referenced); free blocks or configure a larger pool"
            )
        out = [self._free.popleft() for _ in range(min(n, len(self._free)))]
        while len(out) < n:
            block, _ = self._lru.popitem(last=False)
            del self._block_of[self._hash_of.pop(block)]
            out.append(block)
        self._refs[out] = 1
        return out

    def ref(self, block_ids: Iterable[int]) -> None:
        """Take one more reference on each block; a cached block leaves the LRU while referenced."""
        ids = self._checked(block_ids)
        idle = ids[self._refs[ids] == 0]
        not_cached = [int(b) for b in idle if int(b) not in self._lru]
        if not_cached:
            raise BlockError(f"block {not_cached[0]} is free, not cached; allocate it instead of ref-ing it")
        for b in idle:
            self._lru.pop(int(b), None)
        np.add.at(self._refs, ids, 1)

    def unref(self, block_ids: Iterable[int]) -> None:
        """Drop one reference each; at zero a hashed block becomes cached (LRU), an unhashed one free."""
        ids = self._checked(block_ids)
        counts = np.bincount(ids, minlength=self.num_blocks)
        over = np.flatnonzero(counts > self._refs)
        if over.size:
            b = int(over[0])
            raise BlockError(
                f"double free: block {b} has {int(self._refs[b])} reference(s), released {int(counts[b])} time(s)"
            )
        np.subtract.at(self._refs, ids, 1)
        for b in np.unique(ids[self._refs[ids] == 0]):
            self._release(int(b))

    def free(self, block_ids: Iterable[int]) -> None:
        """Give back blocks the caller holds alone; a block someone else still references is an error."""
        ids = self._checked(block_ids)
        shared = ids[self._refs[ids] > 1]
        if shared.size:
            b = int(shared[0])
            raise BlockError(
                f"block {b} is still referenced by {int(self._refs[b]) - 1} other holder(s); use unref() to "
                f"drop only your reference"
            )
        self.unref(ids)

    def cache(self, block_id: int, block_hash: int) -> bool:
        """Key a referenced block by its prefix hash. False when another block already caches that hash."""
        (b,) = self._checked([block_id])
        if self._refs[b] == 0:
            raise BlockError(f"block {int(b)} is not referenced; only a block being filled can be cached")
        if block_hash in self._block_of:
            return self._block_of[block_hash] == int(b)
        old = self._hash_of.pop(int(b), None)
        if old is not None:
            del self._block_of[old]
        self._hash_of[int(b)] = block_hash
        self._block_of[block_hash] = int(b)
        return True

    def evict(self, block_id: int) -> None:
        """Drop a cached block's prefix and make it free; a referenced block cannot be evicted."""
        (b,) = self._checked([block_id])
        if self._refs[b] > 0:
            raise BlockError(f"block {int(b)} is referenced ({int(self._refs[b])}); it cannot be evicted")
        if int(b) not in self._lru:
            raise BlockError(f"block {int(b)} is free, there is nothing to evict")
        del self._lru[int(b)]
        del self._block_of[self._hash_of.pop(int(b))]
        self._free.append(int(b))

    # -- internals -----------------------------------------------------------------------------------------
    def _release(self, b: int) -> None:
        if b in self._hash_of:
            self._lru[b] = None
        else:
            self._free.append(b)

    def _checked(self, block_ids: Iterable[int]) -> npt.NDArray[np.int64]:
        ids = np.fromiter(block_ids, dtype=np.int64) if not isinstance(block_ids, np.ndarray) else block_ids
        ids = ids.astype(np.int64, copy=False).ravel()
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.num_blocks):
            bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
            raise BlockError(f"block id {bad} is unknown: this pool has ids 0..{self.num_blocks - 1}")
        return ids
