"""``remote_num_tokens`` against the decode's prompt, under vLLM's real ``Scheduler`` on both sides (``realsched.py``).

vLLM's semantics (its NixlConnector, ``nixl/pull_scheduler.py`` in 0.27.1 and 0.33.0): the prefill's
``request_finished`` returns ``remote_num_tokens = request.num_computed_tokens``, the tokens it computed of that
request's prompt; for P/D the decode gets the same prompt and loads the prompt's tokens from the prefill. So the
prefill never holds more tokens than the decode's prompt has: ``remote_num_tokens`` above the prompt length means
the ``kv_transfer_params`` come from another (longer) prompt, and loading its first tokens would hand the decode
KV that is not its prompt's. kvplane refuses that receive, naming the field, both counts and the fix: the request
ends through ``kv_load_failure_policy`` (``fail``: an error; ``recompute``: computed here, right), and the prefill
is told at once (a decline), so it frees its blocks long before its lease; nothing is held on either side after.
Fewer tokens than the prompt are a prefix: loaded, and the rest computed here (pinned by the second test)."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("vllm", reason="the vLLM connector tests need vLLM: pip install --no-deps vllm==0.27.1 + .[vllm]")

from ports import free_port  # noqa: E402
from realsched import RealEngine, reference_digest  # noqa: E402
from test_vllm_request_ends import PROMPT, QUICK  # noqa: E402
from vllm.v1.engine import FinishReason  # noqa: E402

LONG_LEASE = {**QUICK, "lease_s": 600.0}  # the prefill frees before this only if it is told
OTHER = [(i * 31 + 7) % 991 for i in range(len(PROMPT) + 30)]  # another, longer prompt


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_params_holding_more_tokens_than_the_prompt_are_refused_and_the_prefill_frees_at_once(
    model_dir: str, engines: list[RealEngine], policy: str, caplog: pytest.LogCaptureFixture
) -> None:
    prefill = RealEngine(model_dir, {"disagg": {"mode": "pull", "port": free_port(), **LONG_LEASE}}, "kv_producer")
    decode = RealEngine(model_dir, {"disagg": {"mode": "pull", "port": free_port(), **LONG_LEASE}}, "kv_consumer",
                        policy=policy)
    engines.extend([prefill, decode])
    prefill.add("p", OTHER, {"do_remote_decode": True})
    params = prefill.finish("p").kv_transfer_params
    assert params is not None and params["remote_num_tokens"] == len(OTHER)
    decode.add("d", PROMPT, params)  # a proxy that forwarded another request's params
    with caplog.at_level(logging.WARNING, logger="kvplane.vllm"):
        out = decode.finish("d")
    # on main: LENGTH under both policies, the decode having loaded OTHER's first 70 tokens as PROMPT's
    assert out.finish_reason == (FinishReason.ERROR if policy == "fail" else FinishReason.LENGTH)
    if policy == "recompute":
        assert decode.digests["d"] == reference_digest(PROMPT, len(PROMPT))
    said = [r.getMessage() for r in caplog.records if "request d " in r.getMessage()]
    assert any(f"remote_num_tokens={len(OTHER)}" in m and f"{len(PROMPT)} prompt tokens" in m
               and "forward the kv_transfer_params of this request" in m for m in said), said
    decode.drain()
    decode.assert_nothing_held()
    prefill.freed_by(decode)


def test_params_holding_fewer_tokens_than_the_prompt_load_that_prefix_and_compute_the_rest(
    model_dir: str, engines: list[RealEngine]
) -> None:
    prefill = RealEngine(model_dir, {"disagg": {"mode": "pull", "port": free_port(), **QUICK}}, "kv_producer")
    decode = RealEngine(model_dir, {"disagg": {"mode": "pull", "port": free_port(), **QUICK}}, "kv_consumer")
    engines.extend([prefill, decode])
    head = PROMPT[:40]
    prefill.add("p", head, {"do_remote_decode": True})
    params = prefill.finish("p").kv_transfer_params
    assert params is not None and params["remote_num_tokens"] == len(head)
    decode.add("d", PROMPT, params)  # the prompt extends what the prefill computed
    out = decode.finish("d")
    assert out.finish_reason == FinishReason.LENGTH and not decode.failed and not decode.invalid
    assert decode.first_computed["d"] == len(head)
    assert decode.digests["d"] == reference_digest(PROMPT, len(PROMPT))
    decode.drain()
    prefill.drain()
    decode.assert_nothing_held()
    prefill.assert_nothing_held()
