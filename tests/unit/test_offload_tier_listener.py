"""The offload tiers tell their ``TierListener`` when a block becomes loadable and when it goes: a host block
once its copy completed and it is keyed (with the caller's tag), an eviction just before the block is reused
(exactly the blocks whose keys vanish), a store object once the store answered its put with success, and a key
a get found missing. A save that did not complete (aborted, refused by the store) is never announced."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from offload_fakes import FakeStoreClient, GatedCpu, Harness, fake_tier, small_spec

from kvplane.blocks import block_hashes
from kvplane.flows.offload.index import HostIndex
from kvplane.flows.offload.keys import block_keys
from kvplane.flows.offload.store import NO_AVAILABLE_HANDLE


@dataclass
class Heard:
    """A listener that writes down what it was told, host ids as lists."""

    index: HostIndex | None = None
    calls: list[tuple[str, int, list[Any]]] = field(default_factory=list)
    evicted_keys: list[int] = field(default_factory=list)

    def host_cached(self, group: int, host_ids: Any, tags: Any) -> None:
        self.calls.append(("cached", group, list(tags) if tags is not None else host_ids.tolist()))

    def host_evicted(self, group: int, host_ids: Any) -> None:
        if self.index is not None:  # their keys, read while they still hold them
            self.evicted_keys += self.index.pools[group].keys_of(host_ids).tolist()
        self.calls.append(("evicted", group, host_ids.tolist()))

    def store_written(self, group: int, host_ids: Any) -> None:
        self.calls.append(("written", group, host_ids.tolist()))

    def store_missing(self, group: int, hashes: list[Any]) -> None:
        self.calls.append(("missing", group, list(hashes)))

    def of(self, kind: str) -> list[list[Any]]:
        return [ids for k, _, ids in self.calls if k == kind]


def gated() -> tuple[Harness, Any, Heard]:
    """An engine whose copies wait at a gate, and what its listener heard."""
    backend = GatedCpu()
    gate = backend.gate(0)
    h = Harness(small_spec(), host_blocks=8, backend=backend)
    heard = Heard()
    h.engine.listen(heard)
    return h, gate, heard


def store(h: Harness, rid: str, hashes: list[int], device_ids: list[int], tags: list[Any]) -> None:
    for b, x in zip(device_ids, hashes):
        h.write(b, x)
    h.engine.start_store(rid, hashes, device_ids, {0: tags})
    for name in h.spec.layer_names:
        h.engine.save_layer(name)


def test_a_block_is_announced_with_its_tag_once_its_copy_completed_and_never_again() -> None:
    h, gate, heard = gated()
    a = block_hashes(range(6), 2)
    store(h, "a", a[:2], [1, 2], ["t0", "t1"])
    assert h.engine.get_finished() == (set(), set()) and heard.calls == []  # the copy waits at the gate
    gate.set()
    h.engine.wait_for_save()
    assert heard.calls == [("cached", 0, ["t0", "t1"])]
    store(h, "b", a, [1, 2, 3], ["t0", "t1", "t2"])
    h.engine.wait_for_save()
    assert heard.of("cached") == [["t0", "t1"], ["t2"]]  # the first two were cached already


def test_an_aborted_store_announces_nothing() -> None:
    h, gate, heard = gated()
    store(h, "a", block_hashes(range(4), 2), [1, 2], ["t0", "t1"])
    h.engine.abort("a")
    gate.set()
    h.engine.wait_idle()
    assert h.engine.get_finished()[0] == {"a"} and heard.calls == []


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 6), st.integers(0, 6)), min_size=1, max_size=25))
def test_the_index_reports_exactly_the_cached_blocks_an_allocation_evicts(steps: list[tuple[int, int]]) -> None:
    index = HostIndex([0], 8)
    heard = Heard(index)
    index.listener = heard
    cached: set[int] = set()
    fresh = iter(range(1, 1 << 20))
    for n, keep in steps:
        heard.evicted_keys.clear()
        ids = index.allocate(0, n)
        hashes = [next(fresh) for _ in ids]
        gone = {k for k in cached if index.block_of(0, k) is None}
        assert sorted(heard.evicted_keys) == sorted(gone)
        cached -= gone
        kept = min(keep, len(ids))
        index.cache(0, ids[:kept], hashes[:kept])
        cached |= set(hashes[:kept])
        index.release(0, ids)


def test_the_store_announces_the_blocks_whose_put_it_took_and_not_those_it_refused() -> None:
    client = FakeStoreClient()
    h = Harness(small_spec(), host_blocks=8, store_tier=fake_tier(client, write_through=True))
    heard = Heard()
    h.engine.listen(heard)
    store(h, "a", block_hashes(range(4), 2), [1, 2], ["t0", "t1"])
    h.engine.wait_idle()
    [cached] = heard.of("cached")
    assert cached == ["t0", "t1"] and len(heard.of("written")) == 1 and len(heard.of("written")[0]) == 2
    client.fail_with = NO_AVAILABLE_HANDLE  # a full segment: every put refused
    store(h, "b", block_hashes(range(100, 104), 2), [3, 4], ["t2", "t3"])
    h.engine.wait_idle()
    assert heard.of("cached")[-1] == ["t2", "t3"] and len(heard.of("written")) == 1


def test_a_get_that_finds_no_object_names_the_missing_key() -> None:
    client = FakeStoreClient()
    h = Harness(small_spec(), host_blocks=4, store_tier=fake_tier(client, write_through=True))
    heard = Heard()
    h.engine.listen(heard)
    a = block_hashes(range(4), 2)
    store(h, "a", a, [1, 2], ["t0", "t1"])
    h.engine.wait_idle()
    del client.objects[block_keys("kvplane", h.engine.fingerprint, 0, [a[1]])[0]]  # the store evicted it
    store(h, "b", block_hashes(range(100, 108), 2), [3, 4, 5, 6], ["u0", "u1", "u2", "u3"])  # a leaves the host
    h.engine.wait_idle()
    assert heard.of("evicted") and h.engine.index.cached_prefix(0, a) == 0
    loaded = h.engine.start_loads([("l", a, [7, 8])], {"l": {0: np.array([True, True])}})
    h.engine.wait_idle()
    assert loaded == {"l": 2} and heard.of("missing") == [[a[1]]]
