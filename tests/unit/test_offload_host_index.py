"""``HostIndex.allocate`` and its eviction hook: every block it evicts was shown to ``before_evict`` first.

The store tier's hook writes victims back and keeps those whose write-back is still in flight referenced
(``StoreLink.before_evict``); the allocation must then not evict other cached blocks behind the hook's back.
Driven over the native pool and the ``BlockPool`` fallback alike.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvplane.blocks.groups import Ids
from kvplane.flows.offload.index import HostIndex
from kvplane.flows.offload.keyed_pool import KeyedPool

BLOCKS = 6
HASHES = list(range(100, 100 + BLOCKS))


def full_index(native: bool) -> HostIndex:
    """Every block cached under ``HASHES`` (in that LRU order), none referenced."""
    index = HostIndex([0], BLOCKS)
    index.pools[0] = KeyedPool(BLOCKS, native=native)
    ids = index.allocate(0, BLOCKS)
    assert index.cache(0, ids, HASHES).all()
    index.release(0, ids)
    return index


class PinningHook:
    """Records what it was shown; pins the victims of its first ``pin_calls`` calls, as a write-back in flight."""

    def __init__(self, index: HostIndex, pin_calls: int = 1) -> None:
        self.index, self.pin_calls = index, pin_calls
        self.shown: list[tuple[list[int], list[int]]] = []

    def __call__(self, group: int, victims: Ids, hashes: Ids) -> None:
        self.shown.append((np.asarray(victims).tolist(), np.asarray(hashes).tolist()))
        if len(self.shown) <= self.pin_calls:
            self.index.ref(group, np.asarray(victims, dtype=np.int64))


def evicted(index: HostIndex) -> set[int]:
    return {h for h in HASHES if index.block_of(0, h) is None}


@pytest.mark.parametrize("native", [True, False])
def test_blocks_pinned_by_the_hook_are_not_replaced_by_victims_it_never_saw(native: bool) -> None:
    index = full_index(native)
    hook = PinningHook(index)
    got = index.allocate(0, 2, hook)
    shown_hashes = {h for _, hashes in hook.shown for h in hashes}
    assert evicted(index) <= shown_hashes  # nothing was evicted without a write-back
    assert evicted(index) == {102, 103}  # the two pinned ones stay cached; the next two oldest go, shown first
    assert len(got) == 2
    for ids, hashes in hook.shown:  # the hook is told each victim's own hash, each victim once
        assert hashes == [HASHES[b] for b in ids]
    shown_ids = [b for ids, _ in hook.shown for b in ids]
    assert len(shown_ids) == len(set(shown_ids))


@pytest.mark.parametrize("native", [True, False])
def test_a_hook_that_keeps_pinning_leaves_the_allocation_short_and_evicts_nothing_unseen(native: bool) -> None:
    index = full_index(native)
    hook = PinningHook(index, pin_calls=BLOCKS)
    got = index.allocate(0, 2, hook)
    assert len(got) == 0  # a cache stores what fits: every cached block is being written back
    assert evicted(index) == set()
    assert sorted(h for _, hashes in hook.shown for h in hashes) == HASHES


@pytest.mark.parametrize("native", [True, False])
def test_without_pins_the_hook_sees_exactly_the_oldest_victims_once(native: bool) -> None:
    index = full_index(native)
    hook = PinningHook(index, pin_calls=0)
    got = index.allocate(0, 3, hook)
    assert len(got) == 3
    assert hook.shown == [([0, 1, 2], [100, 101, 102])]
    assert evicted(index) == {100, 101, 102}
