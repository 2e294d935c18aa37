"""kvplane's store tier under vLLM's own ``TieringOffloadingManager``, against a real ``mooncake_master``.

Two instances (two managers, each with its own primary tier and its own Mooncake client) share a prefix
through the store, and the bytes one loads are the bytes the other stored. Runs on both vLLM versions
(``make test`` runs tests/vllm on each).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

from realsched import tiny_model_dir
from tiering_rig import TieredInstance, block_keys, content, tier_entry
from vllm.v1.kv_offload.base import LookupResult, Medium

from kvplane.flows.offload import start_master

PROMPT = list(range(100, 100 + 16 * 6))


def test_two_instances_share_a_prefix_through_the_store(model_dir: str, master) -> None:
    a = TieredInstance(model_dir, tier_entry(master.address))
    b = TieredInstance(model_dir, tier_entry(master.address))
    try:
        keys = block_keys(PROMPT)
        a.store(keys[:4])
        [stored] = a.events_of_tier()  # one put, one event: the chunks once they can be loaded from the store
        assert stored.medium is Medium.CPU and not stored.removed and stored.keys == keys[:4]
        results, got = b.load(keys)
        assert results[:4] == [LookupResult.HIT] * 4 and results[4:] == [LookupResult.MISS] * 2
        width = b.view.shape[1]
        assert all(got[k] == content(k, width).tobytes() for k in keys[:4])
    finally:
        a.shutdown()
        b.shutdown()


def test_another_model_never_reads_these_objects(model_dir: str, master, tmp_path: Path) -> None:
    other = tiny_model_dir(tmp_path)  # the same layout under another model's name
    a = TieredInstance(model_dir, tier_entry(master.address))
    b = TieredInstance(other, tier_entry(master.address))
    try:
        keys = block_keys(PROMPT[:32])
        a.store(keys)
        results, got = b.load(keys)
        assert results == [LookupResult.MISS] * 2 and got == {}
        assert a.tier.names(keys) != b.tier.names(keys)
    finally:
        a.shutdown()
        b.shutdown()


def reported(instance: TieredInstance) -> list[Any]:
    """Every ``JobResult`` the tier hands to vLLM's manager from now on (the tier's own method, observed)."""
    results: list[Any] = []
    tier_poll = instance.tier.get_finished_jobs

    def observed() -> list[Any]:
        got = list(tier_poll())
        results.extend(got)
        return got

    instance.tier.get_finished_jobs = observed
    return results


def test_a_master_killed_mid_store_fails_the_job_through_vllms_result_and_announces_nothing(model_dir: str) -> None:
    master = start_master()
    a = TieredInstance(model_dir, tier_entry(master.address))
    try:
        results = reported(a)
        keys = block_keys(PROMPT[:48])
        staged = a.stage(keys)
        os.kill(master.pid, signal.SIGSTOP)  # the master stops answering: the put's call waits on it
        a.manager.complete_store(staged[1].keys_to_store, staged[0])
        a.step()
        assert a.manager.has_pending_work() and results == []  # the job's call is in flight
        master.kill()  # and the master dies under it
        a.close_request(staged[0])
        a.settle()
        assert [r.success for r in results] == [False]
        assert a.events_of_tier() == [] and not a.manager.has_pending_work()
    finally:
        a.shutdown()
        master.stop()


def test_a_master_killed_before_the_promotion_fails_the_job_and_the_request_misses(model_dir: str) -> None:
    master = start_master()
    a = TieredInstance(model_dir, tier_entry(master.address))
    b = TieredInstance(model_dir, tier_entry(master.address))
    try:
        results = reported(b)
        keys = block_keys(PROMPT[:48])
        a.store(keys)
        req = b.open_request()
        while b.tier.lookup(keys[0], req) is LookupResult.RETRY:  # the store answered: a hit
            b.step()
        first = [b.manager.lookup(k, req) for k in keys]  # the manager starts the promotions
        assert set(first) <= {LookupResult.RETRY, LookupResult.HIT_PENDING}  # 0.27.1 RETRY, 0.33 HIT_PENDING
        master.kill()
        answers = b.until_answered(keys, req)  # the promotions' gets fail: vLLM's JobResult(success=False)
        assert answers == [LookupResult.MISS] * 3 and [r.success for r in results] == [False]
        assert not b.manager.has_pending_work()
        b.close_request(req)
        assert [b.manager.primary_tier.lookup(k, req) for k in keys] == [LookupResult.MISS] * 3
    finally:
        a.shutdown()
        b.shutdown()
        master.stop()


def test_a_store_with_no_room_announces_nothing_and_serves_nothing(model_dir: str) -> None:
    with start_master() as master:  # nobody contributes memory: every put is refused
        a = TieredInstance(model_dir, tier_entry(master.address, segment_bytes=0))
        b = TieredInstance(model_dir, tier_entry(master.address, segment_bytes=0))
        try:
            keys = block_keys(PROMPT[:32])
            a.store(keys)
            assert a.events_of_tier() == []
            results, got = b.load(keys)
            assert results == [LookupResult.MISS] * 2 and got == {}
        finally:
            a.shutdown()
            b.shutdown()


def test_a_restarted_master_lost_the_objects_and_they_miss(model_dir: str) -> None:
    master = start_master()
    a = TieredInstance(model_dir, tier_entry(master.address, retry_after_s=0.5, health_interval_s=0.2))
    try:
        keys = block_keys(PROMPT[:32])
        a.store(keys)
        assert len(a.events_of_tier()) == 1
        port = master.port
        master.kill()
        master = start_master(port=port)
        b = TieredInstance(model_dir, tier_entry(master.address))
        try:
            results, got = b.load(keys)
            assert results == [LookupResult.MISS] * 2 and got == {}
        finally:
            b.shutdown()
    finally:
        a.shutdown()
        master.stop()
