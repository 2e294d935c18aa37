"""Bad input and a failing store reach SGLang as its own results (a False per page, a hit count of 0), never as an
exception, a hang or wrong bytes: host indices that do not match the keys, a store with no room, a master that
dies, and one that comes back empty."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import pytest
import torch
from hicache_pools import MiB, extra_config, fill, host, page_bytes, page_hashes, slots, storage_config

from kvplane.flows.offload import MooncakeMaster, start_master

pytestmark = pytest.mark.integration
LOG = "kvplane.sglang"


@pytest.fixture
def own_master() -> Iterator[MooncakeMaster]:
    """A master of this test's own (it is killed, restarted or filled)."""
    m = start_master()
    yield m
    m.stop()


def test_host_indices_that_do_not_match_the_keys_fail_every_page_without_moving_bytes(
    master: MooncakeMaster, backends, caplog: pytest.LogCaptureFixture
) -> None:
    pool = host("mha", "page_first")
    fill(pool, seed=40)
    backend = backends(storage_config(extra_config(master.address, namespace="bad-indices")), pool)
    keys = page_hashes(3, seed=40)
    assert backend.batch_set_v1(keys, slots(pool, [1, 2, 3])) == [True] * 3
    size = pool.page_size
    before = pool.kv_buffer.clone()
    bad = {
        "one page short": slots(pool, [5, 6]),
        "one slot short": slots(pool, [5, 6, 7])[:-1],
        "not page-aligned": slots(pool, [5, 6, 7]) + 1,
        "pages not whole": slots(pool, [5, 6, 7]).flip(0),
        "outside the pool": slots(pool, [5, 6, pool.size // size]),
        "negative": slots(pool, [5, 6, 7]) - 6 * size,
    }
    with caplog.at_level(logging.ERROR, logger=LOG):
        for what, indices in bad.items():
            assert backend.batch_get_v1(keys, indices) == [False] * 3, what
            assert backend.batch_set_v1(page_hashes(3, seed=41), indices) == [False] * 3, what
    assert torch.equal(pool.kv_buffer.view(torch.uint8), before.view(torch.uint8))  # bytes: random bf16 has NaNs
    assert backend.batch_exists(page_hashes(3, seed=41)) == 0
    assert "8 host indices for 3 key(s)" in caplog.text and "11 host indices for 3 key(s)" in caplog.text
    assert "outside the pool" in caplog.text and "not whole pages" in caplog.text


def test_a_store_without_room_refuses_pages_as_false_and_keeps_the_ones_it_took_intact(
    own_master: MooncakeMaster, backends
) -> None:
    # one 16 MiB segment in the whole cluster; 100 pages of 256 KiB do not fit
    geometry = {"layers": 4, "heads": 8, "head_dim": 128, "page": 16, "tokens": 1024}
    pool = host("mha", "page_first", **geometry)
    fill(pool, seed=42)
    backend = backends(storage_config(extra_config(own_master.address, namespace="full", segment_bytes=16 * MiB,
                                                   retry_after_s=3600.0)), pool)
    keys = page_hashes(100, seed=42, page=16)
    stored = backend.batch_set_v1(keys, slots(pool, list(range(100))))
    assert len(stored) == 100 and not all(stored), "16 MiB took 25 MiB of pages"
    assert any(stored)
    reader_pool = host("mha", "page_first", **geometry)
    reader = backends(storage_config(extra_config(own_master.address, namespace="full", segment_bytes=0)),
                      reader_pool)
    taken = [i for i, ok in enumerate(stored) if ok]
    got = reader.batch_get_v1([keys[i] for i in taken], slots(reader_pool, taken))
    size = pool.page_size
    for i, ok in zip(taken, got):  # the master may evict what it took; what comes back is the page written
        if ok:
            assert page_bytes(reader_pool, i * size) == page_bytes(pool, i * size)
    assert backend.pages.tier.refused, "the refusals were counted"
    assert backend.pages.tier.degradations == 0, "a full store is not a store that went away"


def test_a_killed_master_is_a_miss_and_a_failed_write_and_a_restarted_empty_one_misses_until_written_again(
    own_master: MooncakeMaster, backends
) -> None:
    pool = host("mha", "page_first")
    fill(pool, seed=43)
    backend = backends(storage_config(extra_config(own_master.address, namespace="restart", timeout_s=1.0,
                                                   retry_after_s=1.0, health_interval_s=0.2)), pool)
    keys, later = page_hashes(3, seed=43), page_hashes(3, seed=44)
    assert backend.batch_set_v1(keys, slots(pool, [1, 2, 3])) == [True] * 3
    written = [page_bytes(pool, p * pool.page_size) for p in (1, 2, 3)]

    own_master.kill()
    assert backend.batch_exists(keys) == 0
    assert backend.batch_get_v1(keys, slots(pool, [4, 5, 6])) == [False] * 3
    assert backend.batch_set_v1(later, slots(pool, [7, 8, 9])) == [False] * 3

    again = start_master(port=own_master.port)  # the same address, none of the objects
    try:
        tier = backend.pages.tier
        for _ in range(240):  # the tier retries once retry_after_s has passed and the client reports healthy
            if tier.up:
                break
            time.sleep(0.25)
        assert tier.up, "the tier never came back on with the restarted master"
        assert backend.batch_exists(keys) == 0
        assert backend.batch_get_v1(keys, slots(pool, [4, 5, 6])) == [False] * 3
        # the client's health lags its master: it said healthy before its ping found the connection dead, then
        # unreachable while it reconnected, and it mounts its segment on the new master after that. Puts meanwhile
        # fail as misses (refused -200 with no segment, or not made while the tier is off: CI saw both); then the
        # restarted master takes them
        for _ in range(240):
            taken = backend.batch_set_v1(later, slots(pool, [7, 8, 9]))
            if taken == [True] * 3:
                break
            assert taken == [False] * 3, taken
            time.sleep(0.25)
        assert taken == [True] * 3, f"the restarted master never took a put (refused {tier.refused})"
        assert backend.batch_get_v1(later, slots(pool, [10, 11, 12])) == [True] * 3
        size = pool.page_size
        assert [page_bytes(pool, p * size) for p in (10, 11, 12)] == [page_bytes(pool, p * size) for p in (7, 8, 9)]
        assert [page_bytes(pool, p * size) for p in (1, 2, 3)] == written
    finally:
        backend.close()
        again.stop()
