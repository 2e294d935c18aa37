"""The connector under vLLM's real ``Scheduler`` (only the model runner is played, see ``realsched.py``): the
scheduler creates the connector from the module path and applies its answers with vLLM's own code."""

from __future__ import annotations

import pytest

from kvplane.flows.disagg.wire.tokens import new_token

pytest.importorskip("vllm", reason="the vLLM connector tests need vLLM: pip install --no-deps vllm==0.27.1 + .[vllm]")

from ports import free_port  # noqa: E402
from realsched import RealEngine, reference_digest  # noqa: E402
from vllm.v1.engine import FinishReason  # noqa: E402

TOKEN = new_token()  # what a push-mode proxy puts in both sides' kv_transfer_params

PROMPT = [(i * 17 + 3) % 997 for i in range(70)]  # 4 full blocks of 16 and 6 tokens
QUICK = {"lease_s": 10.0, "heartbeat_s": 0.5, "handshake_timeout_s": 1.0, "transfer_timeout_s": 5.0,
         "drain_timeout_s": 1.0}


def test_vllm_schedules_a_repeated_prefix_from_the_host_tier(model_dir: str, engines: list[RealEngine]) -> None:
    engine = RealEngine(model_dir, {"offload": {"host_bytes": 4 << 20, "pinned": False}})
    engines.append(engine)
    engine.add("a", PROMPT)
    assert engine.finish("a").finish_reason == FinishReason.LENGTH
    engine.drain()
    engine.add("b", PROMPT + [5, 6])
    engine.finish("b")
    assert engine.first_computed == {"a": 0, "b": 64}  # vLLM skipped what the connector loaded
    assert engine.digests["b"] == reference_digest(PROMPT + [5, 6], 72)
    engine.drain()
    engine.assert_nothing_held()


def test_vllm_waits_for_the_pulled_kv_then_computes_only_the_last_prompt_token(
    model_dir: str, engines: list[RealEngine]
) -> None:
    port = free_port()
    prefill = RealEngine(model_dir, {"disagg": {"mode": "pull", "port": port, **QUICK}}, "kv_producer")
    decode = RealEngine(model_dir, {"disagg": {"mode": "pull", "port": free_port(), **QUICK}}, "kv_consumer")
    engines.extend([prefill, decode])
    prefill.add("p", PROMPT, {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                              "remote_block_ids": None, "remote_host": None, "remote_port": None})  # toy proxy's
    params = prefill.finish("p").kv_transfer_params
    assert params["do_remote_prefill"] and params["remote_port"] == port
    decode.add("d", PROMPT, params)
    assert decode.finish("d").finish_reason == FinishReason.LENGTH
    assert decode.first_computed["d"] == len(PROMPT) - 1 and not decode.invalid
    assert decode.digests["d"] == reference_digest(PROMPT, len(PROMPT)) == prefill.digests["p"]
    prefill.drain(within_s=5.0)  # the blocks come back once the decode has read them, not when the 10 s lease ends
    decode.drain()
    decode.assert_nothing_held()
    prefill.assert_nothing_held()


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_pull_that_fails_follows_kv_load_failure_policy(
    model_dir: str, engines: list[RealEngine], policy: str
) -> None:
    decode = RealEngine(model_dir, {"disagg": {"mode": "pull", "port": free_port(), **QUICK}}, "kv_consumer",
                        policy=policy)
    engines.append(decode)
    gone = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "gone",
            "remote_request_id": "p-x", "remote_host": "127.0.0.1", "remote_port": free_port(), "tp_size": 1,
            "remote_block_ids": [[1, 2, 3, 4, 5]], "remote_block_size": 16, "remote_num_tokens": len(PROMPT),
            "remote_boot_id": "0123abcd", "kvplane_mode": "pull"}
    decode.add("d", PROMPT, gone)
    out = decode.finish("d")
    assert decode.invalid
    if policy == "recompute":
        assert out.finish_reason == FinishReason.LENGTH
        assert decode.digests["d"] == reference_digest(PROMPT, len(PROMPT))
    else:
        assert out.finish_reason == FinishReason.ERROR
    decode.drain()
    decode.assert_nothing_held()


def test_chunked_prefill_stores_each_chunk_and_a_later_request_loads_them_all(
    model_dir: str, engines: list[RealEngine]
) -> None:
    engine = RealEngine(model_dir, {"offload": {"host_bytes": 4 << 20, "pinned": False}}, max_batched_tokens=24)
    engines.append(engine)
    engine.add("a", PROMPT)  # 70 tokens in chunks of 24: blocks become full in three different steps
    engine.finish("a")
    engine.drain()
    engine.add("b", PROMPT)
    engine.finish("b")
    assert engine.first_computed["b"] == 64
    assert engine.digests["b"] == reference_digest(PROMPT, len(PROMPT))
    engine.drain()
    engine.assert_nothing_held()


@pytest.mark.parametrize("mode", ["push", "layerwise"])
def test_push_keeps_the_prefill_engine_stepping_until_the_decode_has_its_kv(
    model_dir: str, engines: list[RealEngine], mode: str
) -> None:
    port = free_port()
    prefill = RealEngine(model_dir, {"disagg": {"mode": mode, "port": port, **QUICK}}, "kv_producer")
    decode = RealEngine(model_dir, {"disagg": {"mode": mode, "port": free_port(), **QUICK}}, "kv_consumer")
    engines.extend([prefill, decode])
    decode.add("d-1-9f8e7d6c", PROMPT, {
        "do_remote_prefill": True, "remote_engine_id": prefill.config.kv_transfer_config.engine_id,
        "remote_request_id": "req-1", "remote_host": "127.0.0.1", "remote_port": port, "tp_size": 1,
        "kvplane_mode": mode, "kvplane_token": TOKEN,  # a proxy gives both sides the request's token
    })
    decode.step()  # the registration goes out before the prefill has even seen the request
    prefill.add("req-1-0a1b2c3d", PROMPT, {"do_remote_decode": True, "kvplane_token": TOKEN})
    prefill.finish("req-1-0a1b2c3d")
    assert prefill.scheduler.connector.has_pending_push_work()

    def prefill_steps_too() -> bool:
        prefill.step()  # vLLM keeps stepping the prefill engine while has_pending_push_work()
        return "d-1-9f8e7d6c" in decode.outputs

    decode.run_until(prefill_steps_too)
    assert decode.first_computed["d-1-9f8e7d6c"] == len(PROMPT) - 1 and not decode.invalid
    assert decode.digests["d-1-9f8e7d6c"] == reference_digest(PROMPT, len(PROMPT))
    prefill.drain()
    assert not prefill.scheduler.connector.has_pending_push_work()
    decode.drain()
    decode.assert_nothing_held()
    prefill.assert_nothing_held()


def test_a_decode_with_its_own_prefix_cache_hit_still_ends_with_the_prefills_kv(
    model_dir: str, engines: list[RealEngine]
) -> None:
    port = free_port()
    prefill = RealEngine(model_dir, {"disagg": {"mode": "pull", "port": port, **QUICK}}, "kv_producer")
    decode = RealEngine(model_dir, {"disagg": {"mode": "pull", "port": free_port(), **QUICK}}, "kv_consumer",
                        prefix_caching=True)
    engines.extend([prefill, decode])
    for i in range(2):  # the second decode request finds 4 blocks of the prompt in vLLM's own cache
        prefill.add(f"p{i}", PROMPT, {"do_remote_decode": True})
        decode.add(f"d{i}", PROMPT, prefill.finish(f"p{i}").kv_transfer_params)
        decode.finish(f"d{i}")
        prefill.drain(within_s=5.0)
        assert decode.digests[f"d{i}"] == reference_digest(PROMPT, len(PROMPT)) and not decode.invalid
    assert decode.first_computed == {"d0": len(PROMPT) - 1, "d1": len(PROMPT) - 1}
    decode.drain()
    decode.assert_nothing_held()
    prefill.assert_nothing_held()


def test_a_hybrid_sliding_window_model_reloads_a_prefix_vllm_evicted_and_skips_the_null_block(
    model_dir: str, engines: list[RealEngine]
) -> None:
    # vLLM's own prefix cache on, its pool small: a filler request evicts "a" there, kvplane's host tier keeps it
    engine = RealEngine(model_dir, {"offload": {"host_bytes": 4 << 20, "pinned": False}}, prefix_caching=True,
                        sliding_window=32, num_blocks=24)
    engines.append(engine)
    assert type(engine.scheduler.kv_cache_manager.coordinator).__name__ == "HybridKVCacheCoordinator"
    loads: list[dict[int, list[int]]] = []
    worker = engine.worker._worker
    start = worker.start_load_kv
    worker.start_load_kv = lambda meta: (loads.extend(j.block_ids for j in meta.loads), start(meta))[1]
    engine.add("a", PROMPT)
    engine.finish("a")
    engine.add("filler", [900 + i % 50 for i in range(150)])
    engine.finish("filler")
    engine.drain()
    engine.add("b", PROMPT)
    engine.finish("b")
    assert engine.first_computed["b"] == 64 and not engine.invalid
    (load,) = loads
    assert len(load[0]) == 4 and len(load[1]) == 2 and 0 not in load[1]  # out-of-window: vLLM's null block
    assert engine.digests["b"] == reference_digest(PROMPT, len(PROMPT), window=32)
    engine.drain()
    engine.assert_nothing_held()


def test_a_preempted_request_resumes_from_the_blocks_it_stored(model_dir: str, engines: list[RealEngine]) -> None:
    engine = RealEngine(model_dir, {"offload": {"host_bytes": 4 << 20, "pinned": False}}, num_blocks=12)
    engines.append(engine)
    prompts = {f"r{i}": [(i * 101 + j * 7) % 997 for j in range(40)] for i in range(3)}
    for rid, prompt in prompts.items():  # 3 x 69 tokens need 15 blocks; vLLM has 11: one is preempted
        engine.add(rid, prompt, max_tokens=30)
    engine.run_until(lambda: len(engine.outputs) == 3, 60.0)
    resumed = [rid for rid, starts in engine.starts.items() if starts.count(0) == 1 and 32 in starts]
    assert resumed, engine.starts  # vLLM recomputed nothing the host tier held: it restarted at token 32
    for rid, prompt in prompts.items():
        tokens = prompt + [7] * 29
        assert engine.digests[rid] == reference_digest(tokens, len(tokens))
    assert not engine.invalid
    engine.drain()
    engine.assert_nothing_held()
