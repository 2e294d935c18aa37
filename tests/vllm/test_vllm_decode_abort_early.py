"""A decode request the client aborts before vLLM scheduled it (its receive never started) must still let the
prefill free the blocks it holds for it, well before the lease runs out: vLLM's NixlConnector does it
(``nixl/pull_scheduler.py`` ``request_finished``: a request still marked ``do_remote_prefill`` notifies the
prefill). Both sides under vLLM's real ``Scheduler`` (see ``realsched.py``)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="the vLLM connector tests need vLLM: pip install --no-deps vllm==0.27.1 + .[vllm]")

from ports import free_port  # noqa: E402
from realsched import RealEngine  # noqa: E402
from test_vllm_request_ends import PROMPT, QUICK  # noqa: E402

LONG_LEASE = {**QUICK, "lease_s": 600.0}  # what the prefill holds, it holds for the decode's sake only


def test_a_decode_request_aborted_before_it_was_scheduled_frees_the_prefills_blocks_before_the_lease_ends(
    model_dir: str, engines: list[RealEngine]
) -> None:
    prefill = RealEngine(model_dir, {"disagg": {"mode": "pull", "port": free_port(), **LONG_LEASE}}, "kv_producer")
    decode = RealEngine(model_dir, {"disagg": {"mode": "pull", "port": free_port(), **LONG_LEASE}}, "kv_consumer")
    engines.extend([prefill, decode])
    prefill.add("p", PROMPT, {"do_remote_decode": True})
    params = prefill.finish("p").kv_transfer_params
    decode.add("d", PROMPT, params)
    decode.abort("d")  # the client went away while "d" waited to be scheduled
    decode.drain()
    decode.assert_nothing_held()
    prefill.freed_by(decode)
