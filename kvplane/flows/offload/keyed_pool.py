"""``KeyedPool``: the host index's ``BlockPool``, its prefix keys int64 in one flat table instead of a dict.

``BlockPool`` keys blocks with a Python dict and an object array: every block of a request then costs a few
dict operations per call (lookup at start, insert at finish, pop when evicted), each a handful of cache
misses on a machine whose caches the copies just flushed; with 625 blocks a request (10k tokens) that was
about half of the offload engine's own CPU time. Here a block's key is an int64 in ``key_of`` and the hash
-> block map is an open-addressing table of two int64 arrays, worked by one C pass per call
(``kvplane/_native/keytable.c``), or by ``_DictTable`` with the same calls where the extension is not built.
Hashes are int64 (kvplane's are non-negative int64, the vLLM connector's the first 8 bytes of vLLM's, signed);
others raise, naming the value.

With the extension, refcounts, the free list and the LRU move into the same arrays too: ``ref``, ``unref``,
``allocate`` and eviction are one C call each over a ring of free blocks and a lazily-deleted LRU ring (an
entry is live while the block's ticket is its position), where ``BlockPool`` spends a dozen numpy calls and
Python lists of ints on each. Results, error messages and LRU order are ``BlockPool``'s: its reference-model
test drives both. Without the extension, ``BlockPool``'s own methods run. Only ``HostIndex`` uses it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from kvplane._native import optional
from kvplane.blocks.groups import is_ids
from kvplane.blocks.pool import BlockPool
from kvplane.descriptors import Int64Array as I64
from kvplane.errors import BlockError

_native, _ = optional("_keytable")


_RANGE, _OVER, _FREE = 1, 2, 3  # error kinds the native calls return with the block (or index) at fault


def _as_ids(block_ids: Iterable[int]) -> I64:
    if is_ids(block_ids):
        return block_ids
    ids = block_ids if isinstance(block_ids, np.ndarray) else np.fromiter(block_ids, dtype=np.int64)
    return np.ascontiguousarray(ids, dtype=np.int64).ravel()


def _integers(arr: npt.NDArray[Any]) -> bool:
    """Whether ``arr`` holds integers int64 can hold (numpy's cast would truncate floats and parse strings)."""
    if arr.dtype.kind == "u" and arr.size:
        return int(arr.max()) < 1 << 63
    return arr.dtype.kind in "biu" or arr.size == 0


def as_hashes(hashes: Sequence[int] | I64) -> I64:
    """Hashes as an int64 array (a list is converted once; an array of another integer type is cast)."""
    if is_ids(hashes):
        return hashes
    if isinstance(hashes, np.ndarray) and _integers(hashes):
        return hashes.astype(np.int64, copy=False).ravel()
    try:
        if _native is not None and type(hashes) is list:  # one C pass, no numpy conversion machinery
            out = np.empty(len(hashes), dtype=np.int64)
            _native.from_list(hashes, out)
            return out
        arr = np.asarray(hashes)
        if not _integers(arr):
            raise TypeError
        return arr.astype(np.int64).reshape(-1)
    except (OverflowError, TypeError):
        bad = next((h for h in np.asarray(hashes, dtype=object).ravel().tolist()
                    if not isinstance(h, (int, np.integer)) or not -(1 << 63) <= int(h) < 1 << 63), None)
        if bad is None:  # numpy integers of mixed types (numpy makes them float): each is an int64
            return np.array([int(h) for h in hashes], dtype=np.int64).reshape(-1)
        raise BlockError(
            f"block hash {bad!r} is not an int64; the host index keys prefixes by int64 hashes "
            f"(kvplane.blocks.block_hashes gives them)"
        ) from None


class _DictTable:
    """``keytable``'s three calls over a dict, for a build without the extension (same results)."""

    def __init__(self) -> None:
        self.map: dict[int, int] = {}

    def get(self, keys: Any, vals: Any, hashes: I64, out: I64) -> tuple[int, int]:
        out[:] = np.fromiter(map(self.map.get, hashes.tolist(), [-1] * hashes.size), np.int64, hashes.size)
        missing = np.flatnonzero(out < 0)
        return out.size - missing.size, int(missing[0]) if missing.size else out.size

    def cache(
        self, keys: Any, vals: Any, key_of: I64, hashed: Any, refs: I64, ids: I64, hashes: I64, out: Any
    ) -> tuple[int, int]:
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= key_of.size):
            return _RANGE, 0
        idle = ids[refs[ids] == 0]
        if idle.size:
            return _FREE, int(idle[0])
        m = self.map
        for i, (b, h) in enumerate(zip(ids.tolist(), hashes.tolist())):
            held = m.get(h)
            if held is not None:
                out[i] = held == b
                continue
            if hashed[b]:
                m.pop(int(key_of[b]), None)
            key_of[b], hashed[b], m[h], out[i] = h, True, b, True
        return 0, -1

    def forget(self, keys: Any, vals: Any, key_of: I64, hashed: Any, ids: I64) -> None:
        for b in ids.tolist():
            if hashed[b]:
                k = int(key_of[b])
                if self.map.get(k) == b:
                    del self.map[k]
                hashed[b] = False


def _pow2(n: int) -> int:
    return 1 << max(1, (n - 1).bit_length())


class KeyedPool(BlockPool):
    def __init__(self, num_blocks: int, native: bool = True) -> None:
        super().__init__(num_blocks)
        self._key_of = np.zeros(num_blocks, dtype=np.int64)  # a block's hash where _hashed
        capacity = _pow2(2 * num_blocks)  # at least twice the keys it can hold
        self._keys = np.zeros(capacity, dtype=np.int64)
        self._vals = np.full(capacity, -1, dtype=np.int64)  # -1: an empty slot
        self._hashed_u8 = self._hashed.view(np.uint8)  # the same flags, as the C calls take them
        self._table: Any = _native if native and _native is not None else _DictTable()
        self._pool: Any = self._table if self._table is _native else None  # native refcounts and LRU
        if self._pool is not None:
            self._free_ring = np.zeros(_pow2(num_blocks), dtype=np.int64)
            self._free_ring[:num_blocks] = np.arange(num_blocks)
            self._lru_ring = np.zeros(_pow2(2 * num_blocks), dtype=np.int64)
            self._meta = np.array([0, num_blocks, 0, 0, 0], dtype=np.int64)  # free head/tail, lru head/tail/live
            self._free, self._hash_of = [], np.zeros(0, dtype=object)  # BlockPool's, unused: memory back
            self._state = (self._keys, self._vals, self._key_of, self._hashed_u8, self._refs,
                           self._ticket, self._free_ring, self._lru_ring, self._meta)

    # -- the native pool (BlockPool's methods where there is none) ----------------------------------------
    @property
    def num_free(self) -> int:
        if self._pool is None:
            return super().num_free
        return self.num_unused + int(self._meta[4])

    @property
    def num_unused(self) -> int:
        if self._pool is None:
            return super().num_unused
        return int(self._meta[1] - self._meta[0])

    def allocate_array(self, n: int) -> I64:
        if self._pool is None or n < 0 or n > self.num_free:
            return super().allocate_array(n)  # its checks raise
        out = np.empty(n, dtype=np.int64)
        self._pool.allocate(*self._state, out)
        return out

    def counts(self) -> tuple[int, int]:
        """``(num_free, num_unused)`` in one read of the native counters (no numpy scalar per property)."""
        if self._pool is None:
            return super().num_free, super().num_unused
        head, tail, _, _, live = self._meta.tolist()
        return tail - head + live, tail - head

    def allocate_upto(self, n: int) -> I64:
        """``allocate_array`` of as many of ``n`` blocks as are free or evictable."""
        if self._pool is None or n < 0:
            return super().allocate_array(min(n, self.num_free))
        free, _ = self.counts()
        out = np.empty(min(n, free), dtype=np.int64)
        self._pool.allocate(*self._state, out)
        return out

    def ref(self, block_ids: Iterable[int]) -> None:
        if self._pool is None:
            return super().ref(block_ids)
        ids = _as_ids(block_ids)
        kind, b = self._pool.ref(*self._state, ids)
        if kind == _RANGE:
            self._checked(ids)  # raises, naming the id
        if kind == _FREE:
            raise BlockError(f"block {b} is free, not cached; allocate it instead of ref-ing it")

    def unref(self, block_ids: Iterable[int]) -> None:
        if self._pool is None:
            return super().unref(block_ids)
        ids = _as_ids(block_ids)
        kind, _ = self._pool.unref(*self._state, ids)
        if kind == _RANGE:
            self._checked(ids)
        if kind == _OVER:
            counts = np.bincount(ids, minlength=self.num_blocks)
            b = int(np.flatnonzero(counts > self._refs)[0])
            raise BlockError(
                f"double free: block {b} has {int(self._refs[b])} reference(s), released {int(counts[b])} time(s)"
            )

    def _oldest(self, n: int) -> I64:
        if self._pool is None:
            return super()._oldest(n)
        out = np.empty(max(n, 0), dtype=np.int64)
        _, got = self._pool.oldest(*self._state, out)
        return out[:got]

    def oldest_array(self, n: int) -> I64:
        """``oldest_cached`` as an int64 array: the ``n`` blocks an allocation would evict first."""
        return self._oldest(n)

    def evict(self, block_id: int) -> None:
        if self._pool is None:
            return super().evict(block_id)
        b = int(self._checked([block_id])[0])
        if self._refs[b] > 0:
            raise BlockError(f"block {b} is referenced ({int(self._refs[b])}); it cannot be evicted")
        if self._ticket[b] < 0:
            raise BlockError(f"block {b} is free, there is nothing to evict")
        self._pool.evict(*self._state, np.array([b], dtype=np.int64))

    # -- queries (no side effects) -------------------------------------------------------------------------
    def lookup(self, block_hash: int) -> int | None:
        b = int(self.blocks_of([block_hash])[0])
        return None if b < 0 else b

    def hash_of(self, block_id: int) -> int | None:
        b = int(self._checked([block_id])[0])
        return int(self._key_of[b]) if self._hashed[b] else None

    def hashes_of(self, block_ids: Sequence[int] | I64) -> list[int | None]:
        ids = self._checked(block_ids)
        keyed: list[int] = self._key_of[ids].tolist()
        return [k if h else None for k, h in zip(keyed, self._hashed[ids].tolist())]

    def keys_of(self, block_ids: I64) -> I64:
        """The hashes of keyed blocks, as an int64 array (``hashes_of`` without the Python list)."""
        return self._key_of[self._checked(block_ids)]

    def blocks_of(self, hashes: Sequence[int] | I64) -> I64:
        return self.find(hashes)[0]

    def find(self, hashes: Sequence[int] | I64) -> tuple[I64, int, int]:
        """``blocks_of``, with how many hashes are keyed and the index of the first that is not (or the
        count): the engine's branches without another pass over the result."""
        h = as_hashes(hashes)
        if not h.flags.c_contiguous:
            h = np.ascontiguousarray(h)
        out = np.empty(h.size, dtype=np.int64)
        hits, first_miss = self._table.get(self._keys, self._vals, h, out)
        return out, hits, first_miss

    # -- state changes -------------------------------------------------------------------------------------
    def cache(self, block_id: int, block_hash: int) -> bool:
        return bool(self.cache_many([block_id], [block_hash])[0])

    def cache_many(self, block_ids: Sequence[int] | I64, hashes: Sequence[int] | I64) -> npt.NDArray[np.bool_]:
        """Key each block by its hash in order, as ``cache`` one at a time would: False where another block
        already holds that hash (nothing changes for it); a block keyed before loses its old hash."""
        ids = _as_ids(block_ids)
        h = as_hashes(hashes)
        if h.size != ids.size:
            raise BlockError(f"{ids.size} block ids but {h.size} hashes; pass one hash per block")
        out = np.empty(ids.size, dtype=np.bool_)
        kind, at = self._table.cache(self._keys, self._vals, self._key_of, self._hashed_u8, self._refs, ids,
                                     np.ascontiguousarray(h), out.view(np.uint8))
        if kind == _RANGE:
            self._checked(ids)  # raises, naming the id
        if kind == _FREE:
            raise BlockError(f"block {at} is not referenced; only a block being filled can be cached")
        return out

    def _forget(self, blocks: I64) -> None:
        self._table.forget(self._keys, self._vals, self._key_of, self._hashed_u8,
                           np.ascontiguousarray(blocks, dtype=np.int64))
