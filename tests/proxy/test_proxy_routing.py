"""xPyD: which instance serves each request (round-robin, least outstanding requests), and health checks that
take a dead instance out and put it back. The instances are ``bad_server.py`` behaviours; an ``ok`` instance
answers its own port as the text, so the tests see who served.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from proxyproc import Proc, instance, serve_proxy, until, until_decode_up, until_metric

from kvplane.proxy import Instance, ProxyConfig, health
from kvplane.proxy.app import STATE
from kvplane.proxy.errors import ProxyConfigError

pytestmark = pytest.mark.integration  # the instances are another process (bad_server.py)
BODY = {"model": "tiny", "prompt": "hello", "max_tokens": 2}


def config(bad: Proc, decodes: list[str], policy: str = "round-robin", **kw: Any) -> ProxyConfig:
    return ProxyConfig(prefill=(instance(bad, "ok", "prefill"),),
                       decode=tuple(instance(bad, d, "decode") for d in decodes), policy=policy,  # type: ignore[arg-type]
                       decode_timeout_s=kw.pop("decode_timeout_s", 30.0), **kw)


async def served_by(client: aiohttp.ClientSession, url: str) -> Any:
    async with client.post(f"{url}/v1/completions", json=BODY) as resp:
        answer = await resp.json()
        return answer["choices"][0]["text"] if resp.status == 200 else resp.status


def test_round_robin_alternates_between_decode_instances(bad: Proc) -> None:
    async def go() -> list[Any]:
        async with serve_proxy(config(bad, ["ok", "ok2"])) as (url, _), aiohttp.ClientSession() as client:
            return [await served_by(client, url) for _ in range(4)]

    a, b = str(bad.ready["ok"]), str(bad.ready["ok2"])
    assert asyncio.run(go()) == [a, b, a, b]


def test_least_outstanding_avoids_the_instance_still_serving(bad: Proc) -> None:
    async def go(policy: str, decode_timeout_s: float) -> list[Any]:
        async with serve_proxy(config(bad, ["hang", "ok"], policy, decode_timeout_s=decode_timeout_s),
                               shutdown_timeout=0.1) as (url, _), \
                aiohttp.ClientSession() as client:
            stuck = asyncio.ensure_future(served_by(client, url))  # round-robin order: "hang" first
            # until the proxy has sent it (its decode counts as outstanding from then on)
            await until_metric(client, url, 'kvplane_proxy_leg_seconds_count{leg="prefill"} 1.0')
            served = [await served_by(client, url) for _ in range(3)]
            stuck.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await stuck
            return served

    ok = str(bad.ready["ok"])
    assert asyncio.run(go("least-outstanding", 60.0)) == [ok, ok, ok]
    assert asyncio.run(go("round-robin", 0.5)).count(ok) < 3  # round-robin sends one of them to the busy instance


def test_least_outstanding_counts_a_decode_until_its_stream_ends(bad: Proc) -> None:
    """A stream that has started is still outstanding: the next requests go to the idle instance."""
    async def go() -> list[Any]:
        async with serve_proxy(config(bad, ["trickle", "ok"], "least-outstanding", decode_timeout_s=60.0),
                               shutdown_timeout=0.1) as (url, _), aiohttp.ClientSession() as client:
            async with client.post(f"{url}/v1/completions", json={**BODY, "stream": True}) as streaming:
                await streaming.content.readany()  # its first event has passed through the proxy
                return [await served_by(client, url) for _ in range(3)]

    assert asyncio.run(go()) == [str(bad.ready["ok"])] * 3


@pytest.mark.parametrize("broken_once", [False, True], ids=["checks", "after-a-check-raised"])
def test_a_failing_health_check_takes_an_instance_out_and_a_passing_one_puts_it_back(
        bad: Proc, monkeypatch: pytest.MonkeyPatch, broken_once: bool) -> None:
    """Also after a check raised what it does not expect (a proxy bug): it is logged and the checks go on."""
    real, calls = health.check, []

    async def check_once_broken(session: aiohttp.ClientSession, inst: Instance, timeout_s: float) -> str:
        calls.append(inst.url)
        if len(calls) == 1:
            raise RuntimeError("a bug")
        return await real(session, inst, timeout_s)

    if broken_once:
        monkeypatch.setattr(health, "check", check_once_broken)

    async def go() -> None:
        async with serve_proxy(config(bad, ["ok", "ok2"], health_interval_s=0.05)) as (url, _), \
                aiohttp.ClientSession() as client:
            ok2 = f"http://127.0.0.1:{bad.ready['ok2']}"
            async with client.post(f"{ok2}/health/down"):
                pass
            try:
                await until_decode_up(client, url, ok2, False)
                assert {await served_by(client, url) for _ in range(3)} == {str(bad.ready["ok"])}
                async with client.get(f"{url}/metrics") as resp:
                    assert f'kvplane_proxy_instance_up{{role="decode",url="{ok2}"}} 0.0' in await resp.text()
            finally:
                async with client.post(f"{ok2}/health/up"):
                    pass
            await until_decode_up(client, url, ok2, True)
            assert {await served_by(client, url) for _ in range(4)} == {str(bad.ready["ok"]), str(bad.ready["ok2"])}

    asyncio.run(go())


def dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_an_unreachable_instance_is_taken_out_at_once_and_a_role_with_none_left_still_gets_the_request(
        bad: Proc) -> None:
    """None up is no 503: the request goes to the instance anyway, and its own failure is the answer."""
    dead = dead_url()

    async def go() -> tuple[list[Any], list[Any]]:
        two = ProxyConfig(prefill=(instance(bad, "ok", "prefill"),),
                          decode=(Instance.parse(dead, "decode"), instance(bad, "ok", "decode")),
                          health_interval_s=60.0)
        async with serve_proxy(two) as (url, _), aiohttp.ClientSession() as client:
            first = [await served_by(client, url) for _ in range(3)]
        alone = ProxyConfig(prefill=(instance(bad, "ok", "prefill"),), decode=(Instance.parse(dead, "decode"),),
                            health_interval_s=60.0)
        async with serve_proxy(alone) as (url, _), aiohttp.ClientSession() as client:
            statuses = [await served_by(client, url) for _ in range(2)]
            async with client.post(f"{url}/v1/completions", json=BODY) as resp:
                error = (await resp.json())["error"]
            async with client.get(f"{url}/health") as resp:
                health_answer = resp.status, (await resp.json())["missing"]
        return first, [*statuses, error, health_answer]

    first, (unreachable, again, error, health_answer) = asyncio.run(go())
    assert first == [502, str(bad.ready["ok"]), str(bad.ready["ok"])]  # then out of rotation
    assert (unreachable, again) == (502, 502)  # tried again, not refused with a 503
    assert error["type"] == "decode_unreachable" and f"decode {dead}" in error["message"], error
    assert health_answer == (503, ["decode"])  # /health still says that no decode passes its checks


def test_requests_still_reach_instances_that_all_failed_their_health_checks(bad: Proc) -> None:
    async def go() -> tuple[set[Any], int]:
        decodes = [f"http://127.0.0.1:{bad.ready[d]}" for d in ("ok", "ok2")]
        async with serve_proxy(config(bad, ["ok", "ok2"], health_interval_s=0.05, health_failures=1)) as (url, _), \
                aiohttp.ClientSession() as client:
            try:
                for decode in decodes:
                    async with client.post(f"{decode}/health/down"):
                        pass
                for decode in decodes:
                    await until_decode_up(client, url, decode, False)
                served = {await served_by(client, url) for _ in range(4)}
                async with client.get(f"{url}/health") as resp:
                    return served, resp.status
            finally:
                for decode in decodes:
                    async with client.post(f"{decode}/health/up"):
                        pass

    served, health_status = asyncio.run(go())
    assert served <= {str(bad.ready["ok"]), str(bad.ready["ok2"])} and served, served  # answered, not 503
    assert health_status == 503


def test_an_instance_leaves_rotation_after_health_failures_failed_checks_in_a_row(
        bad: Proc, monkeypatch: pytest.MonkeyPatch) -> None:
    """--health-failures 3 with a sole decode: two failed checks leave it in rotation, the third takes it out (GET
    /health answers 503 naming decode) yet requests still reach it, and one passing check puts it back. The
    decode's checks are the test's: each waits for the result the test gives next, so no clock decides."""
    decode = f"http://127.0.0.1:{bad.ready['ok2']}"
    results: list[asyncio.Queue[str]] = []
    begun = [0]  # checks of the decode begun

    async def scripted(session: aiohttp.ClientSession, inst: Instance, timeout_s: float) -> str:
        if inst.url != decode:
            return ""
        begun[0] += 1
        return await results[0].get()

    monkeypatch.setattr(health, "check", scripted)

    async def go() -> list[tuple[bool, int, Any]]:
        results.append(asyncio.Queue())
        seen = []
        async with serve_proxy(config(bad, ["ok2"], health_interval_s=0.01, health_failures=3),
                               shutdown_timeout=0.1) as (url, app), aiohttp.ClientSession() as client:

            async def started(n: int) -> bool:
                return begun[0] >= n

            await until(lambda: started(1), "the first check of the decode")
            for n, result in enumerate(["GET /health answered 503", "timed out", "timed out", ""], start=1):
                results[0].put_nowait(result)
                await until(lambda: started(n + 1), f"check {n + 1} of the decode")  # check n is recorded
                async with client.get(f"{url}/health") as resp:
                    seen.append((app[STATE].decode.up[decode], resp.status, await served_by(client, url)))
        return seen

    served = str(bad.ready["ok2"])
    assert asyncio.run(go()) == [(True, 200, served), (True, 200, served), (False, 503, served),
                                 (True, 200, served)]


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_decode_only_fallback_serves_while_no_prefill_is_up(bad: Proc, mode: str) -> None:
    dead = dead_url()
    prefill = Instance.parse(f"{dead},engine_id=p,side_channel=127.0.0.1:5600" if mode != "pull" else dead, "prefill")

    async def go() -> tuple[list[Any], bool]:
        cfg = ProxyConfig(prefill=(prefill,), decode=(instance(bad, "ok", "decode"),), mode=mode,  # type: ignore[arg-type]
                          on_prefill_failure="decode-only", health_interval_s=60.0)
        async with serve_proxy(cfg) as (url, app), aiohttp.ClientSession() as client:
            # the first finds the prefill unreachable (it leaves rotation); with none up the second is sent to it
            # anyway, and falls back when it is refused again
            return [await served_by(client, url) for _ in range(2)], app[STATE].prefill.up[dead]

    served, up = asyncio.run(go())
    assert not up and served == [str(bad.ready["ok"])] * 2


@contextlib.contextmanager
def never_accepting() -> Iterator[str]:
    """The URL of a port whose accept queue is full: a connect there waits, as to a host that dropped off the
    network (its SYNs go unanswered)."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(0)
        port = server.getsockname()[1]
        fillers = []
        for _ in range(3):  # more than the queue holds
            filler = socket.socket()
            filler.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                filler.connect(("127.0.0.1", port))
            fillers.append(filler)
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            for filler in fillers:
                filler.close()


def test_an_instance_that_never_accepts_is_a_502_naming_the_connect_timeout_and_leaves_rotation(bad: Proc) -> None:
    async def go(silent: str) -> tuple[int, str, list[Any]]:
        cfg = ProxyConfig(prefill=(instance(bad, "ok", "prefill"),),
                          decode=(Instance.parse(silent, "decode"), instance(bad, "ok", "decode")),
                          connect_timeout_s=0.5, health_interval_s=60.0)
        async with serve_proxy(cfg) as (url, _), aiohttp.ClientSession() as client:
            async with client.post(f"{url}/v1/completions", json=BODY) as resp:
                status, message = resp.status, (await resp.json())["error"]["message"]
            return status, message, [await served_by(client, url) for _ in range(2)]

    with never_accepting() as silent:
        status, message, then = asyncio.run(go(silent))
    assert status == 502 and f"decode {silent}" in message and "--connect-timeout" in message, (status, message)
    assert then == [str(bad.ready["ok"])] * 2  # out of rotation at once


@pytest.mark.parametrize("text,words", [
    ("10.0.0.7:8100", "not an instance URL"),
    ("http://10.0.0.7:8100/v1", "not an instance URL"),
    ("http://10.0.0.7:8100,side_channel=10.0.0.7", "not HOST:PORT"),
    ("http://10.0.0.7:8100,tp_size=0", "tp_size='0'"),
    ("http://10.0.0.7:8100,engine=p", "KEY one of"),
])
def test_a_bad_instance_flag_is_refused_at_startup_naming_it(text: str, words: str) -> None:
    with pytest.raises(ProxyConfigError, match=words):
        Instance.parse(text, "prefill")


def test_push_without_the_prefills_side_channel_is_refused_at_startup() -> None:
    with pytest.raises(ProxyConfigError, match="engine_id=ID,side_channel=HOST:PORT"):
        ProxyConfig(prefill=(Instance.parse("http://10.0.0.7:8100", "prefill"),),
                    decode=(Instance.parse("http://10.0.0.8:8200", "decode"),), mode="push")


def test_kvplane_proxy_with_a_bad_flag_exits_2_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    from kvplane.cli.main import main

    assert main(["proxy", "--mode", "layerwise", "--prefill", "http://10.0.0.7:8100", "--decode",
                 "http://10.0.0.8:8200"]) == 2
    assert "--mode layerwise needs each prefill's engine id and side channel" in capsys.readouterr().err


def test_health_is_a_503_naming_the_role_while_no_instance_of_it_answers(bad: Proc) -> None:
    async def go() -> None:
        async with serve_proxy(config(bad, ["ok2"], health_interval_s=0.05)) as (url, _), \
                aiohttp.ClientSession() as client:
            decode = f"http://127.0.0.1:{bad.ready['ok2']}"  # the prefill is "ok", another instance
            async with client.get(f"{url}/health") as resp:
                assert resp.status == 200 and (await resp.json())["missing"] == []
            async with client.post(f"{decode}/health/down"):
                pass
            try:
                await until_decode_up(client, url, decode, False)
                async with client.get(f"{url}/health") as resp:
                    body = await resp.json()
                    assert resp.status == 503 and body["status"] == "unhealthy" and body["missing"] == ["decode"]
            finally:
                async with client.post(f"{decode}/health/up"):
                    pass
            await until_decode_up(client, url, decode, True)
            async with client.get(f"{url}/health") as resp:
                assert resp.status == 200

    asyncio.run(go())
