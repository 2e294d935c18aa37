"""The store tier's bounds and fallbacks, driven by an in-memory Mooncake Store stand-in whose calls can hang.

A store that hangs or reports itself unhealthy must cost a request at most the configured bound, log one
warning, and leave the host tier working; host blocks a late call may still touch stay pinned until it returns.
The real ``mooncake_master`` versions of these live in ``tests/integration/test_offload_store.py``.
"""

from __future__ import annotations

import logging
import threading
import time

import pytest
from offload_fakes import FakeStoreClient, Harness, fake_tier, small_spec

from kvplane.blocks import block_hashes
from kvplane.flows.offload import MasterError, start_master
from kvplane.flows.offload.keys import block_keys
from kvplane.flows.offload.master import find_master_binary
from kvplane.flows.offload.store import NO_AVAILABLE_HANDLE, RPC_FAIL

BOUND_S = 3.0  # timeout_s is 0.5 in these tests: anything near this bound means a call was waited on


def stored_prefix(client: FakeStoreClient, host_blocks: int = 4) -> tuple[Harness, list[int]]:
    h = Harness(small_spec(), host_blocks=host_blocks, store_tier=fake_tier(client, write_through=True))
    a = block_hashes(range(4), 2)
    h.store("a", a, [1, 2])
    h.engine.wait_idle()
    return h, a


def test_write_through_puts_each_host_block_under_its_prefix_key() -> None:
    client = FakeStoreClient()
    h, a = stored_prefix(client)
    keys = block_keys("kvplane", h.engine.fingerprint, 0, a)
    assert sorted(client.objects) == sorted(keys)
    assert client.objects[keys[0]] == bytes(h.engine.pool.block(0, int(h.engine.index.block_of(0, a[0]) or 0)).numpy())
    assert [size for _, size in client.registered] == [b.numel() for b in h.engine.pool.buffers.values()]


def test_a_store_that_never_finishes_setup_is_skipped_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    hang = threading.Event()
    client = FakeStoreClient(setup_hang=hang)
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="kvplane.offload.store"):
        h = Harness(small_spec(), host_blocks=4, store_tier=fake_tier(client, setup_timeout_s=0.2))
    assert time.monotonic() - start < BOUND_S
    assert "unavailable" in caplog.text and "setup" in caplog.text
    a = block_hashes(range(4), 2)
    h.store("a", a, [1, 2])
    assert h.engine.lookup(block_hashes(range(100, 104), 2)) == 0
    assert client.calls == []  # a store that is down is not asked
    assert h.load("l", a, [5, 6]) == 4
    hang.set()


def test_an_unhealthy_client_is_not_called_and_the_host_tier_carries_on(caplog: pytest.LogCaptureFixture) -> None:
    client = FakeStoreClient()
    h, a = stored_prefix(client)
    client.healthy = False
    assert h.engine.store is not None and not h.engine.store.tier.refresh_health()  # what the monitor does
    calls = len(client.calls)
    with caplog.at_level(logging.WARNING, logger="kvplane.offload.store"):
        assert h.engine.lookup(block_hashes(range(100, 104), 2)) == 0
        assert h.engine.lookup(a) == 4
        h.store("b", block_hashes(range(200, 204), 2), [3, 4])
    assert len(client.calls) == calls
    assert caplog.text.count("unavailable") == 1  # one warning per outage, not one per call
    assert h.load("l", a, [5, 6]) == 4


def test_a_lookup_reads_the_monitored_health_and_never_asks_the_client_itself() -> None:
    # the connector's lookup server runs lookups under the worker lock that save_kv_layer needs
    client = FakeStoreClient()
    h, a = stored_prefix(client)
    tier = h.engine.store.tier if h.engine.store is not None else None
    assert tier is not None and tier.healthy
    longer = block_hashes(range(8), 2)  # a's two blocks in host memory, then two the store is asked about
    calls = len(client.calls)
    for _ in range(3):
        assert h.engine.lookup(longer) == 4
    assert len(client.calls) > calls  # the store was asked about the rest of the prefix
    assert threading.get_ident() not in client.health_threads  # only the monitor thread calls health_check
    client.healthy = False
    assert tier.healthy  # nothing asked yet: the value is the last one seen
    assert not tier.refresh_health() and not tier.healthy
    assert h.engine.lookup(block_hashes(range(100, 104), 2)) == 0


def test_a_health_check_that_hangs_does_not_hold_up_a_lookup() -> None:
    stuck, entered = threading.Event(), threading.Event()

    class StuckHealth(FakeStoreClient):
        def health_check(self) -> int:
            entered.set()
            stuck.wait(20)  # a degraded client: its health RPC does not come back until the test lets it
            return super().health_check()

    client = StuckHealth()
    try:
        h, _ = stored_prefix(client)
        assert entered.wait(20)  # a health check is stuck inside the client now
        answers: list[int] = []
        lookup = threading.Thread(target=lambda: answers.append(h.engine.lookup(block_hashes(range(8), 2))))
        lookup.start()
        lookup.join(10)  # liveness, not speed: a lookup that waited on the stuck call would still be waiting
        assert not lookup.is_alive() and answers == [4]
    finally:
        stuck.set()


def test_a_hanging_lookup_costs_at_most_the_bound(caplog: pytest.LogCaptureFixture) -> None:
    client = FakeStoreClient()
    h, a = stored_prefix(client)
    client.hang = threading.Event()
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="kvplane.offload.store"):
        assert h.engine.lookup([*a, *block_hashes(range(9), 2)[2:]]) == 4
    assert time.monotonic() - start < BOUND_S
    assert "batch_is_exist did not finish" in caplog.text
    client.hang.set()


def test_a_hanging_fetch_loads_the_host_prefix_reports_the_rest_and_pins_until_the_call_returns() -> None:
    client = FakeStoreClient()
    h = Harness(small_spec(), host_blocks=4, store_tier=fake_tier(client))
    a = block_hashes(range(8), 2)
    h.store("a", a, [1, 2, 3, 4])
    h.store("b", block_hashes(range(100, 106), 2), [5, 6, 7])  # evicts a's first 3 blocks: written back
    assert h.engine.index.cached_prefix(0, a) == 0
    assert h.engine.lookup(a) == 8
    client.hang, client.hang_on = threading.Event(), ("get",)
    start = time.monotonic()
    tokens = h.engine.start_load("l", a[:3], [10, 11, 12])
    assert time.monotonic() - start < BOUND_S
    assert tokens == 0
    assert h.engine.get_block_ids_with_load_errors() == {10, 11, 12}
    h.engine.poll()
    assert h.engine.host_blocks_in_use() == 3  # the late get may still write into them
    client.hang.set()
    deadline = time.monotonic() + BOUND_S
    while h.engine.host_blocks_in_use() and time.monotonic() < deadline:
        time.sleep(0.01)
        h.engine.poll()
    assert h.engine.host_blocks_in_use() == 0


def test_a_hanging_put_keeps_its_blocks_from_eviction_until_it_returns() -> None:
    client = FakeStoreClient(hang=threading.Event())
    h = Harness(small_spec(), host_blocks=2, store_tier=fake_tier(client, write_through=True))
    a = block_hashes(range(4), 2)
    h.store("a", a, [1, 2])
    assert h.engine.host_blocks_in_use() == 2  # the put reads them
    start = time.monotonic()
    assert h.store("b", block_hashes(range(50, 54), 2), [3, 4]) == 0  # nothing evictable
    assert time.monotonic() - start < BOUND_S
    assert client.hang is not None
    client.hang.set()
    h.engine.wait_idle()
    assert h.engine.host_blocks_in_use() == 0
    assert h.engine.index.cached_prefix(0, a) == 2


def test_the_store_is_used_again_once_healthy_after_the_retry_interval(caplog: pytest.LogCaptureFixture) -> None:
    client = FakeStoreClient()
    tier = fake_tier(client, retry_after_s=0.05)
    h = Harness(small_spec(), host_blocks=2, store_tier=tier)
    client.healthy = False
    tier.refresh_health()
    assert h.engine.lookup(block_hashes(range(4), 2)) == 0
    client.healthy = True
    tier.refresh_health()
    time.sleep(0.1)
    with caplog.at_level(logging.WARNING, logger="kvplane.offload.store"):
        h.store("a", block_hashes(range(4), 2), [1, 2])
        h.store("b", block_hashes(range(50, 54), 2), [3, 4])
    assert "is back" in caplog.text
    assert len(client.objects) == 2  # a was written back on eviction


def test_start_master_names_a_missing_binary_and_quotes_a_failing_ones_exit() -> None:
    with pytest.raises(MasterError, match="is not an executable file"):
        import os

        os.environ["KVPLANE_MOONCAKE_MASTER"] = "/nonexistent/mooncake_master"
        try:
            find_master_binary()
        finally:
            del os.environ["KVPLANE_MOONCAKE_MASTER"]
    with pytest.raises(MasterError, match="did not start: it exited with code 1"):
        start_master(binary="/bin/false", startup_timeout_s=5)


def test_a_put_answered_with_rpc_fail_turns_the_store_off(caplog: pytest.LogCaptureFixture) -> None:
    # the real client keeps health_check() == 0 for about a second after the master dies, while every call
    # already returns RPC_FAIL (-900): a put must read that as "unreachable", not as a refused block
    client = FakeStoreClient()
    h = Harness(small_spec(), host_blocks=4, store_tier=fake_tier(client, write_through=True))
    client.fail_with = RPC_FAIL
    with caplog.at_level(logging.WARNING, logger="kvplane.offload.store"):
        h.store("a", block_hashes(range(4), 2), [1, 2])
        h.engine.wait_idle()
    assert "RPC_FAIL" in caplog.text
    assert h.engine.store is not None and not h.engine.store.tier.up
    assert h.engine.host_blocks_in_use() == 0
    h.zero([1, 2])
    assert h.load("l", block_hashes(range(4), 2), [1, 2]) == 4  # the host tier still serves the prefix
    assert h.holds(1, block_hashes(range(4), 2)[0])


def test_a_put_refused_for_room_keeps_the_store_on(caplog: pytest.LogCaptureFixture) -> None:
    client = FakeStoreClient(fail_with=NO_AVAILABLE_HANDLE)
    h = Harness(small_spec(), host_blocks=4, store_tier=fake_tier(client, write_through=True))
    with caplog.at_level(logging.WARNING, logger="kvplane.offload.store"):
        h.store("a", block_hashes(range(4), 2), [1, 2])
        h.engine.wait_idle()
    assert "refused 2 put(s)" in caplog.text
    assert h.engine.store is not None and h.engine.store.tier.up
    assert h.engine.store.tier.degradations == 0


def test_closing_an_unreachable_client_neither_waits_on_it_nor_destroys_it() -> None:
    # the real client's destructor retries a dead master for about 5 s, at interpreter exit too: it is parked
    import gc
    import weakref

    client = FakeStoreClient(healthy=False)
    tier = fake_tier(client)
    tier.refresh_health()
    assert not tier.up
    ref = weakref.ref(client)
    start = time.monotonic()
    tier.close()
    assert time.monotonic() - start < BOUND_S
    assert not client.closed
    del tier, client
    gc.collect()
    assert ref() is not None
