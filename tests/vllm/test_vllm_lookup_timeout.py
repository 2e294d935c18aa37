"""The scheduler's host-tier lookups under vLLM's real ``Scheduler`` (TP rank 0's worker answers over its
``ipc://`` socket, see ``lookup.py``): ``get_num_new_matched_tokens`` never waits for a busy worker, an answer that
comes later is used, and a lookup the scheduler gave up on (``lookup_timeout_s``) leaves nothing held on the
worker, which may still answer it, late, and hold host blocks for it."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the vLLM connector tests need vLLM: pip install --no-deps vllm==0.27.1 + .[vllm]")

from realsched import RealEngine, reference_digest  # noqa: E402
from test_vllm_async_lookup import BLOCK_BYTES, fill_host_tier, prompt  # noqa: E402


def test_a_lookup_answered_after_the_scheduler_gave_up_holds_no_host_blocks_once_the_request_ends(
    model_dir: str, engines: list[RealEngine]
) -> None:
    engine = RealEngine(model_dir, {"offload": {"host_bytes": 16 * BLOCK_BYTES, "pinned": False},
                                    "lookup_timeout_s": 0.05})
    engines.append(engine)
    fill_host_tier(engine, 1)
    engine.add("c", prompt(1))
    with engine.worker.worker._lock:  # the worker is busy past the deadline of c's lookup (lookup_timeout_s)
        asked = engine.scheduler.schedule()  # c's lookup goes out; c waits for the answer
        time.sleep(0.1)
        missed = engine.scheduler.schedule()  # past the deadline: a miss, c is scheduled, a release goes out
    for so in (asked, missed):  # the worker takes c's lookup up now, after its deadline and maybe the release
        engine._track_blocks(so)
        engine._execute(so)
    assert engine.finish("c").finish_reason is not None
    assert engine.first_computed["c"] == 0  # the lookup counted as a miss
    assert engine.digests["c"] == reference_digest(prompt(1), 70)
    engine.drain()
    engine.assert_nothing_held()


def test_the_scheduler_does_not_wait_for_a_busy_worker_and_uses_its_answer_once_it_comes(
    model_dir: str, engines: list[RealEngine]
) -> None:
    engine = RealEngine(model_dir, {"offload": {"host_bytes": 16 * BLOCK_BYTES, "pinned": False},
                                    "lookup_timeout_s": 600.0})
    engines.append(engine)
    fill_host_tier(engine, 1)
    engine.add("c", prompt(1))
    scheduled: list[Any] = []
    with engine.worker.worker._lock:  # the worker is busy: it cannot answer c's lookup until the lock is free
        schedule = threading.Thread(target=lambda: scheduled.append(engine.scheduler.schedule()), daemon=True)
        schedule.start()
        schedule.join(timeout=60.0)  # a bound for a broken build only: a schedule() that waits for the worker
        returned_while_busy = not schedule.is_alive()
    schedule.join()
    assert returned_while_busy, "get_num_new_matched_tokens waited for the worker's answer"
    engine._track_blocks(scheduled[0])
    engine._execute(scheduled[0])
    assert engine.finish("c").finish_reason is not None
    assert engine.first_computed["c"] == 64  # the answer that came late was not lost: c loaded its prefix
    assert engine.digests["c"] == reference_digest(prompt(1), 70)
    engine.drain()
    engine.assert_nothing_held()
