"""The ``kv_transfer_params`` the proxy builds, fed to kvplane's connector under vLLM's real ``Scheduler``
(``tests/vllm/realsched.py``): the decode receives the prompt's KV, pushed by the prefill, and computes only its
last token. Request ids are what vLLM's OpenAI server and engine make of the proxy's ``X-Request-Id``. Here, not in
``tests/proxy``, so that it runs on both vLLM versions ``make test`` covers (fixtures: ``conftest.py``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from kvplane.flows.disagg.wire.tokens import new_token
from kvplane.proxy import Instance, bodies

pytest.importorskip("vllm", reason="the vLLM connector tests need vLLM: pip install --no-deps vllm==0.27.1 + .[vllm]")

from ports import free_port  # noqa: E402

if TYPE_CHECKING:
    from realsched import RealEngine

PROMPT = [(i * 17 + 3) % 997 for i in range(70)]
QUICK = {"lease_s": 10.0, "heartbeat_s": 0.5, "handshake_timeout_s": 10.0, "transfer_timeout_s": 20.0,
         "drain_timeout_s": 1.0}


@pytest.mark.integration
@pytest.mark.parametrize("path", [bodies.COMPLETIONS, bodies.CHAT])
@pytest.mark.parametrize("mode", ["push", "layerwise"])
def test_the_proxys_push_params_make_vllm_receive_the_whole_prompt(model_dir: str, engines: list[RealEngine],
                                                                    mode: str, path: str) -> None:
    from realsched import RealEngine, reference_digest

    port = free_port()
    prefill = RealEngine(model_dir, {"disagg": {"mode": mode, "port": port, **QUICK}}, "kv_producer")
    decode = RealEngine(model_dir, {"disagg": {"mode": mode, "port": free_port(), **QUICK}}, "kv_consumer")
    engines.extend([prefill, decode])
    inst = Instance.parse(f"http://127.0.0.1:8100,engine_id={prefill.config.kv_transfer_config.engine_id},"
                          f"side_channel=127.0.0.1:{port}", "prefill")
    token, request_id = new_token(), "req-42"
    client = {"model": "m", "prompt": "x"} if path == bodies.COMPLETIONS else {"model": "m", "messages": [{}]}
    decode_params = bodies.push_params(inst, path, request_id, mode, token)
    prefill_params = bodies.prefill_body(client, token)["kv_transfer_params"]
    engine_id = f"{bodies.transfer_id(path, request_id)}-0a1b2c3d"  # vLLM's engine appends 8 hex digits
    decode.add(f"{bodies.transfer_id(path, 'other')}-9f8e7d6c", PROMPT, decode_params)
    decode.step()
    prefill.add(engine_id, PROMPT, prefill_params)
    prefill.finish(engine_id)

    def received() -> bool:
        prefill.step()
        return any(rid in decode.outputs for rid in decode.requests)

    decode.run_until(received)
    (rid,) = decode.requests
    assert decode.first_computed[rid] == len(PROMPT) - 1 and not decode.invalid  # the KV came from the prefill
    assert decode.digests[rid] == reference_digest(PROMPT, len(PROMPT))
    prefill.drain()
    decode.drain()
    decode.assert_nothing_held()
    prefill.assert_nothing_held()
