"""Bad input reaches the connector and nothing raises into vLLM's scheduler loop (``realsched.py``): each case
is logged once with the request id, and the request ends through ``kv_load_failure_policy``."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from kvplane.flows.disagg.wire.tokens import new_token

pytest.importorskip("vllm", reason="the vLLM connector tests need vLLM: pip install --no-deps vllm==0.27.1 + .[vllm]")

from ports import free_port  # noqa: E402
from realsched import RealEngine, reference_digest  # noqa: E402
from vllm.v1.engine import FinishReason  # noqa: E402

from kvplane.flows.disagg import Completion  # noqa: E402

PROMPT = [(i * 17 + 3) % 997 for i in range(70)]
QUICK = {"lease_s": 10.0, "heartbeat_s": 0.5, "handshake_timeout_s": 1.0, "transfer_timeout_s": 3.0,
         "drain_timeout_s": 1.0}


def logged(caplog: pytest.LogCaptureFixture, rid: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "kvplane.vllm" and f"request {rid} " in r.getMessage()]


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_token_count_that_is_not_a_number_fails_the_receive_through_the_policy(
    model_dir: str, engines: list[RealEngine], policy: str, caplog: pytest.LogCaptureFixture
) -> None:
    decode = RealEngine(model_dir, {"disagg": {"mode": "pull", "port": free_port(), **QUICK}}, "kv_consumer",
                        policy=policy)
    engines.append(decode)
    decode.add("d", PROMPT, {"do_remote_prefill": True, "remote_engine_id": "p", "remote_request_id": "p-1",
                             "remote_host": "127.0.0.1", "remote_port": free_port(), "tp_size": 1,
                             "remote_block_ids": [[1, 2, 3, 4, 5]], "remote_num_tokens": "lots"})
    with caplog.at_level(logging.WARNING, logger="kvplane.vllm"):
        out = decode.finish("d")
    assert out.finish_reason == (FinishReason.LENGTH if policy == "recompute" else FinishReason.ERROR)
    if policy == "recompute":
        assert decode.digests["d"] == reference_digest(PROMPT, len(PROMPT))
    assert any("remote_num_tokens='lots'" in m for m in logged(caplog, "d"))
    decode.drain()
    decode.assert_nothing_held()


def test_a_completion_for_an_unknown_or_already_reported_request_never_reaches_vllm(
    model_dir: str, engines: list[RealEngine], caplog: pytest.LogCaptureFixture
) -> None:
    decode = RealEngine(model_dir, {"disagg": {"mode": "pull", "port": free_port(), **QUICK}}, "kv_consumer")
    engines.append(decode)
    side = decode.worker.worker.decode
    real = side.get_finished
    seen: list[Completion] = []

    def with_strays(*args: Any, **kwargs: Any) -> list[Completion]:
        out = list(real(*args, **kwargs))
        strays = [Completion("ghost", "done"), *seen]  # an id never received, and every earlier one again
        seen.extend(out)
        return out + strays

    side.get_finished = with_strays
    decode.add("d", PROMPT, {"do_remote_prefill": True, "remote_engine_id": "p", "remote_request_id": "p-1",
                             "remote_host": "127.0.0.1", "remote_port": free_port(), "tp_size": 1,
                             "remote_block_ids": [[1, 2, 3, 4, 5]], "remote_num_tokens": len(PROMPT),
                             "remote_boot_id": "0123abcd", "kvplane_mode": "pull", "kvplane_token": new_token()})
    with caplog.at_level(logging.WARNING, logger="kvplane.vllm"):
        decode.finish("d")  # the pull fails (nobody there): recomputed
        decode.drain()
    assert decode.digests["d"] == reference_digest(PROMPT, len(PROMPT))
    assert logged(caplog, "ghost") and any("reported already" in m for m in logged(caplog, "d"))
    decode.assert_nothing_held()


def test_block_ids_for_the_wrong_number_of_groups_send_nothing(
    model_dir: str, engines: list[RealEngine], caplog: pytest.LogCaptureFixture
) -> None:
    prefill = RealEngine(model_dir, {"disagg": {"mode": "pull", "port": free_port(), **QUICK}}, "kv_producer")
    engines.append(prefill)
    prefill.add("p", PROMPT, {"do_remote_decode": True})
    connector = prefill.scheduler.connector
    real = connector.request_finished_all_groups
    connector.request_finished_all_groups = lambda request, block_ids: real(request, (*block_ids, [9, 9]))
    with caplog.at_level(logging.WARNING, logger="kvplane.vllm"):
        out = prefill.finish("p")
    assert out.finish_reason == FinishReason.LENGTH and out.kv_transfer_params is None
    assert len(logged(caplog, "p")) == 1
    prefill.drain()
    prefill.assert_nothing_held()


@pytest.mark.parametrize("mode", ["pull", "push", "layerwise"])
@pytest.mark.parametrize("token", ["not-a-token", 12345])
def test_a_prefill_request_with_a_malformed_kvplane_token_is_logged_and_frees_its_blocks(
    model_dir: str, engines: list[RealEngine], mode: str, token: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The token comes with the client's ``kv_transfer_params``: a bad one must not raise in the worker (vLLM's
    model runner would die with the whole engine) nor leave the prefill's blocks held for ever."""
    prefill = RealEngine(model_dir, {"disagg": {"mode": mode, "port": free_port(), **QUICK}}, "kv_producer")
    engines.append(prefill)
    with caplog.at_level(logging.WARNING, logger="kvplane.vllm"):
        prefill.add("p", PROMPT, {"do_remote_decode": True, "kvplane_token": token})
        out = prefill.finish("p")
        prefill.drain(within_s=10.0)
    assert out.finish_reason == FinishReason.LENGTH and not out.kv_transfer_params
    assert any("kvplane_token" in m for m in logged(caplog, "p")), logged(caplog, "p")
    prefill.assert_nothing_held()


@pytest.mark.parametrize("mode", ["pull", "push", "layerwise"])
def test_a_prefill_side_that_refuses_the_hand_over_is_logged_and_frees_the_blocks(
    model_dir: str, engines: list[RealEngine], mode: str, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Whatever the prefill side refuses when the worker hands it a finished request (or a layer-wise start), the
    refusal must not raise into vLLM's model runner, and the blocks vLLM was told to keep must come back to it.
    The refusal is planted: no known input makes the prefill side raise there once the scheduler checked it."""
    from kvplane.flows.disagg import PrefillSide
    from kvplane.flows.disagg.wire.errors import DisaggError

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise DisaggError("planted refusal")

    monkeypatch.setattr(PrefillSide, "request_finished", refuse)
    monkeypatch.setattr(PrefillSide, "start_request", refuse)
    prefill = RealEngine(model_dir, {"disagg": {"mode": mode, "port": free_port(), **QUICK}}, "kv_producer")
    engines.append(prefill)
    with caplog.at_level(logging.WARNING, logger="kvplane.vllm"):
        prefill.add("p", PROMPT, {"do_remote_decode": True})
        out = prefill.finish("p")
        prefill.drain(within_s=10.0)
    assert out.finish_reason == FinishReason.LENGTH
    assert any("planted refusal" in m for m in logged(caplog, "p")), logged(caplog, "p")
    prefill.assert_nothing_held()
