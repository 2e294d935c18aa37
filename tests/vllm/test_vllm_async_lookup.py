"""What ``get_num_new_matched_tokens`` promised stays loadable, under vLLM's ``AsyncScheduler`` with async
scheduling forced on: step N+1 is scheduled (and its host-tier lookup answered) before step N runs, and step
N's stores must not evict what was promised to step N+1 (see ``realsched.py``)."""

from __future__ import annotations

import logging
import time

import pytest

pytest.importorskip("vllm", reason="the vLLM connector tests need vLLM: pip install --no-deps vllm==0.27.1 + .[vllm]")

from realsched import RealEngine, reference_digest  # noqa: E402
from vllm.v1.engine import FinishReason  # noqa: E402

BLOCK_BYTES = 2 * 2 * 16 * 2 * 8 * 4  # one host block: 2 layers x K and V x 16 tokens x 2 heads x 8 dims x fp32


def prompt(seed: int) -> list[int]:
    return [(i * 17 + seed * 101 + 3) % 997 for i in range(70)]  # 4 full blocks and 6 tokens


def fill_host_tier(engine: RealEngine, *seeds: int) -> None:
    for seed in seeds:
        engine.add(f"fill-{seed}", prompt(seed))
        engine.finish(f"fill-{seed}")
        engine.drain()


def test_a_prefix_promised_to_the_next_step_survives_the_stores_of_the_step_running_now(
    model_dir: str, engines: list[RealEngine]
) -> None:
    engine = RealEngine(model_dir, {"offload": {"host_bytes": 8 * BLOCK_BYTES, "pinned": False}}, policy="fail",
                        async_scheduling=True)
    engines.append(engine)
    fill_host_tier(engine, 1, 2)  # 8 host blocks, all cached; prompt(1)'s are the least recently used
    engine.add("b", prompt(3))
    engine.step()  # step N (b's prefill, whose stores need 4 host blocks) is scheduled, not run yet
    engine.add("c", prompt(1))
    # c's lookup goes out now and its answer (the promise) is in before step N runs: a worker slower than the
    # scheduler would otherwise answer after b's stores evicted prompt(1)'s blocks, an honest miss (seen under load)
    side, c = engine.scheduler.connector.scheduler, engine.requests["c"]
    limit = (c.num_prompt_tokens - 1) // side.step_tokens * side.step_tokens  # as get_num_new_matched_tokens asks
    side.lookup.ask("c", {g: side._hashes(c, g)[: limit // bs] for g, bs in side.block_sizes.items()},
                    side.block_sizes)
    end = time.monotonic() + 120
    while not side.lookup.answered("c"):
        assert time.monotonic() < end, "the worker never answered c's lookup"
        time.sleep(0.001)
    engine.step()  # step N+1 is scheduled (c's lookup: 64 tokens), then step N runs and stores b's blocks
    assert engine.finish("c").finish_reason == FinishReason.LENGTH
    assert engine.first_computed["c"] == 64 and not engine.invalid
    assert engine.digests["c"] == reference_digest(prompt(1), 70)
    engine.finish("b")
    engine.drain()
    engine.assert_nothing_held()


def test_a_promise_that_would_hold_too_much_of_the_host_tier_is_a_logged_miss(
    model_dir: str, engines: list[RealEngine], caplog: pytest.LogCaptureFixture
) -> None:
    engine = RealEngine(model_dir, {"offload": {"host_bytes": 6 * BLOCK_BYTES, "pinned": False}},
                        async_scheduling=True)
    engines.append(engine)
    fill_host_tier(engine, 1)
    with caplog.at_level(logging.INFO, logger="kvplane.vllm"):
        engine.add("c", prompt(1))  # 4 blocks to hold out of 6: more than the bound (half the host tier)
        engine.finish("c")
    assert engine.first_computed["c"] == 0
    assert engine.digests["c"] == reference_digest(prompt(1), 70)
    assert any("request c" in r.getMessage() and "bound" in r.getMessage() for r in caplog.records)
    engine.drain()
    engine.assert_nothing_held()
