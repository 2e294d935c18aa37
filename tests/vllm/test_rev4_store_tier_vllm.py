"""Reviewer's scenario: the store tier (a real ``mooncake_master``) behind the connector under vLLM's real
``Scheduler``, for a one-group and a hybrid model: a prefix the host tier dropped is found by the lookup in the
store and loaded back with the bytes the first request computed."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="the vLLM connector tests need vLLM: pip install --no-deps vllm==0.27.1 + .[vllm]")
pytest.importorskip("mooncake.store", reason="the store tier needs Mooncake Store: mooncake-transfer-engine-non-cuda")

from realsched import RealEngine, drop_host_tier, reference_digest  # noqa: E402

from kvplane.flows.offload import MooncakeMaster  # noqa: E402

pytestmark = pytest.mark.integration
PROMPT = [(i * 29 + 11) % 997 for i in range(70)]
MiB = 1 << 20




@pytest.mark.parametrize("window", [0, 32], ids=["one-group", "hybrid"])
def test_a_prefix_the_host_tier_dropped_is_loaded_from_the_store_under_vllms_scheduler(
    model_dir: str, engines: list[RealEngine], master: MooncakeMaster, window: int
) -> None:
    store = {"master_address": master.address, "write_through": True, "segment_bytes": 32 * MiB,
             "local_buffer_bytes": 16 * MiB, "namespace": f"rev4-vllm-{window}", "retry_after_s": 3600.0,
             "timeout_s": 10.0}  # a loaded machine is not a store that went away
    engine = RealEngine(model_dir, {"offload": {"host_bytes": 4 << 20, "pinned": False, "store": store}},
                        sliding_window=window)
    engines.append(engine)
    worker = engine.worker.worker
    tier = worker.offload.store.tier
    engine.add("a", PROMPT)
    engine.finish("a")
    engine.drain()
    worker.offload.wait_idle()  # the write-through puts are done
    drop_host_tier(worker)
    assert all(pool.num_unused == pool.num_blocks for pool in worker.offload.index.pools.values())
    engine.add("b", PROMPT)
    engine.finish("b")
    assert tier.degradations == 0, "the store tier turned itself off"
    assert engine.first_computed["b"] == 64 and not engine.invalid
    assert engine.digests["b"] == reference_digest(PROMPT, len(PROMPT), window=window)
    engine.drain()
    engine.assert_nothing_held()
    worker.offload.wait_idle()
    assert worker.host_blocks_in_use() == 0
