"""The optional connector methods vLLM 0.33 calls, under its real ``Scheduler`` (``realsched.py``): where the
hits came from (``get_external_cache_hit_sources`` / ``_cache_hit_source``), which KV-cache groups a load
restores, whether pending frees can stand in for a preemption, and sleep mode (``unregister_kv_caches`` /
``restore_kv_caches``). vLLM 0.27.1 has none of them, so those tests run only where vLLM defines the method."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="the vLLM connector tests need vLLM: pip install --no-deps vllm==0.27.1 + .[vllm]")

from ports import free_port  # noqa: E402
from realsched import RealEngine, reference_digest  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1  # noqa: E402

PROMPT = [(i * 17 + 3) % 997 for i in range(70)]
QUICK = {"lease_s": 10.0, "heartbeat_s": 0.5, "handshake_timeout_s": 1.0, "transfer_timeout_s": 5.0,
         "drain_timeout_s": 1.0}


def needs(method: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(not hasattr(KVConnectorBase_V1, method), reason=f"this vLLM never calls {method}")


@needs("get_external_cache_hit_sources")
def test_vllm_counts_offload_hits_as_host_and_received_kv_as_p2p(model_dir: str, engines: list[RealEngine]) -> None:
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    port = free_port()
    prefill = RealEngine(model_dir, {"disagg": {"mode": "pull", "port": port, **QUICK}}, "kv_producer")
    decode = RealEngine(model_dir, {"disagg": {"mode": "pull", "port": free_port(), **QUICK},
                                    "offload": {"host_bytes": 4 << 20, "pinned": False}}, "kv_both")
    engines.extend([prefill, decode])
    prefill.add("p", PROMPT, {"do_remote_decode": True})
    decode.add("d", PROMPT, prefill.finish("p").kv_transfer_params)
    decode.finish("d")
    decode.drain()
    decode.add("again", PROMPT)  # now in decode's own host tier
    decode.finish("again")
    hits: dict[CacheHitSource, int] = {}
    for step in decode.stats:
        for source, n in getattr(step.connector_prefix_cache_stats, "hits_by_source", {}).items():
            hits[source] = hits.get(source, 0) + n
    assert hits == {CacheHitSource.P2P: len(PROMPT), CacheHitSource.HOST: 64}
    prefill.drain(within_s=5.0)
    decode.drain()


@needs("get_loaded_kv_cache_group_ids")
def test_a_receive_restores_every_kv_cache_group_of_a_hybrid_model(model_dir: str, engines: list[RealEngine]) -> None:
    decode = RealEngine(model_dir, {"disagg": {"mode": "pull", "port": free_port(), **QUICK}}, "kv_consumer",
                        sliding_window=32)
    engines.append(decode)
    connector = decode.scheduler.connector
    decode.add("d", PROMPT, {"do_remote_prefill": True, "remote_engine_id": "x", "remote_request_id": "p",
                             "remote_host": "127.0.0.1", "remote_port": free_port(), "tp_size": 1})
    assert connector.get_loaded_kv_cache_group_ids(decode.requests["d"]) == (0, 1)
    decode.abort("d")


@needs("has_pending_block_frees")
def test_pending_frees_stand_in_for_a_preemption_only_while_a_push_drains(
    model_dir: str, engines: list[RealEngine]
) -> None:
    port = free_port()
    # the blocks come back when the lease lapses (no decode sends heartbeats): 4 s, not QUICK's 10, is still far
    # more than the steps between finish and the check that the frees are pending
    prefill = RealEngine(model_dir, {"disagg": {"mode": "push", "port": port, **QUICK, "lease_s": 4.0}},
                         "kv_producer")
    engines.append(prefill)
    assert not prefill.scheduler.connector.has_pending_block_frees()
    prefill.add("req-1-0a1b2c3d", PROMPT, {"do_remote_decode": True})
    prefill.finish("req-1-0a1b2c3d")  # no decode registered: the push waits, the blocks are the connector's
    assert prefill.scheduler.connector.has_pending_block_frees()
    prefill.drain(within_s=20.0)  # the push times out, the blocks come back
    assert not prefill.scheduler.connector.has_pending_block_frees()
    prefill.assert_nothing_held()


@needs("unregister_kv_caches")
@pytest.mark.parametrize("extra", [{"offload": {"host_bytes": 4 << 20, "pinned": False}},
                                   {"disagg": {"mode": "pull", **QUICK}}], ids=["offload", "pull"])
def test_sleep_mode_unregisters_the_kv_caches_and_wakes_up_working(
    model_dir: str, engines: list[RealEngine], extra: dict[str, object]
) -> None:
    if "disagg" in extra:
        extra = {"disagg": {**extra["disagg"], "port": free_port()}}  # type: ignore[dict-item]
    engine = RealEngine(model_dir, extra)
    engines.append(engine)
    engine.add("a", PROMPT)
    engine.finish("a")
    engine.drain()
    engine.worker.unregister_kv_caches()  # vLLM's gpu_worker.sleep (0.33.0 line 319), transfers drained
    engine.worker.unregister_kv_caches()  # idempotent
    assert engine.worker.worker.offload is None and engine.worker.worker.decode is None
    engine.worker.restore_kv_caches()  # gpu_worker.wake_up (line 344)
    engine.worker.restore_kv_caches()
    engine.add("b", PROMPT)
    engine.finish("b")
    assert engine.digests["b"] == reference_digest(PROMPT, len(PROMPT))
    engine.drain()
    engine.assert_nothing_held()
