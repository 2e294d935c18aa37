"""The offload engine's host tier on the cpu backend: bytes, prefixes, eviction, aborts and layer-wise order.

Copies that must still be running at some point are held at a gate on the copy stream (``GatedCpu``), so
every ordering claim here is deterministic: nothing depends on how fast a thread runs.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from offload_fakes import GatedCpu, Harness, small_spec

from kvplane.blocks import block_hashes
from kvplane.errors import BlockError
from kvplane.flows.offload import OffloadConfig, OffloadConfigError, OffloadEngine, OffloadError
from kvplane.kv.binding import allocate_cache
from kvplane.kv.bound import bind
from kvplane.kv.spec import KVSpec

JOIN_S = 10.0  # a hook that should return does so at once; this only turns a hang into a failure


def hashes_of(tokens: range | list[int], tokens_per_block: int = 2) -> list[int]:
    return block_hashes(list(tokens), tokens_per_block)


def in_thread(fn: object) -> threading.Thread:
    t = threading.Thread(target=fn, daemon=True)  # type: ignore[arg-type]
    t.start()
    return t


@pytest.mark.parametrize(
    ("family", "layout"),
    [("gqa", "packed_kv"), ("gqa", "split_kv"), ("gqa", "kv_first"), ("mla", "mla_fused"), ("mla", "mla_split")],
)
def test_blocks_stored_from_scattered_device_blocks_load_back_byte_exactly_in_every_layout(
    family: str, layout: str
) -> None:
    spec = small_spec() if family == "gqa" else KVSpec.mla(3, kv_lora_rank=16, rope_dim=8, tokens_per_block=2)
    h = Harness(spec, host_blocks=8, layouts=layout)
    hashes = hashes_of(range(11))  # 5 full blocks; the partial tail is never cached
    assert h.store("r1", hashes, [9, 3, 17, 4, 30]) == 5
    assert h.engine.get_finished() == ({"r1"}, set())
    assert h.engine.lookup(hashes) == 10
    assert h.load("r2", hashes, [40, 41, 7, 50, 2]) == 10
    assert h.engine.get_finished() == (set(), {"r2"})
    assert all(h.holds(b, x) for b, x in zip([40, 41, 7, 50, 2], hashes))
    assert h.engine.host_blocks_in_use() == 0


def test_lookup_counts_leading_cached_blocks_only_and_changes_nothing() -> None:
    h = Harness(small_spec(), host_blocks=3)
    a = hashes_of(range(6))
    h.store("a", a, [1, 2, 3])
    pools = h.engine.index.pools[0]
    before = (pools.oldest_cached(10), pools.num_referenced, pools.num_free)
    assert h.engine.lookup(a) == 6
    assert h.engine.lookup(a[:2]) == 4
    assert h.engine.lookup(hashes_of([9, 9, *range(2, 6)])) == 0  # another first block: no prefix
    assert (pools.oldest_cached(10), pools.num_referenced, pools.num_free) == before


def test_the_host_pool_never_takes_more_memory_than_configured() -> None:
    backend = GatedCpu()
    spec = small_spec()
    cache = allocate_cache(spec, backend.layouts, 8)
    per_block = spec.bytes_per_token * 2
    engine = OffloadEngine(bind(backend, spec, cache), OffloadConfig(host_bytes=5 * per_block - 1))
    assert engine.pool.num_blocks == 4
    assert backend.host_bytes == engine.pool.nbytes <= 5 * per_block - 1


def test_a_host_budget_below_one_block_is_an_error_naming_the_field_and_the_minimum() -> None:
    spec = small_spec()
    cache = allocate_cache(spec, "packed_kv", 4)
    with pytest.raises(OffloadConfigError, match=r"host_bytes=100 .*host_bytes >= 384"):
        OffloadEngine(bind(GatedCpu(), spec, cache), OffloadConfig(host_bytes=100))


def test_the_least_recently_used_prefix_is_evicted_first_and_a_stored_block_is_touched() -> None:
    h = Harness(small_spec(), host_blocks=4)
    a, b, c = hashes_of(range(4)), hashes_of(range(100, 104)), hashes_of(range(200, 204))
    h.store("a", a, [1, 2])
    h.store("b", b, [3, 4])
    h.store("a2", a, [1, 2])  # already cached: nothing copied, but a becomes most recently used
    h.store("c", c, [5, 6])
    assert h.engine.lookup(a) == 4
    assert h.engine.lookup(b) == 0
    assert h.engine.lookup(c) == 4


def test_eviction_under_pressure_never_takes_a_block_being_loaded() -> None:
    backend = GatedCpu()
    h = Harness(small_spec(), host_blocks=4, backend=backend)
    a = hashes_of(range(8))
    h.store("a", a, [1, 2, 3, 4])
    h.engine.get_finished()
    h.zero([10, 11, 12, 13])
    backend.calls = 0
    gate = backend.gate(0)  # the first layer's H2D waits: the load stays in flight
    assert h.engine.start_load("load-a", a, [10, 11, 12, 13]) == 8
    assert h.engine.host_blocks_in_use() == 4
    others = hashes_of(range(300, 308))
    assert h.store("pressure", others, [20, 21, 22, 23]) == 0  # every host block is pinned by the load
    gate.set()
    for name in h.spec.layer_names:
        h.engine.wait_for_layer(name)
    h.engine.wait_idle()
    assert h.engine.get_finished() == ({"pressure"}, {"load-a"})
    assert all(h.holds(b, x) for b, x in zip([10, 11, 12, 13], a))
    assert h.engine.host_blocks_in_use() == 0


def test_eviction_under_pressure_never_takes_a_block_being_stored() -> None:
    backend = GatedCpu()
    h = Harness(small_spec(), host_blocks=4, backend=backend)
    a = hashes_of(range(6))
    for blk, x in zip([1, 2, 3], a):
        h.write(blk, x)
    backend.calls = 0
    gate = backend.gate(0)
    assert h.engine.start_store("a", a, [1, 2, 3]) == 3
    h.engine.save_layer(h.spec.layer_names[0])  # held at the gate: a's host blocks are mid-copy
    b = hashes_of(range(50, 56))
    assert h.engine.start_store("b", b, [4, 5, 6]) == 1  # only the one free block: a's are mid-copy
    gate.set()
    h.engine.wait_for_save()
    assert h.engine.get_finished()[0] == {"a", "b"}
    h.zero([1, 2, 3])
    assert h.load("la", a, [1, 2, 3]) == 6
    assert all(h.holds(b, x) for b, x in zip([1, 2, 3], a))


@pytest.mark.parametrize("saved_layers", [0, 1, 2])
def test_a_request_aborted_mid_store_leaks_no_host_block_and_caches_nothing(saved_layers: int) -> None:
    backend = GatedCpu()
    h = Harness(small_spec(layers=3), host_blocks=6, backend=backend)
    a = hashes_of(range(8))
    for blk, x in zip([1, 2, 3, 4], a):
        h.write(blk, x)
    backend.calls = 0
    gate = backend.gate(0)
    h.engine.start_store("a", a, [1, 2, 3, 4])
    for name in h.spec.layer_names[:saved_layers]:
        h.engine.save_layer(name)
    h.engine.abort("a")
    assert h.engine.host_blocks_in_use() == 4  # held until the copies already enqueued have drained
    assert h.engine.get_finished() == (set(), set()) or saved_layers == 0
    gate.set()
    h.engine.wait_idle()
    h.engine.get_finished()
    assert h.engine.host_blocks_in_use() == 0
    assert h.engine.index.pools[0].num_unused == 6  # free, not cached
    assert h.engine.lookup(a) == 0
    h.engine.save_layer(h.spec.layer_names[-1])  # later hooks do nothing for the aborted request
    assert h.engine.host_blocks_in_use() == 0


def test_an_abort_after_every_layer_was_enqueued_waits_for_the_copies_then_frees() -> None:
    backend = GatedCpu()
    h = Harness(small_spec(layers=2), host_blocks=4, backend=backend)
    a = hashes_of(range(4))
    backend.calls = 0
    gate = backend.gate(1)
    h.engine.start_store("a", a, [1, 2])
    for name in h.spec.layer_names:
        h.engine.save_layer(name)
    h.engine.abort("a")
    assert h.engine.get_finished() == (set(), set())  # the device blocks are still being read
    gate.set()
    h.engine.wait_idle()
    assert h.engine.get_finished() == ({"a"}, set())
    assert h.engine.host_blocks_in_use() == 0
    assert h.engine.lookup(a) == 0


def test_an_aborted_load_releases_its_pins_once_drained() -> None:
    backend = GatedCpu()
    h = Harness(small_spec(), host_blocks=4, backend=backend)
    a = hashes_of(range(4))
    h.store("a", a, [1, 2])
    h.engine.get_finished()
    backend.calls = 0
    gate = backend.gate(0)
    h.engine.start_load("l", a, [5, 6])
    h.engine.abort("l")
    assert h.engine.host_blocks_in_use() == 2
    gate.set()
    h.engine.wait_idle()
    assert h.engine.get_finished() == (set(), {"l"})
    assert h.engine.host_blocks_in_use() == 0
    assert h.engine.lookup(a) == 4  # the prefix stays cached


def test_wait_for_layer_returns_while_the_next_layers_copy_is_still_held() -> None:
    backend = GatedCpu()
    h = Harness(small_spec(layers=4), host_blocks=4, backend=backend)
    a = hashes_of(range(4))
    h.store("a", a, [1, 2])
    h.zero([5, 6])
    backend.calls = 0
    gate = backend.gate(2)  # layer 2's H2D
    assert h.engine.start_load("l", a, [5, 6]) == 4
    names = h.spec.layer_names
    first = in_thread(lambda: [h.engine.wait_for_layer(n) for n in names[:2]])
    first.join(JOIN_S)
    assert not first.is_alive(), "wait_for_layer(1) waited for more than layer 1"
    per_layer = len(h.slots) // len(names)  # slots are in layer order
    layer2 = h.slot_bytes(2 * per_layer)  # layer 2's first slot
    assert not layer2[5].any(), "layer 2 was copied although its copy is held"
    third = in_thread(lambda: h.engine.wait_for_layer(names[2]))
    third.join(0.05)
    assert third.is_alive(), "wait_for_layer(2) returned before layer 2 was copied"
    gate.set()
    third.join(JOIN_S)
    assert not third.is_alive()
    h.engine.wait_for_layer(names[3])
    h.engine.wait_idle()
    assert all(h.holds(b, x) for b, x in zip([5, 6], a))


def test_save_layer_returns_at_once_and_wait_for_save_waits_for_the_copies() -> None:
    backend = GatedCpu()
    h = Harness(small_spec(layers=2), host_blocks=4, backend=backend)
    a = hashes_of(range(4))
    for blk, x in zip([1, 2], a):
        h.write(blk, x)
    backend.calls = 0
    gate = backend.gate(0)
    h.engine.start_store("a", a, [1, 2])
    saver = in_thread(lambda: [h.engine.save_layer(n) for n in h.spec.layer_names])
    saver.join(JOIN_S)
    assert not saver.is_alive()
    assert h.engine.get_finished() == (set(), set())
    waiter = in_thread(h.engine.wait_for_save)
    waiter.join(0.05)
    assert waiter.is_alive()
    gate.set()
    waiter.join(JOIN_S)
    assert h.engine.get_finished() == ({"a"}, set())


def test_wait_for_save_copies_layers_no_save_layer_covered() -> None:
    h = Harness(small_spec(layers=3), host_blocks=4)
    a = hashes_of(range(4))
    for blk, x in zip([1, 2], a):
        h.write(blk, x)
    h.engine.start_store("a", a, [1, 2])
    h.engine.save_layer(h.spec.layer_names[1])
    h.engine.wait_for_save()
    assert h.load("l", a, [8, 9]) == 4
    assert all(h.holds(b, x) for b, x in zip([8, 9], a))


def test_a_load_of_blocks_evicted_since_lookup_loads_the_prefix_and_reports_the_rest() -> None:
    h = Harness(small_spec(), host_blocks=2)
    a = hashes_of(range(6))
    assert h.store("a", a, [1, 2, 3]) == 2  # the pool holds two blocks: the leading two are kept
    assert h.engine.lookup(a) == 4
    assert h.load("l", a, [7, 8, 9]) == 4
    assert h.engine.get_block_ids_with_load_errors() == {9}
    assert h.engine.get_block_ids_with_load_errors() == set()


def test_several_loads_in_one_step_share_one_copy_per_layer() -> None:
    backend = GatedCpu()
    h = Harness(small_spec(layers=3), host_blocks=6, backend=backend)
    a, b = hashes_of(range(4)), hashes_of(range(50, 54))
    h.store("a", a, [1, 2])
    h.store("b", b, [3, 4])
    backend.calls = 0
    got = h.engine.start_loads([("la", a, [10, 11]), ("lb", b, [12, 13])])
    assert got == {"la": 4, "lb": 4}
    assert backend.calls == 3
    h.engine.wait_idle()
    assert h.engine.get_finished()[1] == {"la", "lb"}
    assert all(h.holds(d, x) for d, x in zip([10, 11, 12, 13], [*a, *b]))


def test_hybrid_models_key_each_group_on_its_own() -> None:
    spec = KVSpec.gqa(4, 2, 8, layer_groups=[0, 1, 0, 1], group_tokens_per_block={0: 2, 1: 4})
    h = Harness(spec, host_blocks=4)
    toks = list(range(8))
    hashes = {0: block_hashes(toks, 2, 0), 1: block_hashes(toks, 4, 1)}
    ids = {0: [1, 2, 3, 4], 1: [5, 6]}
    for g, hs in hashes.items():
        for blk, x in zip(ids[g], hs):
            h.write(blk, x)  # writes every slot; the groups' layers read their own
    assert h.engine.start_store("r", hashes, ids) == 6
    h.engine.wait_for_save()
    assert h.engine.lookup(hashes) == 8
    assert h.engine.lookup({0: hashes[0], 1: hashes[1][:1]}) == 4
    h.engine.start_load("l", hashes, {0: [10, 11, 12, 13], 1: [14, 15]})
    h.engine.wait_idle()
    for layer_slot, st in enumerate(h.slots):
        group = spec.layers[layer_slot // (len(h.slots) // len(spec.layers))].group_id
        src, dst = ids[group], {0: [10, 11, 12, 13], 1: [14, 15]}[group]
        rows = h.slot_bytes(layer_slot)
        assert bool((rows[src] == rows[dst]).all())
    with pytest.raises(OffloadError, match="pass \\{group_id: ...\\}"):
        h.engine.lookup(hashes[0])


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda e: e.save_layer("nope"), "layer_name='nope' is not in the KV spec"),
        (lambda e: e.wait_for_layer("nope"), "layer_name='nope'"),
        (lambda e: e.start_store("r", [1, 2], [1]), "2 block hashes but 1 device block ids"),
        (lambda e: e.start_load("r", {7: [1]}, {7: [1]}), "group id\\(s\\) \\[7\\]"),
    ],
)
def test_misuse_raises_offload_errors_naming_the_value(call: object, message: str) -> None:
    h = Harness(small_spec(), host_blocks=2)
    with pytest.raises(OffloadError, match=message):
        call(h.engine)  # type: ignore[operator]


def test_storing_a_request_twice_before_it_finished_is_an_error() -> None:
    h = Harness(small_spec(), host_blocks=4)
    h.engine.start_store("r", hashes_of(range(2)), [1])
    with pytest.raises(OffloadError, match="already storing"):
        h.engine.start_store("r", hashes_of(range(2)), [1])


def test_offload_config_from_dict_rejects_unknown_keys_and_bad_values() -> None:
    cfg = OffloadConfig.from_dict({"host_bytes": 1 << 20, "store": {"master_address": "127.0.0.1:5"}})
    assert cfg.store is not None and cfg.store.master_address == "127.0.0.1:5"
    with pytest.raises(OffloadConfigError, match="unknown key"):
        OffloadConfig.from_dict({"host_bytes": 1, "hostbytes": 2})
    with pytest.raises(OffloadConfigError, match="master_address='nope' is not host:port"):
        OffloadConfig.from_dict({"host_bytes": 1, "store": {"master_address": "nope"}})
    with pytest.raises(OffloadConfigError, match="host_bytes=0"):
        OffloadConfig(host_bytes=0)


def test_layers_saved_while_the_save_stream_is_busy_go_as_one_copy_and_land_byte_exactly() -> None:
    backend = GatedCpu()
    h = Harness(small_spec(layers=4), host_blocks=8, backend=backend)
    gate = backend.gate(0)  # layer 0's copy holds the save stream
    hashes = hashes_of(range(6))
    for b, hsh in zip([5, 9, 2], hashes):
        h.write(b, hsh)
    h.engine.start_store("r", hashes, [5, 9, 2])
    for name in h.spec.layer_names:
        h.engine.save_layer(name)
    assert backend.calls == 2  # layer 0 alone, then layers 1-3 as one plan once the job was complete
    gate.set()
    h.engine.wait_for_save()
    assert h.engine.get_finished() == ({"r"}, set())
    h.zero([5, 9, 2])
    assert h.load("l", hashes, [20, 21, 22]) == 6
    assert all(h.holds(b, hsh) for b, hsh in zip([20, 21, 22], hashes))


def test_an_abort_enqueues_its_waiting_layers_and_frees_its_blocks_only_after_they_ran() -> None:
    backend = GatedCpu()
    h = Harness(small_spec(layers=4), host_blocks=8, backend=backend)
    gate = backend.gate(0)
    h.engine.start_store("r", hashes_of(range(4)), [1, 2])
    h.engine.save_layer(h.spec.layer_names[0])
    h.engine.save_layer(h.spec.layer_names[1])  # waits: the stream is busy
    h.engine.abort("r")
    assert backend.calls == 2  # the waiting layer was enqueued before the abort's event
    assert h.engine.get_finished() == (set(), set())
    assert h.engine.host_blocks_in_use() == 2  # copies still write into them
    gate.set()
    h.engine.wait_for_save()
    assert h.engine.get_finished() == ({"r"}, set())
    assert h.engine.host_blocks_in_use() == 0
    assert h.engine.lookup(hashes_of(range(4))) == 0  # an aborted store caches nothing


def test_caching_many_blocks_at_once_matches_caching_them_one_by_one() -> None:
    from kvplane.blocks.pool import BlockPool

    rng = np.random.default_rng(3)
    one, many = BlockPool(16), BlockPool(16)
    for pool in (one, many):
        pool.allocate(16)
    for _ in range(5):  # re-keying blocks, hashes other blocks already hold, and repeats within one call
        ids = rng.integers(0, 16, 12)
        hashes = [int(h) for h in rng.integers(0, 10, 12)]
        want = [one.cache(int(b), h) for b, h in zip(ids, hashes)]
        assert many.cache_many(ids.astype(np.int64), hashes).tolist() == want
        assert many._block_of == one._block_of and many._hash_of.tolist() == one._hash_of.tolist()
    many.unref(np.arange(3, dtype=np.int64))
    with pytest.raises(BlockError, match="block 0 is not referenced"):
        many.cache_many(np.array([5, 0], dtype=np.int64), [1, 2])
