"""kvplane's tiers publish vLLM KV events through vLLM's own machinery: vLLM's real ``Scheduler`` with
``kv_events_config`` takes them from the connector (``take_events``) and publishes them with its own
``ZmqEventPublisher``; a zmq SUB socket reads them back with vLLM's decoder. Runs on both vLLM versions."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="the vLLM connector tests need vLLM: pip install --no-deps vllm==0.27.1 + .[vllm]")

from kv_events_sub import Subscriber  # noqa: E402
from realsched import BLOCK, RealEngine  # noqa: E402
from vllm.distributed.kv_events import BlockStored  # noqa: E402

PROMPT = [(i * 31 + 7) % 997 for i in range(70)]  # 4 full blocks of 16, and 6 tokens
OTHER = [(i * 17 + 3) % 997 for i in range(70)]
BLOCK_BYTES = 2 * BLOCK * 2 * 2 * 8 * 4  # 2 layers x 16 tokens x (K and V) x HEADS x HEAD_DIM x float32


def events_engine(model_dir: str, endpoint: str, engines: list[RealEngine], host_bytes: int = 4 << 20,
                  **kwargs: object) -> tuple[RealEngine, Subscriber]:
    engine = RealEngine(model_dir, {"offload": {"host_bytes": host_bytes, "pinned": False}}, kv_events=endpoint,
                        prefix_caching=True, **kwargs)  # type: ignore[arg-type]
    engines.append(engine)
    sub = Subscriber(endpoint)
    sub.join(engine.scheduler.kv_event_publisher)
    return engine, sub


@pytest.mark.parametrize("int_hashes", ["1", "0"], ids=["int-hashes", "bytes-hashes"])
def test_the_host_tier_announces_the_hashes_vllm_announces_for_the_same_blocks_on_the_device(
    model_dir: str, endpoint: str, engines: list[RealEngine], monkeypatch: pytest.MonkeyPatch, int_hashes: str
) -> None:
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", int_hashes)  # vLLM reads it at every event
    engine, sub = events_engine(model_dir, endpoint, engines)
    try:
        engine.add("a", PROMPT)
        engine.finish("a")
        sub.until(lambda _: len(sub.stored("CPU")) >= 4, engine.step)
        device = sub.stored("GPU", group=0)
        assert len(device) == 4 and sub.stored("CPU", group=0) == device
        assert all(isinstance(h, int if int_hashes == "1" else bytes) for h in device)
        [host] = sub.of(BlockStored, "CPU")
        assert host.token_ids == [] and host.block_size == 0 and host.parent_block_hash is None
        assert host.group_idx == 0 and host.lora_id is None
        assert sub.removed("CPU") == []
    finally:
        sub.close()


def test_the_host_tier_announces_the_removal_of_the_blocks_it_evicts(
    model_dir: str, endpoint: str, engines: list[RealEngine]
) -> None:
    engine, sub = events_engine(model_dir, endpoint, engines, host_bytes=4 * BLOCK_BYTES)
    try:
        assert engine.worker.worker.offload.pool.num_blocks == 4
        engine.add("a", PROMPT)
        engine.finish("a")
        sub.until(lambda _: len(sub.stored("CPU")) == 4, engine.step)
        first = sub.stored("CPU")
        assert sub.removed("CPU") == []
        engine.add("b", OTHER)  # its 4 blocks take every host block
        engine.finish("b")
        sub.until(lambda _: len(sub.stored("CPU")) == 8, engine.step)
        assert sub.removed("CPU", group=0) == first
        assert sub.stored("CPU")[4:] == sub.stored("GPU")[4:8]
    finally:
        sub.close()


def test_a_hybrid_model_announces_each_groups_blocks_under_its_group(
    model_dir: str, endpoint: str, engines: list[RealEngine]
) -> None:
    engine, sub = events_engine(model_dir, endpoint, engines, sliding_window=32)
    try:
        engine.add("a", PROMPT)
        engine.finish("a")
        sub.until(lambda _: len(sub.stored("CPU", group=1)) == len(sub.stored("CPU", group=0)) == 4, engine.step)
        assert sub.stored("CPU", group=0) == sub.stored("GPU", group=0)
        assert sub.stored("CPU", group=1) == sub.stored("GPU", group=1)
    finally:
        sub.close()


def test_sleep_mode_announces_the_removal_of_everything_the_host_tier_held(
    model_dir: str, endpoint: str, engines: list[RealEngine]
) -> None:
    engine, sub = events_engine(model_dir, endpoint, engines)
    try:
        engine.add("a", PROMPT)
        engine.finish("a")
        sub.until(lambda _: len(sub.stored("CPU")) == 4, engine.step)
        engine.worker.unregister_kv_caches()  # vLLM 0.33's sleep: the flows close, the host tier's contents go
        engine.worker.restore_kv_caches()
        sub.until(lambda _: len(sub.removed("CPU")) == 4, engine.step)
        assert sorted(sub.removed("CPU", group=0)) == sorted(sub.stored("CPU", group=0))
    finally:
        sub.close()
