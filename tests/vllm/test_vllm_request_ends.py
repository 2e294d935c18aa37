"""Every request ends once, on every failure path, under vLLM's real ``Scheduler`` (see ``realsched.py``): after
each scenario vLLM's scheduler is empty (as vLLM's ``assert_scheduler_empty`` checks) and so is every
per-request table of both connector halves."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm", reason="the vLLM connector tests need vLLM: pip install --no-deps vllm==0.27.1 + .[vllm]")

from ports import free_port  # noqa: E402
from realsched import RealEngine, reference_digest  # noqa: E402
from vllm.v1.engine import FinishReason  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

PROMPT = [(i * 17 + 3) % 997 for i in range(70)]
QUICK = {"lease_s": 10.0, "heartbeat_s": 0.5, "handshake_timeout_s": 1.0, "transfer_timeout_s": 3.0,
         "drain_timeout_s": 1.0, "push_timeout_s": 3.0}


def gone_prefill(mode: str, groups: int = 1) -> dict[str, Any]:
    """``kv_transfer_params`` naming a prefill instance that is not there."""
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "gone",
            "remote_request_id": "p-x", "remote_host": "127.0.0.1", "remote_port": free_port(), "tp_size": 1,
            "remote_block_ids": [[1, 2, 3, 4, 5]] * groups, "remote_block_size": 16,
            "remote_num_tokens": len(PROMPT), "remote_boot_id": "0123abcd", "kvplane_mode": mode}


@pytest.mark.parametrize("mode", ["pull", "push", "layerwise"])
def test_a_receive_that_fails_under_policy_fail_ends_the_request_and_leaves_nothing_behind(
    model_dir: str, engines: list[RealEngine], mode: str
) -> None:
    decode = RealEngine(model_dir, {"disagg": {"mode": mode, "port": free_port(), **QUICK}}, "kv_consumer",
                        policy="fail")
    engines.append(decode)
    decode.add("d", PROMPT, gone_prefill(mode))
    assert decode.finish("d").finish_reason == FinishReason.ERROR
    decode.drain(within_s=10.0)  # has_pending_push_work() must not keep the engine stepping
    decode.assert_nothing_held()


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_a_client_abort_while_waiting_for_remote_kv_leaves_nothing_behind(
    model_dir: str, engines: list[RealEngine], mode: str
) -> None:
    decode = RealEngine(model_dir, {"disagg": {"mode": mode, "port": free_port(), **QUICK}}, "kv_consumer")
    engines.append(decode)
    decode.add("d", PROMPT, gone_prefill(mode))
    decode.step()  # the receive starts; the request waits in WAITING_FOR_REMOTE_KVS
    assert decode.scheduler.requests["d"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    decode.abort("d")
    decode.drain(within_s=10.0)
    decode.assert_nothing_held()


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_hybrid_model_whose_receive_fails_follows_the_policy_without_vllm_raising(
    model_dir: str, engines: list[RealEngine], policy: str
) -> None:
    decode = RealEngine(model_dir, {"disagg": {"mode": "pull", "port": free_port(), **QUICK}}, "kv_consumer",
                        policy=policy, sliding_window=32)
    engines.append(decode)
    decode.add("d", PROMPT, gone_prefill("pull", groups=2))
    out = decode.finish("d")
    if policy == "recompute" or not decode.fails_hybrid_requests:
        assert out.finish_reason == FinishReason.LENGTH
        assert decode.first_computed["d"] == 0
        assert decode.digests["d"] == reference_digest(PROMPT, len(PROMPT), window=32)
    else:
        assert out.finish_reason == FinishReason.ERROR
    decode.drain(within_s=10.0)
    decode.assert_nothing_held()


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_hybrid_model_whose_host_tier_load_fails_follows_the_policy_without_vllm_raising(
    model_dir: str, engines: list[RealEngine], policy: str
) -> None:
    engine = RealEngine(model_dir, {"offload": {"host_bytes": 4 << 20, "pinned": False}}, policy=policy,
                        sliding_window=32)
    engines.append(engine)
    engine.add("a", PROMPT)
    engine.finish("a")
    engine.drain()
    worker = engine.worker.worker
    start = worker.start_load_kv

    def evicted_first(meta: Any) -> None:  # as on a TP rank other than 0: the promised blocks are gone
        for job in meta.loads:
            worker.holds.release(job.request_id)
            for g in worker.offload.index.pools:
                _evict(worker, g)
        start(meta)

    worker.start_load_kv = evicted_first
    engine.add("b", PROMPT)
    out = engine.finish("b")
    if policy == "recompute" or not engine.fails_hybrid_requests:
        assert out.finish_reason == FinishReason.LENGTH
        assert engine.digests["b"] == reference_digest(PROMPT, len(PROMPT), window=32)
    else:
        assert out.finish_reason == FinishReason.ERROR
    engine.drain()
    engine.assert_nothing_held()


def _evict(worker: Any, group: int) -> None:
    """Take every host block of ``group`` (another request's store), so no cached prefix is left."""
    index = worker.offload.index
    ids = index.allocate(group, index.pools[group].num_free)
    index.release(group, ids)
