"""A load from the store tier (a real ``mooncake_master``) under vLLM's real ``Scheduler`` reuses what the
lookup's store query answered: the store is not asked again, and never while the worker's lock is held (a slow
store would hold up every layer of the forward behind that lock). Failed on main: the load asked
``batch_is_exist`` again, under the lock."""

from __future__ import annotations

import threading
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the vLLM connector tests need vLLM: pip install --no-deps vllm==0.27.1 + .[vllm]")
pytest.importorskip("mooncake.store", reason="the store tier needs Mooncake Store: mooncake-transfer-engine-non-cuda")

from realsched import RealEngine, drop_host_tier, reference_digest  # noqa: E402

from kvplane.flows.offload import MooncakeMaster  # noqa: E402

pytestmark = pytest.mark.integration
PROMPT = [(i * 31 + 7) % 991 for i in range(70)]
MiB = 1 << 20



class ExistsSpy:
    """The tier's real ``exists``, with the thread of each call noted: the worker's own (vLLM's model runner
    here, which holds the lock around a load) or the lookup server's (which asks before taking it)."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.threads: list[str] = []

    def __call__(self, keys: Any) -> Any:
        self.threads.append(threading.current_thread().name)
        return self.real(keys)



@pytest.mark.parametrize("window", [0, 32], ids=["one-group", "hybrid"])
def test_a_store_load_reuses_the_lookups_answer_and_never_asks_the_store_under_the_worker_lock(
    model_dir: str, engines: list[RealEngine], master: MooncakeMaster, window: int
) -> None:
    store = {"master_address": master.address, "write_through": True, "segment_bytes": 32 * MiB,
             "local_buffer_bytes": 16 * MiB, "namespace": f"store2-reuse-{window}", "retry_after_s": 3600.0,
             "timeout_s": 10.0}
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
    spy = ExistsSpy(tier.exists)
    tier.exists = spy  # type: ignore[method-assign]
    engine.add("b", PROMPT)
    engine.finish("b")
    assert tier.degradations == 0, "the store tier turned itself off"
    assert engine.first_computed["b"] == 64 and not engine.invalid, "b was not loaded from the store"
    assert engine.digests["b"] == reference_digest(PROMPT, len(PROMPT), window=window)
    groups = len(worker.offload.pool.block_bytes)
    assert spy.threads == ["kvplane-lookup"] * groups, (
        f"the store was asked from {spy.threads}: the load (on {threading.current_thread().name}, under the "
        f"worker's lock) asked again what the lookup had asked")
    engine.drain()
    engine.assert_nothing_held()
    assert len(worker.offload._presence) == 0, "a lookup's answer outlived its request"
    worker.offload.wait_idle()
    assert worker.host_blocks_in_use() == 0
