"""Reviewer's scenarios for the offload path under vLLM's real ``Scheduler`` (see ``realsched.py``): requests
that end while their host-tier load or store is in flight, for a one-group and a hybrid (two KV-cache groups)
model, with the abort arriving before or after the load's step runs. After each, vLLM's scheduler and both connector
halves hold nothing, and the host tier has no block referenced."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm", reason="the vLLM connector tests need vLLM: pip install --no-deps vllm==0.27.1 + .[vllm]")

from realsched import RealEngine, reference_digest  # noqa: E402

PROMPT = [(i * 13 + 5) % 997 for i in range(70)]  # 4 full blocks of 16 and 6 tokens
OFFLOAD = {"offload": {"host_bytes": 4 << 20, "pinned": False}}


def _stored_prefix(engine: RealEngine) -> None:
    engine.add("a", PROMPT)
    engine.finish("a")
    engine.drain()


def _nothing_held(engine: RealEngine) -> None:
    engine.drain()
    engine.assert_nothing_held()
    assert engine.worker.worker.host_blocks_in_use() == 0


@pytest.mark.parametrize("window", [0, 32], ids=["one-group", "hybrid"])
@pytest.mark.parametrize("when", ["before-the-load-runs", "after-the-load-started"])
def test_a_request_aborted_around_its_load_leaves_nothing_behind(
    model_dir: str, engines: list[RealEngine], window: int, when: str
) -> None:
    engine = RealEngine(model_dir, OFFLOAD, sliding_window=window)
    engines.append(engine)
    _stored_prefix(engine)
    engine.add("b", PROMPT)
    end = time.monotonic() + 30.0
    while True:  # as the engine core steps (the lookup's answer comes from the worker's thread), until b loads
        assert time.monotonic() < end, "no step loaded b's prefix"
        so = engine.scheduler.schedule()
        engine._track_blocks(so)
        if any(job.request_id == "b" for job in so.kv_connector_metadata.loads):
            break
        engine._execute(so)
        time.sleep(0.002)
    if when == "before-the-load-runs":  # the client went away between schedule() and the forward (async scheduling)
        engine.abort("b")
        engine._execute(so)
    else:
        engine._execute(so)
        if "b" in engine.scheduler.requests:  # a hybrid model's load is asynchronous: b waits for it
            engine.abort("b")
    _nothing_held(engine)
    engine.add("c", PROMPT)  # the host tier still serves the prefix afterwards
    engine.finish("c")
    assert engine.first_computed["c"] == 64
    assert engine.digests["c"] == reference_digest(PROMPT, len(PROMPT), window=window)
    _nothing_held(engine)


@pytest.mark.parametrize("window", [0, 32], ids=["one-group", "hybrid"])
def test_a_request_aborted_mid_prefill_while_its_chunks_store_leaves_nothing_behind(
    model_dir: str, engines: list[RealEngine], window: int
) -> None:
    engine = RealEngine(model_dir, OFFLOAD, sliding_window=window, max_batched_tokens=32)
    engines.append(engine)
    engine.add("a", PROMPT)
    engine.run_until(lambda: "a" in engine.starts, 10.0)  # the first chunk of 32 tokens ran and stored 2 blocks
    assert engine.starts["a"] == [0]
    engine.abort("a")
    _nothing_held(engine)
    engine.add("b", PROMPT)
    engine.finish("b")
    assert engine.first_computed["b"] == 32  # the chunk stored before the abort is a hit
    assert engine.digests["b"] == reference_digest(PROMPT, len(PROMPT), window=window)
    _nothing_held(engine)


@pytest.mark.parametrize("window", [0, 32], ids=["one-group", "hybrid"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_preempted_requests_resume_with_the_right_kv_and_leave_nothing_behind(
    model_dir: str, engines: list[RealEngine], window: int, async_scheduling: bool
) -> None:
    engine = RealEngine(model_dir, OFFLOAD, sliding_window=window, async_scheduling=async_scheduling,
                        num_blocks=16 if window else 12)
    engines.append(engine)
    prompts = {f"r{i}": [(i * 101 + j * 7) % 997 for j in range(40)] for i in range(3)}
    for rid, prompt in prompts.items():  # more blocks than vLLM has: some request is preempted
        engine.add(rid, prompt, max_tokens=30)
    engine.run_until(lambda: len(engine.outputs) == 3, 120.0)
    # a preempted request's later forward starts before where its previous one did (vLLM freed its blocks)
    assert any(any(b < a for a, b in zip(s, s[1:])) for s in engine.starts.values()), engine.starts
    for rid, prompt in prompts.items():
        tokens = prompt + [7] * 29
        assert engine.digests[rid] == reference_digest(tokens, len(tokens), window=window), rid
    _nothing_held(engine)


@pytest.mark.parametrize("chunk", [16, 48])
def test_a_hybrid_prefix_prefilled_in_chunks_is_a_full_hit_in_both_groups(
    model_dir: str, engines: list[RealEngine], chunk: int
) -> None:
    # the sliding-window group's early blocks leave the window (vLLM frees them) while later chunks run: each
    # must have been stored in the step that computed it, or the next request's lookup misses in that group
    engine = RealEngine(model_dir, OFFLOAD, sliding_window=32, max_batched_tokens=chunk)
    engines.append(engine)
    engine.add("a", PROMPT)
    engine.finish("a")
    _nothing_held(engine)
    engine.add("b", PROMPT)
    engine.finish("b")
    assert engine.first_computed["b"] == 64 and not engine.invalid
    assert engine.digests["b"] == reference_digest(PROMPT, len(PROMPT), window=32)
    _nothing_held(engine)
