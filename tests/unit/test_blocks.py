"""Block pool, block tables and prefix hashes.

The pool's contract: every block is free, referenced or cached; misuse raises ``BlockError`` and changes
nothing. A stateful test drives the pool against a small reference model.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvplane.blocks import ROOT_HASH, BlockPool, BlockTable, block_hashes
from kvplane.errors import BlockError, KvplaneError, PoolExhausted, SpecError


def snapshot(pool: BlockPool, hashes: range = range(100)) -> tuple[object, ...]:
    """Everything the public API can see of a pool."""
    return (
        pool.num_free,
        pool.num_referenced,
        tuple(pool.refcount(b) for b in range(pool.num_blocks)),
        tuple(pool.hash_of(b) for b in range(pool.num_blocks)),
        tuple(pool.lookup(h) for h in hashes),
    )


def cached_pool(num_blocks: int, cached: int) -> tuple[BlockPool, list[int]]:
    """A pool whose first ``cached`` allocated blocks were filled, hashed 0, 1, ... and released, in that order."""
    pool = BlockPool(num_blocks)
    blocks = pool.allocate(cached)
    for h, b in enumerate(blocks):
        assert pool.cache(b, h)
        pool.free([b])
    return pool, blocks


# -- allocate and free ---------------------------------------------------------------------------------------
def test_a_new_pool_has_every_block_free() -> None:
    pool = BlockPool(8)
    assert (pool.num_free, pool.num_referenced) == (8, 0)
    assert all(pool.refcount(b) == 0 for b in range(8))


@pytest.mark.parametrize("num_blocks", [0, -3])
def test_a_pool_needs_at_least_one_block(num_blocks: int) -> None:
    with pytest.raises(BlockError, match=rf"num_blocks={num_blocks} must be >= 1"):
        BlockPool(num_blocks)


def test_allocate_hands_out_distinct_blocks_with_refcount_one() -> None:
    pool = BlockPool(8)
    first, second = pool.allocate(3), pool.allocate(5)
    assert len(set(first + second)) == 8
    assert set(first + second) == set(range(8))
    assert all(pool.refcount(b) == 1 for b in first + second)
    assert (pool.num_free, pool.num_referenced) == (0, 8)


def test_allocate_zero_blocks_takes_nothing() -> None:
    pool = BlockPool(4)
    assert pool.allocate(0) == []
    assert pool.num_free == 4


def test_allocate_a_negative_count_raises_naming_it() -> None:
    pool = BlockPool(4)
    with pytest.raises(BlockError, match=r"n=-1"):
        pool.allocate(-1)
    assert pool.num_free == 4


def test_free_returns_blocks_to_the_pool() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    pool.free(blocks[:2])
    assert (pool.num_free, pool.num_referenced) == (2, 2)
    assert sorted(pool.allocate(2)) == sorted(blocks[:2])


def test_free_accepts_a_numpy_array_of_ids() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    pool.free(np.array(blocks, dtype=np.int32))
    assert pool.num_free == 4


def test_double_free_raises_and_changes_nothing() -> None:
    pool = BlockPool(6)
    a, b, c = pool.allocate(3)
    pool.free([a])
    before = snapshot(pool)
    with pytest.raises(
        BlockError, match=rf"double free: block {a} has 0 reference\(s\), released 1 time\(s\)"
    ):
        pool.free([b, a])
    assert snapshot(pool) == before
    assert pool.refcount(b) == 1  # b, listed before a, was not freed either


def test_the_same_block_twice_in_one_free_raises_and_changes_nothing() -> None:
    pool = BlockPool(4)
    (a,) = pool.allocate(1)
    before = snapshot(pool)
    with pytest.raises(
        BlockError, match=rf"double free: block {a} has 1 reference\(s\), released 2 time\(s\)"
    ):
        pool.free([a, a])
    assert snapshot(pool) == before


def test_unref_of_a_block_nobody_holds_raises_and_changes_nothing() -> None:
    pool = BlockPool(4)
    before = snapshot(pool)
    with pytest.raises(BlockError, match=r"double free: block 2"):
        pool.unref([2])
    assert snapshot(pool) == before


def test_free_of_a_block_another_holder_references_raises_and_changes_nothing() -> None:
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.cache(a, 7)
    pool.ref([a])  # a second holder
    before = snapshot(pool)
    with pytest.raises(BlockError, match=rf"block {a} is still referenced by 1 other holder\(s\); use unref"):
        pool.free([b, a])
    assert snapshot(pool) == before
    pool.unref([a])
    assert pool.refcount(a) == 1
    pool.free([a, b])
    assert pool.num_referenced == 0


@pytest.mark.parametrize("bad", [-1, 6, 1000])
@pytest.mark.parametrize("call", ["free", "unref", "ref", "refcount", "evict", "cache"])
def test_unknown_block_ids_raise_naming_the_id_and_change_nothing(call: str, bad: int) -> None:
    pool, _ = cached_pool(6, 2)
    held = pool.allocate(2)
    before = snapshot(pool)
    actions = {
        "free": lambda: pool.free([held[0], bad]),
        "unref": lambda: pool.unref([held[0], bad]),
        "ref": lambda: pool.ref([held[0], bad]),
        "refcount": lambda: pool.refcount(bad),
        "evict": lambda: pool.evict(bad),
        "cache": lambda: pool.cache(bad, 99),
    }
    with pytest.raises(BlockError, match=rf"block id {bad} is unknown: this pool has ids 0\.\.5"):
        actions[call]()
    assert snapshot(pool) == before


def test_allocating_more_than_available_raises_pool_exhausted_and_takes_nothing() -> None:
    pool, _ = cached_pool(6, 2)
    pool.allocate(2)
    before = snapshot(pool)
    with pytest.raises(PoolExhausted, match=r"asked for 5 blocks, 4 free or evictable of 6 \(2 referenced\)"):
        pool.allocate(5)
    assert snapshot(pool) == before
    assert len(pool.allocate(4)) == 4


def test_pool_exhausted_is_a_block_error() -> None:
    assert issubclass(PoolExhausted, BlockError) and issubclass(BlockError, KvplaneError)


# -- caching, LRU and eviction ---------------------------------------------------------------------------
def test_a_freed_hashed_block_is_cached_and_still_found_by_its_hash() -> None:
    pool = BlockPool(4)
    (a,) = pool.allocate(1)
    assert pool.cache(a, 42) is True
    pool.free([a])
    assert pool.refcount(a) == 0
    assert pool.lookup(42) == a and pool.hash_of(a) == 42
    assert pool.num_free == 4  # cached blocks still count as allocatable
    assert pool.num_referenced == 0


def test_a_freed_unhashed_block_is_free_with_no_hash() -> None:
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    pool.free([a])
    assert pool.hash_of(a) is None
    with pytest.raises(BlockError, match=rf"block {a} is free, there is nothing to evict"):
        pool.evict(a)


def test_free_blocks_are_used_before_any_cached_block_is_evicted() -> None:
    pool, cached = cached_pool(6, 3)
    got = pool.allocate(3)
    assert set(got).isdisjoint(cached)
    assert [pool.lookup(h) for h in range(3)] == cached


def test_cached_blocks_are_evicted_oldest_first() -> None:
    pool, cached = cached_pool(5, 5)  # cached in order: hash 0 oldest
    assert pool.allocate(2) == cached[:2]
    assert [pool.lookup(h) for h in range(5)] == [None, None, *cached[2:]]
    got = pool.allocate(1)
    assert got == [cached[2]]
    assert pool.hash_of(cached[2]) is None
    assert [pool.lookup(h) for h in range(5)] == [None, None, None, cached[3], cached[4]]


def test_ref_revives_a_cached_block_which_is_not_evicted_while_referenced() -> None:
    pool, cached = cached_pool(4, 4)
    oldest = cached[0]
    pool.ref([oldest])
    assert pool.refcount(oldest) == 1
    assert pool.num_free == 3 and pool.num_referenced == 1
    got = pool.allocate(3)
    assert oldest not in got
    assert pool.lookup(0) == oldest  # its prefix survived
    with pytest.raises(PoolExhausted):
        pool.allocate(1)


def test_a_revived_block_returns_to_the_lru_as_the_newest() -> None:
    pool, cached = cached_pool(3, 3)
    pool.ref([cached[0]])
    pool.unref([cached[0]])
    assert pool.allocate(2) == [cached[1], cached[2]]
    assert pool.lookup(0) == cached[0]


def test_two_holders_of_one_cached_block_each_release_one_reference() -> None:
    pool, cached = cached_pool(3, 1)
    pool.ref([cached[0]])
    pool.ref([cached[0]])
    assert pool.refcount(cached[0]) == 2
    pool.unref([cached[0]])
    with pytest.raises(BlockError):
        pool.evict(cached[0])
    pool.unref([cached[0]])
    pool.evict(cached[0])
    assert pool.lookup(0) is None and pool.hash_of(cached[0]) is None


def test_evict_of_a_referenced_block_raises_and_changes_nothing() -> None:
    pool = BlockPool(3)
    (a,) = pool.allocate(1)
    pool.cache(a, 5)
    before = snapshot(pool)
    with pytest.raises(BlockError, match=rf"block {a} is referenced \(1\); it cannot be evicted"):
        pool.evict(a)
    assert snapshot(pool) == before


def test_evict_makes_a_cached_block_free_and_forgets_its_hash() -> None:
    pool, cached = cached_pool(3, 2)
    pool.evict(cached[1])
    assert pool.lookup(1) is None and pool.hash_of(cached[1]) is None
    assert pool.num_free == 3
    with pytest.raises(BlockError, match=r"block .* is free, not cached"):
        pool.ref([cached[1]])


def test_ref_of_a_free_block_raises_and_changes_nothing() -> None:
    pool, cached = cached_pool(4, 1)
    before = snapshot(pool)
    free_block = next(b for b in range(4) if b not in cached)
    with pytest.raises(BlockError, match=rf"block {free_block} is free, not cached; allocate it"):
        pool.ref([cached[0], free_block])
    assert snapshot(pool) == before


def test_cache_of_an_unreferenced_block_raises_and_changes_nothing() -> None:
    pool = BlockPool(3)
    before = snapshot(pool)
    with pytest.raises(
        BlockError, match=r"block 1 is not referenced; only a block being filled can be cached"
    ):
        pool.cache(1, 9)
    assert snapshot(pool) == before


def test_cache_of_a_hash_another_block_holds_returns_false_and_changes_nothing() -> None:
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    assert pool.cache(a, 9)
    before = snapshot(pool)
    assert pool.cache(b, 9) is False
    assert snapshot(pool) == before
    assert pool.cache(a, 9) is True  # the same block again is fine


def test_recaching_a_block_under_a_new_hash_forgets_the_old_one() -> None:
    pool = BlockPool(3)
    (a,) = pool.allocate(1)
    pool.cache(a, 1)
    pool.cache(a, 2)
    assert pool.lookup(1) is None and pool.lookup(2) == a and pool.hash_of(a) == 2


# -- against a reference model -------------------------------------------------------------------------------
NUM_BLOCKS = 6
HASHES = st.integers(0, 7)


class PoolMachine(RuleBasedStateMachine):
    """Drive a tiny pool with valid and invalid calls; a plain-Python model says what must happen."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(NUM_BLOCKS)
        self.refs = {b: 0 for b in range(NUM_BLOCKS)}
        self.hash_of: dict[int, int] = {}
        self.lru: list[int] = []  # cached, unreferenced, oldest first

    # helpers
    def free_blocks(self) -> list[int]:
        return [b for b in range(NUM_BLOCKS) if self.refs[b] == 0 and b not in self.lru]

    def referenced(self) -> list[int]:
        return [b for b in range(NUM_BLOCKS) if self.refs[b] > 0]

    def release(self, b: int) -> None:
        self.refs[b] -= 1
        if self.refs[b] == 0 and b in self.hash_of:
            self.lru.append(b)

    def expect_error(self, error: type[Exception], call: object) -> None:
        before = snapshot(self.pool, range(8))
        with pytest.raises(error):
            call()  # type: ignore[operator]
        assert snapshot(self.pool, range(8)) == before

    # valid calls
    @rule(n=st.integers(0, NUM_BLOCKS + 1))
    def allocate(self, n: int) -> None:
        free, lru = self.free_blocks(), list(self.lru)
        if n > len(free) + len(lru):
            self.expect_error(PoolExhausted, lambda: self.pool.allocate(n))
            return
        got = self.pool.allocate(n)
        assert len(got) == n and len(set(got)) == n, "a block was handed out twice"
        if n <= len(free):
            assert set(got) <= set(free)
        else:
            evicted = lru[: n - len(free)]
            assert set(got) == set(free) | set(evicted), "cached blocks must be evicted oldest first"
            for b in evicted:
                self.lru.remove(b)
                del self.hash_of[b]
        for b in got:
            self.refs[b] = 1

    @rule(k=st.integers(1, 3))
    def allocate_past_the_free_list(self, k: int) -> None:
        self.allocate(len(self.free_blocks()) + k)

    @precondition(lambda self: self.free_blocks())
    @rule(h=HASHES)
    def fill_cache_and_release(self, h: int) -> None:
        if h in self.hash_of.values():
            return
        free = self.free_blocks()
        (b,) = self.pool.allocate(1)
        assert b in free
        assert self.pool.cache(b, h) is True
        self.pool.free([b])
        self.hash_of[b] = h
        self.lru.append(b)

    @precondition(lambda self: self.lru)
    @rule(data=st.data())
    def ref_cached(self, data: st.DataObject) -> None:
        b = data.draw(st.sampled_from(self.lru))
        self.pool.ref([b])
        self.lru.remove(b)
        self.refs[b] += 1

    @precondition(lambda self: any(self.refs.values()))
    @rule(data=st.data())
    def ref_referenced(self, data: st.DataObject) -> None:
        b = data.draw(st.sampled_from(self.referenced()))
        self.pool.ref([b])
        self.refs[b] += 1

    @precondition(lambda self: any(self.refs.values()))
    @rule(data=st.data())
    def unref(self, data: st.DataObject) -> None:
        b = data.draw(st.sampled_from(self.referenced()))
        self.pool.unref([b])
        self.release(b)

    @precondition(lambda self: any(self.refs.values()))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        b = data.draw(st.sampled_from(self.referenced()))
        if self.refs[b] > 1:
            self.expect_error(BlockError, lambda: self.pool.free([b]))
            return
        self.pool.free([b])
        self.release(b)

    @precondition(lambda self: any(self.refs.values()))
    @rule(data=st.data(), h=HASHES)
    def cache(self, data: st.DataObject, h: int) -> None:
        b = data.draw(st.sampled_from(self.referenced()))
        owner = next((x for x, y in self.hash_of.items() if y == h), None)
        result = self.pool.cache(b, h)
        if owner is not None:
            assert result is (owner == b)
            return
        assert result is True
        self.hash_of[b] = h

    @precondition(lambda self: self.lru)
    @rule(data=st.data())
    def evict(self, data: st.DataObject) -> None:
        b = data.draw(st.sampled_from(self.lru))
        self.pool.evict(b)
        self.lru.remove(b)
        del self.hash_of[b]

    # invalid calls: each raises and changes nothing
    @rule(b=st.integers(0, NUM_BLOCKS - 1))
    def misuse(self, b: int) -> None:
        if self.refs[b] == 0:
            self.expect_error(BlockError, lambda: self.pool.free([b]))  # double free
            self.expect_error(BlockError, lambda: self.pool.cache(b, 1))
            if b not in self.lru:
                self.expect_error(BlockError, lambda: self.pool.ref([b]))
                self.expect_error(BlockError, lambda: self.pool.evict(b))
        else:
            self.expect_error(BlockError, lambda: self.pool.evict(b))
            self.expect_error(BlockError, lambda: self.pool.unref([b] * (self.refs[b] + 1)))

    @rule(b=st.sampled_from([-1, NUM_BLOCKS, 2**40]))
    def unknown_id(self, b: int) -> None:
        self.expect_error(BlockError, lambda: self.pool.free([b]))
        self.expect_error(BlockError, lambda: self.pool.ref([b]))

    @invariant()
    def matches_the_model(self) -> None:
        free, referenced, cached = self.free_blocks(), self.referenced(), self.lru
        assert len(free) + len(referenced) + len(cached) == NUM_BLOCKS
        assert self.pool.num_free == len(free) + len(cached)
        assert self.pool.num_referenced == len(referenced)
        assert [self.pool.refcount(b) for b in range(NUM_BLOCKS)] == [self.refs[b] for b in range(NUM_BLOCKS)]
        assert [self.pool.hash_of(b) for b in range(NUM_BLOCKS)] == [
            self.hash_of.get(b) for b in range(NUM_BLOCKS)
        ]
        for b, h in self.hash_of.items():
            assert self.pool.lookup(h) == b


PoolMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None, database=None
)
test_pool_against_a_reference_model = PoolMachine.TestCase


def test_many_ref_release_cycles_keep_lru_order_and_a_bounded_queue() -> None:
    """Thousands of pin/release cycles on cached blocks (what loads do): eviction still takes the least recently
    released first, and the pool's lazily-deleted LRU queue does not grow with the number of cycles."""
    rng = np.random.default_rng(5)
    pool = BlockPool(64)
    blocks = pool.allocate(64)
    assert pool.cache_many(np.array(blocks, dtype=np.int64), list(range(64))).all()
    pool.unref(blocks)
    lru = sorted(blocks)  # the model: released in one call, so in id order
    for _ in range(3000):
        some = rng.choice(64, int(rng.integers(1, 9)), replace=False)
        pool.ref(some)
        pool.unref(some)
        lru = [b for b in lru if b not in set(some.tolist())] + sorted(some.tolist())
    assert len(pool._lru) <= 4 * 64 + 2048  # bounded, not 3000 cycles long
    assert pool.oldest_cached(10) == lru[:10]
    got = pool.allocate(10)
    assert got == lru[:10] and all(pool.hash_of(b) is None for b in got)
    assert pool.num_free == 54 and pool.blocks_of([lru[10], lru[0]]).tolist() == [lru[10], -1]


# -- block tables --------------------------------------------------------------------------------------------
def test_a_block_table_keeps_ids_per_group_in_token_order() -> None:
    table = BlockTable("req-1", group_ids=(0, 1))
    table.append(0, [4, 2])
    table.append(1, np.array([9], dtype=np.int64))
    table.append(0, [7])
    assert table.group_ids == (0, 1)
    np.testing.assert_array_equal(table.ids(0), [4, 2, 7])
    assert table.ids(0).dtype == np.int64
    assert table.as_lists() == ([4, 2, 7], [9])
    assert len(table) == 4


def test_a_new_block_table_has_one_empty_group_by_default() -> None:
    table = BlockTable("req-0")
    assert table.group_ids == (0,) and table.as_lists() == ([],) and len(table) == 0
    assert table.ids(0).shape == (0,)


def test_clearing_a_block_table_returns_every_block_per_group() -> None:
    table = BlockTable("req-2", group_ids=(0, 3))
    table.append(0, [1, 2])
    table.append(3, [5])
    assert table.clear() == {0: [1, 2], 3: [5]}
    assert len(table) == 0 and table.as_lists() == ([], [])


def test_a_group_not_in_the_table_raises_naming_request_and_group() -> None:
    table = BlockTable("req-3", group_ids=(0,))
    with pytest.raises(BlockError, match=r"request 'req-3': group_id=1 is not in its table \(0,\)"):
        table.append(1, [0])
    with pytest.raises(BlockError, match=r"group_id=2"):
        table.ids(2)
    assert len(table) == 0


def test_block_table_ids_free_back_into_their_pools() -> None:
    pools = {0: BlockPool(4), 1: BlockPool(2)}
    table = BlockTable("req-4", group_ids=(0, 1))
    for g, pool in pools.items():
        table.append(g, pool.allocate(2))
    for g, ids in table.clear().items():
        pools[g].free(ids)
    assert [p.num_free for p in pools.values()] == [4, 2]


# -- prefix hashes -------------------------------------------------------------------------------------------
TOKENS = list(range(1000, 1032))  # four blocks of 8


def test_the_same_prefix_gives_the_same_hashes() -> None:
    other = TOKENS[:24] + [7] * 8
    a, b = block_hashes(TOKENS, 8), block_hashes(other, 8)
    assert len(a) == len(b) == 4
    assert a[:3] == b[:3]
    assert a[3] != b[3]


def test_a_change_in_block_zero_changes_every_later_hash() -> None:
    changed = [TOKENS[0] + 1] + TOKENS[1:]
    a, b = block_hashes(TOKENS, 8), block_hashes(changed, 8)
    assert all(x != y for x, y in zip(a, b))


def test_identical_blocks_at_different_positions_hash_differently() -> None:
    hashes = block_hashes([5] * 32, 8)
    assert len(set(hashes)) == 4


def test_the_group_id_changes_every_hash() -> None:
    a, b = block_hashes(TOKENS, 8, group_id=0), block_hashes(TOKENS, 8, group_id=1)
    assert all(x != y for x, y in zip(a, b))


def test_a_partial_tail_block_is_not_hashed() -> None:
    assert block_hashes(TOKENS[:31], 8) == block_hashes(TOKENS[:24], 8)
    assert len(block_hashes(TOKENS[:31], 8)) == 3
    assert block_hashes(TOKENS[:7], 8) == []
    assert block_hashes([], 8) == []


def test_hashes_chain_from_a_given_parent() -> None:
    full = block_hashes(TOKENS, 8)
    assert block_hashes(TOKENS[8:], 8, parent=full[0]) == full[1:]
    assert block_hashes(TOKENS, 8, parent=ROOT_HASH) == full


def test_hashes_are_non_negative_int64_and_independent_of_the_container() -> None:
    hashes = block_hashes(TOKENS, 8)
    assert all(isinstance(h, int) and 0 <= h < 2**63 for h in hashes)
    assert block_hashes(np.array(TOKENS, dtype=np.int32), 8) == hashes
    assert block_hashes(tuple(TOKENS), 8) == hashes
    np.array(hashes, dtype=np.int64)  # fits


@pytest.mark.parametrize("tokens_per_block", [0, -4])
def test_a_block_size_below_one_raises_naming_it(tokens_per_block: int) -> None:
    with pytest.raises(SpecError, match=rf"tokens_per_block={tokens_per_block} must be >= 1"):
        block_hashes(TOKENS, tokens_per_block)


def test_a_negative_group_id_raises_a_kvplane_error_naming_it() -> None:
    with pytest.raises(KvplaneError, match=r"group_id=-1"):
        block_hashes(TOKENS, 8, group_id=-1)


@settings(max_examples=100, deadline=None, database=None)
@given(
    st.lists(st.integers(0, 2**31 - 1), max_size=60),
    st.integers(1, 9),
    st.integers(0, 3),
)
def test_the_hashes_of_a_prefix_are_a_prefix_of_the_hashes(
    tokens: list[int], tokens_per_block: int, group: int
) -> None:
    full = block_hashes(tokens, tokens_per_block, group)
    assert len(full) == len(tokens) // tokens_per_block
    for cut in range(0, len(tokens) + 1, tokens_per_block):
        assert block_hashes(tokens[:cut], tokens_per_block, group) == full[: cut // tokens_per_block]
