"""A load from the store tier asks the store only where its caller lets it (real ``mooncake_master``, cpu
backend): with ``loads_presence``'s answer (asked before the caller's lock) or a lookup's remembered answer for
the same keys, ``start_loads`` makes no ``batch_is_exist`` call; a remembered answer for other keys is not used.
Failed on main: ``start_loads`` took no answer and asked the store itself (``remember_presence`` and
``loads_presence`` did not exist)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from offload_fakes import Harness, small_spec

from kvplane.blocks import block_hashes
from kvplane.flows.offload import MooncakeMaster, StoreConfig
from kvplane.flows.offload.store import StoreTier

pytestmark = pytest.mark.integration
MiB = 1 << 20


class Counting:
    """The tier's real ``exists``, counted."""

    def __init__(self, real: Any) -> None:
        self.real, self.calls = real, 0

    def __call__(self, keys: Any) -> Any:
        self.calls += 1
        return self.real(keys)


def stored_then_dropped(master: MooncakeMaster, namespace: str) -> tuple[Harness, list[int], Counting]:
    """A harness whose prefix ``a`` (2 blocks) is in the store only, and a counter on the tier's ``exists``."""
    tier = StoreTier(StoreConfig(master.address, segment_bytes=32 * MiB, local_buffer_bytes=16 * MiB,
                                 write_through=True, timeout_s=10.0, namespace=namespace, retry_after_s=3600.0))
    h = Harness(small_spec(), host_blocks=2, store_tier=tier)
    a = block_hashes(range(300, 304), 2)
    for b, x in zip([1, 2], a):
        h.write(b, x)
    assert h.engine.start_store("a", {0: a}, {0: [1, 2]}) == 2
    for name in h.spec.layer_names:
        h.engine.save_layer(name)
    h.engine.wait_for_save()
    h.engine.wait_idle()
    index = h.engine.index
    index.release(0, index.allocate(0, index.pools[0].num_free))  # the host tier drops a
    assert index.cached_prefix(0, a) == 0
    counter = Counting(tier.exists)
    tier.exists = counter  # type: ignore[method-assign]
    return h, a, counter


def load(h: Harness, a: list[int], in_store: Any = None) -> int:
    tokens = h.engine.start_loads([("b", {0: a}, {0: [5, 6]})], in_store)["b"]
    h.engine.wait_idle()
    h.engine.get_finished()
    return tokens


def test_a_load_asked_before_the_lock_makes_no_store_query_under_it(master: MooncakeMaster) -> None:
    h, a, counter = stored_then_dropped(master, "store2-presence-asked")
    try:
        asked = h.engine.loads_presence([("b", {0: a})])  # outside the caller's lock
        assert counter.calls == 1 and bool(asked["b"][0].all())
        assert load(h, a, asked) == 4
        assert counter.calls == 1, "start_loads asked the store again"
        assert h.holds(5, a[0]) and h.holds(6, a[1])
    finally:
        h.engine.close()


def test_a_lookups_remembered_answer_serves_the_load_of_a_later_run_of_its_keys(master: MooncakeMaster) -> None:
    h, a, counter = stored_then_dropped(master, "store2-presence-kept")
    try:
        presence = h.engine.store_presence({0: a})
        assert presence is not None
        h.engine.remember_presence("b", {0: a}, presence)
        assert h.engine.loads_presence([("b", {0: a[1:]})]) == {}  # a run of the asked keys: nothing to ask
        assert counter.calls == 1
        tokens = h.engine.start_loads([("b", {0: a[1:]}, {0: [6]})])["b"]
        h.engine.wait_idle()
        assert tokens == 2 and counter.calls == 1, "the load asked the store again"
        h.engine.forget_presence("b")
        assert h.engine.loads_presence([("b", {0: a})]) != {}  # forgotten: asked again
    finally:
        h.engine.close()


def test_a_remembered_answer_for_other_keys_is_not_used(master: MooncakeMaster) -> None:
    h, a, counter = stored_then_dropped(master, "store2-presence-other")
    try:
        other = block_hashes(range(900, 904), 2)
        h.engine.remember_presence("b", {0: other}, {0: np.ones(2, dtype=bool)})
        asked = h.engine.loads_presence([("b", {0: a})])
        assert counter.calls == 1 and "b" in asked
        assert load(h, a, asked) == 4 and h.holds(5, a[0])
    finally:
        h.engine.close()
