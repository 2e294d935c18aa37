"""``--on-transfer-failure retry-plain``: a P/D request whose decode answers a 5xx before any byte reached the
client (vLLM's answer when a KV load failed under ``kv_load_failure_policy=fail``) is sent once more to a decode
instance without ``kv_transfer_params``; counted at ``/metrics`` and logged with the request id.

The instances are ``bad_server.py`` behaviours; ``kvfail`` fails a request with ``kv_transfer_params`` as vLLM
0.27.1 does (HTTP 500, or streamed: HTTP 200 whose first event is the error) and serves a plain one.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import aiohttp
import pytest
from proxyproc import Proc, instance, serve_proxy

from kvplane.proxy import ProxyConfig
from kvplane.proxy.app import STATE

pytestmark = pytest.mark.integration  # the instances are another process (bad_server.py)
BODY = {"model": "tiny", "prompt": "hello", "max_tokens": 4}
RETRIES = 'kvplane_proxy_transfer_retries_total{endpoint="/v1/completions",mode="%s"}'


def config(bad: Proc, decodes: list[str], mode: str = "pull", policy: str = "retry-plain", **kw: Any) -> ProxyConfig:
    push = mode != "pull"
    return ProxyConfig(prefill=(instance(bad, "ok", "prefill", push),),
                       decode=tuple(instance(bad, d, "decode") for d in decodes), mode=mode,  # type: ignore[arg-type]
                       on_transfer_failure=policy, prefill_timeout_s=60.0, decode_timeout_s=60.0,  # type: ignore[arg-type]
                       health_interval_s=60.0, **kw)


def events(text: str) -> list[Any]:
    return [json.loads(line[6:]) for line in text.split("\n") if line.startswith("data: {")]


async def exchange(cfg: ProxyConfig, body: dict[str, Any], request_id: str = "rid-1") -> tuple[int, Any, str, bool]:
    """The status and answer (JSON, or a stream's JSON events) a client gets, the proxy's /metrics after it, and
    whether every instance lease was given back."""
    async with serve_proxy(cfg) as (url, app), aiohttp.ClientSession() as client:
        async with client.post(f"{url}/v1/completions", json=body, headers={"X-Request-Id": request_id}) as resp:
            status, text = resp.status, (await resp.read()).decode()
        async with client.get(f"{url}/metrics") as metrics:
            shown = await metrics.text()
        idle = all(n == 0 for pool in (app[STATE].prefill, app[STATE].decode) for n in pool.outstanding.values())
    return status, events(text) if body.get("stream") else json.loads(text), shown, idle


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_retry_plain_serves_a_request_whose_decode_failed_its_kv_load(bad: Proc, mode: str, stream: bool,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "kvplane.proxy")
    status, answer, metrics, idle = asyncio.run(exchange(config(bad, ["kvfail"], mode), {**BODY, "stream": stream}))
    first = answer[0] if stream else answer
    assert status == 200 and first["choices"][0]["text"] == str(bad.ready["kvfail"]), answer
    assert "kv_transfer_params" not in first["echo"]["body"]  # the client's own body, sent plain
    assert not stream or all("error" not in event for event in answer)  # the failed stream never reached it
    assert f"{RETRIES % mode} 1.0" in metrics
    assert f'kvplane_proxy_requests_total{{endpoint="/v1/completions",mode="{mode}",outcome="retried"}} 1.0' in metrics
    assert idle
    logged = [r.getMessage() for r in caplog.records if "rid-1" in r.getMessage()]
    assert any("retry-plain" in m and "500" in m for m in logged), logged


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_the_default_policy_passes_the_decodes_failure_on(bad: Proc, stream: bool) -> None:
    status, answer, metrics, _ = asyncio.run(exchange(config(bad, ["kvfail"], policy="error"),
                                                      {**BODY, "stream": stream}))
    if stream:  # the decode's own stream, its error event included, as before
        assert status == 200 and answer[0]["error"]["code"] == 500, answer
    else:
        assert status == 502 and "HTTP 500" in answer["error"]["message"], answer
    assert f"{RETRIES % 'pull'} 1.0" not in metrics


def test_the_retry_goes_to_another_decode_instance_while_one_is_up(bad: Proc) -> None:
    """Round-robin sends the request to ``kvfail`` first; the retry avoids it."""
    status, answer, _, idle = asyncio.run(exchange(config(bad, ["kvfail", "ok2"]), BODY))
    assert status == 200 and answer["choices"][0]["text"] == str(bad.ready["ok2"]), answer
    assert "kv_transfer_params" not in answer["echo"]["body"] and idle


def test_a_retry_that_fails_too_is_the_clients_error_naming_both(bad: Proc) -> None:
    status, answer, metrics, idle = asyncio.run(exchange(config(bad, ["fail"]), BODY))
    assert status == 502, answer
    message = answer["error"]["message"]
    assert "without kv_transfer_params" in message and message.count("HTTP 500") == 2, message
    assert f"{RETRIES % 'pull'} 1.0" in metrics and idle  # retried once, not more


@pytest.mark.parametrize("decode,want", [("reject", 400), ("garbage", 502), ("reset", 502)])
def test_only_a_5xx_answer_is_retried(bad: Proc, decode: str, want: int) -> None:
    """A 4xx is the client's mistake; a connection that fails or an answer that is not JSON is no transfer fault."""
    status, answer, metrics, _ = asyncio.run(exchange(config(bad, [decode]), BODY))
    assert status == want, answer
    assert f"{RETRIES % 'pull'} 1.0" not in metrics


def test_a_stream_that_failed_after_its_first_bytes_reached_the_client_is_not_retried(bad: Proc) -> None:
    status, answer, metrics, _ = asyncio.run(exchange(config(bad, ["midstream"]), {**BODY, "stream": True}))
    assert status == 200 and "closed the connection" in answer[-1]["error"]["message"], answer
    assert f"{RETRIES % 'pull'} 1.0" not in metrics


def test_a_decode_only_fallback_is_not_retried(bad: Proc) -> None:
    """It was plain already: the retry would be the same request again."""
    cfg = ProxyConfig(prefill=(instance(bad, "fail", "prefill"),), decode=(instance(bad, "fail", "decode"),),
                      on_prefill_failure="decode-only", on_transfer_failure="retry-plain", health_interval_s=60.0)
    status, answer, metrics, _ = asyncio.run(exchange(cfg, BODY))
    assert status == 502 and "without kv_transfer_params" not in answer["error"]["message"], answer
    assert f"{RETRIES % 'pull'} 1.0" not in metrics
