"""``GET /v1/models`` through the proxy: OpenAI clients (and ``vllm bench serve``) ask it before anything else,
and it used to be a 404. The proxy answers with a decode instance's own list, passed through, and every failure
as the JSON error the completions routes give. The instances are ``bad_server.py`` behaviours.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
from proxyproc import Proc, instance, serve_proxy

from kvplane.proxy import ProxyConfig
from kvplane.proxy.app import STATE

pytestmark = pytest.mark.integration  # the instances are another process (bad_server.py)


def config(bad: Proc, decode: str, **kw: Any) -> ProxyConfig:
    return ProxyConfig(prefill=(instance(bad, "ok", "prefill"),), decode=(instance(bad, decode, "decode"),), **kw)


async def models(url: str, headers: dict[str, str] | None = None) -> tuple[int, Any, str]:
    async with aiohttp.ClientSession() as client, client.get(f"{url}/v1/models", headers=headers) as resp:
        return resp.status, await resp.json(), resp.headers.get("X-Request-Id", "")


def test_the_model_list_is_a_decode_instances_own_answer_passed_through(bad: Proc) -> None:
    async def go() -> tuple[int, Any, str, Any]:
        async with serve_proxy(config(bad, "ok")) as (url, _), aiohttp.ClientSession() as client:
            async with client.get(f"{bad.url('ok')}/v1/models") as resp:
                direct = await resp.json()
            status, body, rid = await models(url, {"X-Request-Id": "m-1", "Authorization": "Bearer k"})
            return status, body, rid, direct

    status, body, rid, direct = asyncio.run(go())
    assert status == 200 and rid == "m-1"
    assert body["data"] == direct["data"] and body["data"][0]["id"] == f"tiny-{bad.ready['ok']}"
    assert body["echo"] == {"x_request_id": "m-1", "authorization": "Bearer k"}  # what the completions legs forward


@pytest.mark.parametrize("decode, status, cause", [
    ("fail", 502, "decode_status"), ("garbage", 502, "decode_bad_json"), ("reset", 502, "decode_disconnected"),
    ("hang", 504, "decode_timeout"),
])
def test_a_failing_decode_is_a_json_error_naming_it(bad: Proc, decode: str, status: int, cause: str) -> None:
    async def go() -> tuple[int, Any, str]:
        async with serve_proxy(config(bad, decode, decode_timeout_s=0.5), shutdown_timeout=0.1) as (url, _):
            return await models(url)

    got, body, rid = asyncio.run(go())
    assert got == status and body["error"]["type"] == cause, body
    assert bad.url(decode) + "/v1/models" in body["error"]["message"] and body["error"]["request_id"] == rid != ""


def test_with_no_decode_up_the_list_is_still_asked_of_one(bad: Proc) -> None:
    """No 503 while the decode is out of rotation (its health checks answer late under load): ``vllm bench serve``
    asks the list first, and the instance itself answers."""
    async def go() -> tuple[int, Any, str, int]:
        async with serve_proxy(config(bad, "ok")) as (url, app), aiohttp.ClientSession() as client:
            state = app[STATE]
            state.decode.failed(state.decode.instances[0], out=True)
            async with client.get(f"{url}/health") as resp:
                health = resp.status
            return (*await models(url), health)

    status, body, _, health = asyncio.run(go())
    assert status == 200 and body["data"][0]["id"] == f"tiny-{bad.ready['ok']}", body
    assert health == 503
