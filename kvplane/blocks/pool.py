"""The block pool: a free list, refcounts, and an LRU of unreferenced blocks that still hold a cached prefix.

Every block is in exactly one state: free (no data worth keeping), referenced (refcount > 0), or cached
(refcount 0, keyed by a prefix hash, evictable oldest first). Misuse raises ``BlockError`` and changes
nothing: a failed call never half-applies, and nothing is silently clamped.

Every call on many blocks is array work: refcounts and LRU tickets are numpy arrays, the free list and the
LRU queue are Python lists sliced and extended in bulk, and the hash maps change through ``dict.update`` and
``map`` (no Python statement per block). The LRU queue deletes lazily: block ``b`` is cached at queue
position ``p`` only while ``_ticket[b] == p``; stale entries are skipped when evicting and dropped when the
queue is compacted.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import numpy.typing as npt

from kvplane.descriptors import Int64Array as I64
from kvplane.errors import BlockError, PoolExhausted

_COMPACT = 1024  # queue entries consumed (or stale) before the lists are rewritten


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise BlockError(f"num_blocks={num_blocks} must be >= 1")
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks))  # FIFO from _free_head on
        self._free_head = 0
        self._refs = np.zeros(num_blocks, dtype=np.int64)
        self._hashed = np.zeros(num_blocks, dtype=np.bool_)
        self._hash_of = np.full(num_blocks, None, dtype=object)  # the hash keying each block (None: none)
        self._block_of: dict[int, int] = {}
        # LRU of cached, unreferenced blocks, oldest first: queue position p is _lru[p - _lru_base]
        self._lru: list[int] = []
        self._lru_head = 0  # entries before it are consumed
        self._lru_base = 0
        self._lru_count = 0
        self._ticket = np.full(num_blocks, -1, dtype=np.int64)  # queue position while cached, else -1

    # -- queries (no side effects) -------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks an allocation can take now: free plus evictable cached ones."""
        return self.num_unused + self._lru_count

    @property
    def num_unused(self) -> int:
        """Blocks holding nothing (taken before any cached block is evicted)."""
        return len(self._free) - self._free_head

    @property
    def num_referenced(self) -> int:
        return int(np.count_nonzero(self._refs))

    def refcount(self, block_id: int) -> int:
        return int(self._refs[self._checked([block_id])[0]])

    def lookup(self, block_hash: int) -> int | None:
        """The block caching ``block_hash``, or None. Does not touch LRU order or refcounts."""
        return self._block_of.get(block_hash)

    def hash_of(self, block_id: int) -> int | None:
        b = int(self._checked([block_id])[0])
        h: int | None = self._hash_of[b]
        return h

    def hashes_of(self, block_ids: Sequence[int] | I64) -> list[int | None]:
        """``hash_of`` for many blocks, in order."""
        out: list[int | None] = self._hash_of[self._checked(block_ids)].tolist()
        return out

    def oldest_cached(self, n: int) -> list[int]:
        """The ``n`` cached blocks an allocation would evict first, oldest first (no side effects)."""
        out: list[int] = self._oldest(n).tolist()
        return out

    # -- state changes -------------------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """``n`` blocks with refcount 1, from the free list first, then by evicting the oldest cached."""
        out: list[int] = self.allocate_array(n).tolist()
        return out

    def allocate_array(self, n: int) -> I64:
        """``allocate`` as an int64 array."""
        if n < 0:
            raise BlockError(f"cannot allocate n={n} blocks")
        if n > self.num_free:
            raise PoolExhausted(
                f"asked for {n} blocks, {self.num_free} free or evictable of {self.num_blocks} "
                f"({self.num_referenced} referenced); free blocks or configure a larger pool"
            )
        k = min(n, self.num_unused)
        out = np.array(self._free[self._free_head : self._free_head + k], dtype=np.int64)
        self._free_head += k
        if self._free_head > _COMPACT and self._free_head * 2 > len(self._free):
            del self._free[: self._free_head]
            self._free_head = 0
        if n > k:
            victims = self._oldest(n - k)
            self._leave_lru(victims)
            self._forget(victims)
            out = np.concatenate((out, victims)) if k else victims
        self._refs[out] = 1
        return out

    def ref(self, block_ids: Iterable[int]) -> None:
        """Take one more reference on each block; a cached block leaves the LRU while referenced."""
        ids = self._checked(block_ids)
        distinct = _distinct(ids)
        idle = distinct[self._refs[distinct] == 0]
        not_cached = idle[self._ticket[idle] < 0]
        if not_cached.size:
            raise BlockError(f"block {int(not_cached[0])} is free, not cached; allocate it instead of ref-ing it")
        self._leave_lru(idle)
        if distinct.size == ids.size:
            self._refs[ids] += 1
        else:
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
        if ids.size and int(counts.max()) > 1:
            np.subtract.at(self._refs, ids, 1)
            released = _distinct(ids[self._refs[ids] == 0])
        else:
            self._refs[ids] -= 1
            released = np.sort(ids[self._refs[ids] == 0])
        hashed = self._hashed[released]
        self._free.extend(released[~hashed].tolist())
        self._enter_lru(released[hashed])

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
        (b,) = self._checked([block_id]).tolist()
        if self._refs[b] == 0:
            raise BlockError(f"block {b} is not referenced; only a block being filled can be cached")
        if block_hash in self._block_of:
            return bool(self._block_of[block_hash] == b)
        if self._hashed[b]:
            del self._block_of[self._hash_of[b]]
        self._hash_of[b] = block_hash
        self._block_of[block_hash] = b
        self._hashed[b] = True
        return True

    def cache_many(self, block_ids: Sequence[int] | I64, hashes: Sequence[int]) -> npt.NDArray[np.bool_]:
        """``cache`` for many blocks in order; False where another block already holds that hash.

        When the ids are distinct, the hashes distinct and none of them cached yet (a fresh store), the maps
        change in bulk; otherwise (re-keying, repeats, hashes held elsewhere) one block at a time.
        """
        ids = self._checked(block_ids)
        if len(hashes) != ids.size:
            raise BlockError(f"{ids.size} block ids but {len(hashes)} hashes; pass one hash per block")
        idle = ids[self._refs[ids] == 0]
        if idle.size:
            raise BlockError(f"block {int(idle[0])} is not referenced; only a block being filled can be cached")
        block_of, hash_of = self._block_of, self._hash_of
        fresh = (
            len(set(hashes)) == len(hashes)
            and _distinct(ids).size == ids.size
            and not any(map(block_of.__contains__, hashes))
        )
        if not fresh:
            return np.array([self.cache(b, h) for b, h in zip(ids.tolist(), hashes)], dtype=np.bool_)
        rekeyed = ids[self._hashed[ids]]
        if rekeyed.size:
            for _ in map(block_of.pop, hash_of[rekeyed].tolist()):
                pass
        hash_of[ids] = hashes if isinstance(hashes, list) else list(hashes)
        block_of.update(zip(hashes, ids.tolist()))
        self._hashed[ids] = True
        return np.ones(ids.size, dtype=np.bool_)

    def blocks_of(self, hashes: Sequence[int]) -> I64:
        """The block caching each hash, -1 where none does (no side effects)."""
        return np.fromiter(map(self._block_of.get, hashes, [-1] * len(hashes)), dtype=np.int64, count=len(hashes))

    def evict(self, block_id: int) -> None:
        """Drop a cached block's prefix and make it free; a referenced block cannot be evicted."""
        ids = self._checked([block_id])
        b = int(ids[0])
        if self._refs[b] > 0:
            raise BlockError(f"block {b} is referenced ({int(self._refs[b])}); it cannot be evicted")
        if self._ticket[b] < 0:
            raise BlockError(f"block {b} is free, there is nothing to evict")
        self._leave_lru(ids)
        self._forget(ids)
        self._free.append(b)

    # -- internals -----------------------------------------------------------------------------------------
    def _enter_lru(self, blocks: I64) -> None:
        """Append cached blocks (distinct, not in the LRU) as the most recently used, in the order given."""
        if not blocks.size:
            return
        start = self._lru_base + len(self._lru)
        self._lru.extend(blocks.tolist())
        self._ticket[blocks] = np.arange(start, start + blocks.size, dtype=np.int64)
        self._lru_count += int(blocks.size)
        dead = len(self._lru) - self._lru_count  # consumed or stale entries
        if dead > _COMPACT and dead > 2 * self._lru_count:
            self._compact_lru()

    def _leave_lru(self, blocks: I64) -> None:
        """Take distinct blocks out of the LRU (they are referenced or evicted); their entries go stale."""
        if blocks.size:
            self._ticket[blocks] = -1
            self._lru_count -= int(blocks.size)

    def _oldest(self, n: int) -> I64:
        """The ``n`` oldest live LRU entries (n <= the LRU's size); consumed stale entries are dropped."""
        if n <= 0:
            return np.zeros(0, dtype=np.int64)
        found: list[I64] = []
        got, pos, step = 0, self._lru_head, max(2 * n, 64)
        while got < n and pos < len(self._lru):
            chunk = np.array(self._lru[pos : pos + step], dtype=np.int64)
            is_live = self._ticket[chunk] == np.arange(pos, pos + chunk.size) + self._lru_base
            live = chunk[is_live]
            found.append(live[: n - got])
            got += min(live.size, n - got)
            if pos == self._lru_head:  # stale entries before the first live one: later scans skip them
                self._lru_head += int(np.argmax(is_live)) if live.size else chunk.size
            pos += chunk.size
        return np.concatenate(found) if found else np.zeros(0, dtype=np.int64)

    def _compact_lru(self) -> None:
        live = np.array(self._lru[self._lru_head :], dtype=np.int64)
        live = live[self._ticket[live] == np.arange(self._lru_head, len(self._lru)) + self._lru_base]
        self._lru = live.tolist()
        self._lru_base, self._lru_head = 0, 0
        self._ticket[live] = np.arange(live.size, dtype=np.int64)

    def _forget(self, blocks: I64) -> None:
        """Drop the prefix keys of ``blocks`` (all keyed)."""
        for _ in map(self._block_of.pop, self._hash_of[blocks].tolist()):
            pass
        self._hash_of[blocks] = None
        self._hashed[blocks] = False

    def _checked(self, block_ids: Iterable[int]) -> I64:
        ids = np.fromiter(block_ids, dtype=np.int64) if not isinstance(block_ids, np.ndarray) else block_ids
        ids = ids.astype(np.int64, copy=False).ravel()
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.num_blocks):
            bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
            raise BlockError(f"block id {bad} is unknown: this pool has ids 0..{self.num_blocks - 1}")
        return ids


def _distinct(ids: I64) -> I64:
    """The distinct ids, sorted (``np.unique`` without its hashing pass, which costs more on short arrays)."""
    if ids.size < 2:
        return ids
    s = np.sort(ids)
    keep = np.empty(s.size, dtype=np.bool_)
    keep[0] = True
    np.not_equal(s[1:], s[:-1], out=keep[1:])
    return s[keep]
