"""The connector's offload path in vLLM's call order: a second request with the same prefix loads it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("vllm", reason="the vLLM connector tests need vLLM: pip install --no-deps vllm==0.27.1 + .[vllm]")

from minivllm import MiniEngine  # noqa: E402

OFFLOAD = {"offload": {"host_bytes": 4 << 20, "pinned": False}}


@pytest.fixture
def engine() -> Iterator[MiniEngine]:
    e = MiniEngine(OFFLOAD)
    try:
        yield e
    finally:
        e.shutdown()


def test_second_request_with_the_same_prefix_loads_it_from_the_host_tier(engine: MiniEngine) -> None:
    prompt = list(range(100, 170))  # 70 tokens: 4 full blocks of 16
    first = engine.run("a", prompt, max_tokens=3)
    assert first.external_tokens == 0 and first.kv_transfer_params is None
    second = engine.run("b", prompt + [7, 8, 9])
    assert second.external_tokens == 64 and second.computed_from == 64 and not second.load_errors
    assert second.digest == engine.reference_digest(second.tokens, 73)
    assert engine.whole


def test_lookup_is_side_effect_free_and_never_offers_the_whole_prompt(engine: MiniEngine) -> None:
    prompt = list(range(32))  # exactly 2 blocks: the last token must be computed, so 1 block loads
    engine.run("a", prompt)
    again = engine.run("b", prompt)
    assert again.external_tokens == 16
    assert again.digest == engine.reference_digest(prompt, 32)
    assert engine.run("c", prompt).external_tokens == 16


def test_a_different_prefix_misses(engine: MiniEngine) -> None:
    engine.run("a", list(range(48)))
    assert engine.run("b", [5] + list(range(1, 48))).external_tokens == 0


def test_a_cross_layer_cache_round_trips_through_the_host_tier() -> None:
    engine = MiniEngine(OFFLOAD, cross_layer=True)
    try:
        worker = engine.worker.worker
        assert worker.offload is not None
        prompt = list(range(300, 370))
        engine.run("a", prompt, max_tokens=3)
        second = engine.run("b", prompt + [1, 2])
        assert second.external_tokens == 64 and not second.load_errors
        assert second.digest == engine.reference_digest(second.tokens, 72)
        assert engine.whole
    finally:
        engine.shutdown()
