"""Shutdown: requests in flight when the proxy stops are completed (within the shutdown timeout) or failed,
never left hanging; ``kvplane proxy`` exits on SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
from typing import Any

import aiohttp
import pytest
from proxyproc import Proc, instance, serve_proxy, until, until_metric

from kvplane.proxy import ProxyConfig
from kvplane.proxy.app import STATE

pytestmark = pytest.mark.integration  # the instances are another process (bad_server.py)
BODY = {"model": "tiny", "prompt": "hello", "max_tokens": 2}
NEVER_S = 120.0  # a bound so that a hung shutdown fails the test instead of hanging it


def config(bad: Proc, decode: str) -> ProxyConfig:
    return ProxyConfig(prefill=(instance(bad, "ok", "prefill"),), decode=(instance(bad, decode, "decode"),),
                       decode_timeout_s=600.0, health_interval_s=60.0)


async def in_flight(client: aiohttp.ClientSession, url: str) -> None:
    await until_metric(client, url, "kvplane_proxy_in_flight 1.0")


async def request(url: str) -> tuple[int, Any] | str:
    try:
        async with aiohttp.ClientSession() as client, client.post(f"{url}/v1/completions", json=BODY) as resp:
            return resp.status, await resp.json()
    except aiohttp.ClientError as e:
        return type(e).__name__


def shut_down_with_one_in_flight(bad: Proc, decode: str, shutdown_timeout: float) -> Any:
    """Stops the proxy while one request to ``decode`` is in flight; what its client got."""
    async def go() -> Any:
        proxy = serve_proxy(config(bad, decode), shutdown_timeout=shutdown_timeout)
        url, _ = await proxy.__aenter__()
        try:
            pending = asyncio.ensure_future(request(url))
            async with aiohttp.ClientSession() as client:
                await in_flight(client, url)
        finally:
            await asyncio.wait_for(proxy.__aexit__(None, None, None), NEVER_S)
        return await asyncio.wait_for(pending, NEVER_S)

    return asyncio.run(go())


def test_a_request_in_flight_at_shutdown_completes(bad: Proc) -> None:
    status, answer = shut_down_with_one_in_flight(bad, "slow", shutdown_timeout=60.0)
    assert status == 200 and answer["choices"][0]["text"] == str(bad.ready["slow"])


def test_a_request_still_in_flight_after_the_shutdown_timeout_fails_and_shutdown_ends(bad: Proc) -> None:
    assert shut_down_with_one_in_flight(bad, "hang", shutdown_timeout=0.2) == "ServerDisconnectedError"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_kvplane_proxy_exits_on_sigterm_with_a_request_in_flight(bad: Proc, tmp_path: Any) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = (tmp_path / "proxy.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "kvplane.cli.main", "proxy", "--port", str(port),
                             "--prefill", f"http://127.0.0.1:{bad.ready['ok']}",
                             "--decode", f"http://127.0.0.1:{bad.ready['hang']}", "--shutdown-timeout", "0.2"],
                            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})

    async def go() -> Any:
        async with aiohttp.ClientSession() as client:
            async def serving() -> bool:
                try:
                    async with client.get(f"{url}/health") as resp:
                        return resp.status == 200
                except aiohttp.ClientConnectorError:
                    assert proc.poll() is None, (tmp_path / "proxy.log").read_text()
                    return False

            await until(serving, "kvplane proxy serving")
            pending = asyncio.ensure_future(request(url))
            await in_flight(client, url)
        proc.send_signal(signal.SIGTERM)
        return await asyncio.wait_for(pending, NEVER_S)

    try:
        assert asyncio.run(go()) == "ServerDisconnectedError"
        assert proc.wait(NEVER_S) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


def test_a_client_that_leaves_stops_both_legs(bad: Proc) -> None:
    """The client gives up while the decode hangs (its timeout is long): the proxy's handler and legs end now,
    not when the leg times out (their connections close, so vLLM aborts the request on the instances)."""

    async def go() -> set[asyncio.Task[Any]]:
        async with serve_proxy(config(bad, "hang")) as (url, app), aiohttp.ClientSession() as watcher:
            async with watcher.get(f"{url}/health"):  # the watcher's keep-alive connection (and its task) first
                pass
            before = asyncio.all_tasks()
            client = aiohttp.ClientSession()
            pending = asyncio.ensure_future(client.post(f"{url}/v1/completions", json=BODY))
            await in_flight(watcher, url)
            pending.cancel()
            await client.close()  # the client's connection closes
            left = asyncio.all_tasks() - before
            for _ in range(200):  # a few loop turns to close sockets; far less than the leg's 600 s timeout
                left = {t for t in asyncio.all_tasks() - before if not t.done()}
                if not left:
                    break
                await asyncio.sleep(0.05)
            for pool in (app[STATE].prefill, app[STATE].decode):  # least-outstanding no longer counts it
                assert set(pool.outstanding.values()) == {0}, pool.outstanding
            return left

    assert asyncio.run(go()) == set()
