"""The host index's ``KeyedPool``: ``BlockPool``'s contract with int64 prefix keys in a flat table.

Both tables (the C one, and the dict it falls back on without the extension) are driven against the same
reference model as ``BlockPool`` and against ``BlockPool`` itself, so the host index behaves as before.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_blocks import NUM_BLOCKS, PoolMachine

from kvplane.blocks.pool import BlockPool
from kvplane.errors import BlockError
from kvplane.flows.offload import keyed_pool
from kvplane.flows.offload.keyed_pool import KeyedPool

TABLES = [pytest.param(True, id="native"), pytest.param(False, id="dict")]


def test_the_native_table_is_built() -> None:
    assert keyed_pool._native is not None, "run `python setup.py build_ext --inplace` (kvplane/_native/keytable.c)"


class NativeKeyedMachine(PoolMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = KeyedPool(NUM_BLOCKS)


class DictKeyedMachine(PoolMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = KeyedPool(NUM_BLOCKS, native=False)


NativeKeyedMachine.TestCase.settings = PoolMachine.TestCase.settings
DictKeyedMachine.TestCase.settings = PoolMachine.TestCase.settings
test_native_keyed_pool_against_the_reference_model = NativeKeyedMachine.TestCase
test_dict_keyed_pool_against_the_reference_model = DictKeyedMachine.TestCase


@pytest.mark.parametrize("native", TABLES)
def test_caching_many_matches_block_pool_one_by_one_with_rekeys_and_repeats(native: bool) -> None:
    rng = np.random.default_rng(3)
    one, many = BlockPool(16), KeyedPool(16, native=native)
    for pool in (one, many):
        pool.allocate(16)
    for _ in range(40):  # re-keying blocks, hashes other blocks already hold, and repeats within one call
        ids = rng.integers(0, 16, 12)
        hashes = [int(h) for h in rng.integers(-12, 12, 12)]
        want = [one.cache(int(b), h) for b, h in zip(ids, hashes)]
        assert many.cache_many(ids.astype(np.int64), np.array(hashes, dtype=np.int64)).tolist() == want
        assert [many.hash_of(b) for b in range(16)] == [one.hash_of(b) for b in range(16)]
        assert many.blocks_of(list(range(-12, 12))).tolist() == one.blocks_of(list(range(-12, 12))).tolist()


@pytest.mark.parametrize("native", TABLES)
def test_thousands_of_keys_come_and_go_and_every_lookup_stays_right(native: bool) -> None:
    """Evicting and re-keying a full pool many times over (a host tier in steady state): lookups find exactly
    the keys held, whatever the probe runs the deletions shifted."""
    rng = np.random.default_rng(7)
    pool = KeyedPool(256, native=native)
    held: dict[int, int] = {}
    for _ in range(30):
        ids = pool.allocate_array(int(rng.integers(1, 256)))  # evicts the oldest cached ones
        for b in ids.tolist():
            held = {h: x for h, x in held.items() if x != b}
        hashes = rng.integers(-(1 << 63), (1 << 63) - 1, ids.size, dtype=np.int64)
        ok = pool.cache_many(ids, hashes)
        held.update({int(h): int(b) for h, b, k in zip(hashes, ids, ok) if k})
        pool.unref(ids)
        probe = np.concatenate([np.array(list(held), dtype=np.int64), rng.integers(0, 1 << 40, 64)])
        want = [held.get(int(h), -1) for h in probe]
        assert pool.blocks_of(probe).tolist() == want


def test_a_hash_outside_int64_is_refused_naming_it() -> None:
    pool = KeyedPool(4)
    (b,) = pool.allocate(1)
    with pytest.raises(BlockError, match=str(1 << 64)):
        pool.cache_many([b], [1 << 64])
    assert pool.hash_of(b) is None


@pytest.mark.parametrize("native", TABLES)
def test_many_ref_release_cycles_keep_lru_order_through_ring_compactions(native: bool) -> None:
    """Thousands of pin/release cycles on cached blocks (what loads do) fill the LRU ring with stale entries
    many times over: eviction still takes the least recently released first, as ``BlockPool`` does."""
    rng = np.random.default_rng(5)
    pool, model = KeyedPool(64, native=native), BlockPool(64)
    for p in (pool, model):
        blocks = p.allocate_array(64)
        assert p.cache_many(blocks, list(range(64))).all()
        p.unref(blocks)
    for _ in range(3000):
        some = rng.choice(64, int(rng.integers(1, 9)), replace=False)
        for p in (pool, model):
            p.ref(some)
            p.unref(some)
    assert pool.oldest_cached(64) == model.oldest_cached(64)
    assert pool.allocate(10) == model.allocate(10)
    assert pool.num_free == model.num_free == 54
    assert pool.blocks_of(list(range(64))).tolist() == model.blocks_of(list(range(64))).tolist()


def test_hashes_convert_once_to_int64_whatever_the_container() -> None:
    hashes = [0, -1, (1 << 63) - 1, -(1 << 63), 12345, np.int64(7), True]
    want = np.array([int(h) for h in hashes], dtype=np.int64)
    for given in (hashes, tuple(hashes), want, want.astype(np.int32, casting="unsafe")[:0]):
        got = keyed_pool.as_hashes(given)
        assert got.dtype == np.int64 and got.tolist() == want[: len(got)].tolist()
    for bad in ([1, 1 << 63], [2.5], ["x"]):
        with pytest.raises(BlockError, match="is not an int64"):
            keyed_pool.as_hashes(bad)


def test_span_gives_the_smallest_and_largest_id() -> None:
    assert keyed_pool._native is not None
    ids = np.array([5, -3, 9, 0, 9], dtype=np.int64)
    assert keyed_pool._native.span(ids) == (-3, 9)
    assert keyed_pool._native.span(ids[:1]) == (5, 5)
    with pytest.raises(ValueError, match="empty"):
        keyed_pool._native.span(ids[:0])


@pytest.mark.parametrize("native", TABLES)
@pytest.mark.parametrize("container", [list, tuple, np.array], ids=["list", "tuple", "array"])
def test_a_hash_that_is_not_an_integer_is_refused_in_any_container(
    native: bool, container: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A float or a string is not a prefix hash: numpy's cast would make 2.5 the key 2 (another prefix's) and
    "7" the key 7, so every container, with or without the extension, refuses it as a list does natively."""
    if not native:
        monkeypatch.setattr(keyed_pool, "_native", None)
    for bad in ([1, 2.5], ["7"], [1, float(1 << 62)]):
        with pytest.raises(BlockError, match="is not an int64"):
            keyed_pool.as_hashes(container(bad))  # type: ignore[operator]
    huge = np.array([1, 1 << 63], dtype=np.uint64)
    with pytest.raises(BlockError, match="is not an int64"):
        keyed_pool.as_hashes(huge if container is np.array else container(huge.tolist()))  # type: ignore[operator]
    assert keyed_pool.as_hashes(container([3, -4])).tolist() == [3, -4]  # type: ignore[operator]
    assert keyed_pool.as_hashes(container([])).tolist() == []  # type: ignore[operator]
