"""Loads that fail reach vLLM block by block (``get_block_ids_with_load_errors``), the request is still
reported, and vLLM's ``kv_load_failure_policy`` (here: recompute) produces the right KV; no block leaks."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import numpy as np
import pytest

pytest.importorskip("vllm", reason="the vLLM connector tests need vLLM: pip install --no-deps vllm==0.27.1 + .[vllm]")

from minivllm import MiniEngine  # noqa: E402

PROMPT = [(i * 13 + 5) % 991 for i in range(83)]
QUICK = {"handshake_timeout_s": 1.0, "transfer_timeout_s": 2.0, "lease_s": 5.0, "heartbeat_s": 0.5,
         "drain_timeout_s": 1.0}


def dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def decode() -> Iterator[MiniEngine]:
    e = MiniEngine({"disagg": {"mode": "pull", "port": dead_port(), **QUICK}}, "kv_consumer")
    try:
        yield e
    finally:
        e.shutdown()


def test_a_pull_from_a_prefill_that_is_gone_fails_every_block_and_the_request_recomputes(decode: MiniEngine) -> None:
    params = {
        "do_remote_prefill": True, "remote_engine_id": "gone", "remote_request_id": "p-x", "remote_host": "127.0.0.1",
        "remote_port": dead_port(), "tp_size": 1, "remote_block_ids": [list(range(1, 7))], "remote_block_size": 16,
        "remote_num_tokens": len(PROMPT), "remote_boot_id": "feedbeef", "kvplane_mode": "pull",
    }
    out = decode.run("d-1", PROMPT, params)
    assert out.external_tokens == len(PROMPT)
    assert out.load_errors == set(out.block_ids[0][:6]) and out.recomputed
    assert out.digest == decode.reference_digest(PROMPT, len(PROMPT))
    assert decode.whole and decode.worker.get_kv_connector_stats().data["failed_receives"] == 1


def test_params_a_proxy_mangled_fail_the_request_instead_of_raising_into_vllm(decode: MiniEngine) -> None:
    params = {"do_remote_prefill": True, "remote_engine_id": "p", "remote_request_id": "p-y",
              "remote_host": "127.0.0.1", "remote_port": 1, "tp_size": 1, "remote_block_ids": [[1, 2]],
              "remote_num_tokens": 20}  # no remote_boot_id: not what a prefill returned
    out = decode.run("d-2", PROMPT[:20], params)
    assert out.load_errors == set(out.block_ids[0][:2]) and out.recomputed
    assert out.digest == decode.reference_digest(PROMPT[:20], 20) and decode.whole


def test_host_blocks_evicted_between_lookup_and_load_are_reported_and_recomputed() -> None:
    engine = MiniEngine({"offload": {"host_bytes": 8 * 4096, "pinned": False}})  # 8 blocks of 2 layers
    try:
        engine.run("a", PROMPT[:70])  # 4 full blocks stored
        worker = engine.worker._worker
        offload = worker.offload

        def evict() -> None:  # another request's store takes every host block before the load runs
            worker.holds.release("b")  # as on a TP rank other than 0, which holds nothing for lookups
            offload.start_store("other", np.arange(10**6, 10**6 + 8), list(range(36, 44)))
            offload.wait_for_save()

        out = engine.run("b", PROMPT[:70], after_alloc=evict)
        assert out.external_tokens == 64
        assert out.load_errors == set(out.block_ids[0][:4]) and out.recomputed
        assert out.digest == engine.reference_digest(PROMPT[:70], 70) and engine.whole
    finally:
        engine.shutdown()


def test_a_decode_aborted_while_waiting_for_a_push_gets_its_blocks_back_once_kvplane_lets_go(
    decode: MiniEngine,
) -> None:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.request import Request, RequestStatus

    params = {"do_remote_prefill": True, "remote_engine_id": "slow", "remote_request_id": "p-z",
              "remote_host": "127.0.0.1", "remote_port": dead_port(), "tp_size": 1, "kvplane_mode": "push",
              "kvplane_token": "6" * 32}
    req = Request("d-3", PROMPT, SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params}), None,
                  block_hasher=decode.hasher)
    ext, is_async = decode.scheduler.get_num_new_matched_tokens(req, 0)
    assert ext == len(PROMPT) and is_async
    ids = decode._allocate(len(PROMPT))
    decode.scheduler.update_state_after_alloc(req, KVCacheBlocks(([KVCacheBlock(i) for i in ids[0]],)), ext)
    decode.idle_step()  # the registration goes out; nothing will ever be pushed
    req.status = RequestStatus.FINISHED_ABORTED
    delay, out = decode.scheduler.request_finished(req, ids[0])
    assert delay and out is None  # vLLM must not reuse blocks a push could still write
    decode.held["d-3"] = ids
    decode.pump("d-3")  # reported as a finished "send" once the decode side drained it
    assert decode.whole
