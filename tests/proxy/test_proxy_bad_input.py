"""Bad input and failing instances: each is a clear HTTP error with a JSON message, and the proxy stays up
without leaking a task or a connection.

The instances are ``bad_server.py`` behaviours in another process: one that fails (500), hangs, resets the
connection, answers garbage, or (push) answers on the decode before the prefill has.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from proxyproc import Proc, instance, serve_proxy, socket_count, until_metric

from kvplane.flows.disagg.wire.tokens import is_token
from kvplane.proxy import ProxyConfig
from kvplane.proxy import app as app_module
from kvplane.proxy.app import STATE

pytestmark = pytest.mark.integration  # the instances are another process (bad_server.py)
BODY = {"model": "tiny", "prompt": "hello", "max_tokens": 4}


def config(bad: Proc, prefill: str, decode: str, mode: str = "pull", **kw: Any) -> ProxyConfig:
    """Legs that answer get long timeouts (a loaded machine is slow, never wrong); a test of a hanging leg
    gives that leg a short one (``HANG_PREFILL``, ``HANG_DECODE``)."""
    push = mode != "pull"
    return ProxyConfig(prefill=(instance(bad, prefill, "prefill", push),), decode=(instance(bad, decode, "decode"),),
                       mode=mode, prefill_timeout_s=kw.pop("prefill_timeout_s", 60.0),  # type: ignore[arg-type]
                       decode_timeout_s=kw.pop("decode_timeout_s", 60.0), health_interval_s=60.0, **kw)


HANG_PREFILL, HANG_DECODE = {"prefill_timeout_s": 1.0}, {"decode_timeout_s": 1.0}  # for the leg that hangs
RETRY = {"on_transfer_failure": "retry-plain"}


async def post(url: str, body: Any, path: str = "/v1/completions", headers: dict[str, str] | None = None,
               raw: bytes | None = None) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as client:
        kwargs: dict[str, Any] = {"data": raw} if raw is not None else {"json": body}
        async with client.post(url + path, headers=headers or {}, **kwargs) as resp:
            data = await resp.read()
            try:
                return resp.status, json.loads(data)
            except json.JSONDecodeError:
                return resp.status, data.decode()


def run(bad: Proc, prefill: str, decode: str, body: Any = None, mode: str = "pull", path: str = "/v1/completions",
        **kw: Any) -> tuple[int, Any]:
    async def go() -> tuple[int, Any]:
        async with serve_proxy(config(bad, prefill, decode, mode, **kw)) as (url, _):
            return await post(url, BODY if body is None else body, path)

    return asyncio.run(go())


def error_of(status: int, answer: Any, want_status: int, *words: str) -> str:
    assert status == want_status, (status, answer)
    message = answer["error"]["message"]
    for word in words:
        assert word in message, (word, message)
    return str(message)


@pytest.mark.parametrize("body,path,field", [
    ({"prompt": "hi"}, "/v1/completions", "'model'"),
    ({"model": "tiny"}, "/v1/completions", "'prompt'"),
    ({"model": "tiny", "prompt": ""}, "/v1/completions", "'prompt'"),
    ({"model": "tiny", "prompt": "hi"}, "/v1/chat/completions", "'messages'"),
    ({"model": "tiny", "messages": []}, "/v1/chat/completions", "'messages'"),
    (["not", "an", "object"], "/v1/completions", "JSON object"),
])
def test_a_request_without_model_or_prompt_is_a_400_naming_the_field(bad: Proc, body: Any, path: str,
                                                                     field: str) -> None:
    status, answer = run(bad, "ok", "ok", body, path=path)
    error_of(status, answer, 400, field)


def test_a_body_that_is_not_json_is_a_400(bad: Proc) -> None:
    async def go() -> tuple[int, Any]:
        async with serve_proxy(config(bad, "ok", "ok")) as (url, _):
            return await post(url, None, raw=b"{model: tiny")

    status, answer = asyncio.run(go())
    error_of(status, answer, 400, "not JSON")


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_several_prompts_in_one_request_are_refused_in_every_mode(bad: Proc, mode: str) -> None:
    """Pull too: vLLM's completions answer carries the first prompt's ``kv_transfer_params`` only
    (``final_res_batch[0]`` in ``vllm/entrypoints/openai/completion/serving.py``, 0.27.1 and 0.33.0), which the
    decode would apply to every prompt: the KV of prompt 0 under the tokens of prompt 1."""
    status, answer = run(bad, "ok", "ok", {"model": "tiny", "prompt": ["a", "b"]}, mode=mode)
    error_of(status, answer, 400, "one prompt per request", "'prompt'", "send them one by one")


@pytest.mark.parametrize("prompt", [["a prompt"], [[1, 2, 3]], [1, 2, 3]])
def test_push_serves_one_prompt_given_as_a_list(bad: Proc, prompt: Any) -> None:
    status, answer = run(bad, "ok", "ok2", {"model": "tiny", "prompt": prompt}, mode="push")
    assert status == 200, answer


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("kind,want_status,words", [
    ("fail", 502, ("HTTP 500", "engine exploded")),
    ("garbage", 502, ("not JSON",)),
    ("hang", 504, ("did not answer within 1 s", "--prefill-timeout")),
    ("reset", 502, ("closed the connection",)),
])
def test_a_failing_prefill_is_an_http_error_naming_it(bad: Proc, kind: str, want_status: int, words: tuple[str, ...],
                                                      mode: str) -> None:
    # push: the decode never answers (it would only after the KV came), so the prefill's failure comes first
    status, answer = run(bad, kind, "hang" if mode == "push" else "ok", mode=mode,
                         **HANG_PREFILL)
    message = error_of(status, answer, want_status, f"prefill http://127.0.0.1:{bad.ready[kind]}", *words)
    assert answer["error"]["type"].startswith("prefill_")
    assert "answered before" not in message  # the push decode had not answered


@pytest.mark.parametrize("kind,want_status,words", [
    ("fail", 502, ("HTTP 500",)),
    ("garbage", 502, ("not JSON",)),
    ("hang", 504, ("did not answer within 1 s", "--decode-timeout")),
    ("reset", 502, ("closed the connection",)),
])
def test_a_failing_decode_is_an_http_error_naming_it(bad: Proc, kind: str, want_status: int,
                                                     words: tuple[str, ...]) -> None:
    status, answer = run(bad, "ok", kind, **HANG_DECODE)
    error_of(status, answer, want_status, f"decode http://127.0.0.1:{bad.ready[kind]}", *words)


def test_a_push_decode_that_answers_before_a_prefill_that_never_answers_is_a_504_not_its_answer(bad: Proc) -> None:
    status, answer = run(bad, "hang", "ok", mode="push", prefill_timeout_s=3.0)  # the decode answers at once
    error_of(status, answer, 504, "did not answer within", "answered before the prefill",
             f"decode http://127.0.0.1:{bad.ready['ok']}")


def test_a_push_decode_that_answers_before_a_good_prefill_is_delivered(bad: Proc) -> None:
    status, answer = run(bad, "slow", "ok", mode="push")
    assert status == 200 and answer["choices"][0]["text"] == str(bad.ready["ok"])


def test_a_decode_that_fails_mid_stream_ends_the_stream_with_an_error_event(bad: Proc) -> None:
    async def go() -> list[str]:
        async with serve_proxy(config(bad, "ok", "midstream")) as (url, _), aiohttp.ClientSession() as client:
            async with client.post(url + "/v1/completions", json={**BODY, "stream": True}) as resp:
                assert resp.status == 200
                text = (await resp.read()).decode()
        return [line[6:] for line in text.split("\n") if line.startswith("data: ")]

    events = asyncio.run(go())
    assert json.loads(events[0])["choices"][0]["text"] == str(bad.ready["midstream"])
    assert "closed the connection" in json.loads(events[-1])["error"]["message"]


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_decode_only_fallback_sends_the_request_without_kv_transfer_params(bad: Proc, mode: str) -> None:
    status, answer = run(bad, "fail", "ok", mode=mode, on_prefill_failure="decode-only")
    assert status == 200, answer
    assert "kv_transfer_params" not in answer["echo"]["body"]


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_a_400_from_the_prefill_goes_back_with_its_status_and_no_fallback(bad: Proc, mode: str) -> None:
    """An instance's 4xx is the client's mistake (a prompt too long...): no fallback hides it."""
    status, answer = run(bad, "reject", "hang" if mode == "push" else "ok", mode=mode,
                         on_prefill_failure="decode-only")
    error_of(status, answer, 400, f"prefill http://127.0.0.1:{bad.ready['reject']}", "HTTP 400",
             "prompt too long")


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_n_above_1_is_refused_in_every_mode_naming_the_field_and_the_fix(bad: Proc, mode: str) -> None:
    """Pull too: one prefill request holds one copy of the prompt's KV, and its ``kv_transfer_params`` name that
    one request; vLLM's decode splits ``n`` into child requests that share those params (a shallow copy of the
    sampling params), so every child would receive the same prefill request, which is freed after the first.
    On main the pull went through: one prefill call, and a decode body with n=2 and that one request's params."""
    status, answer = run(bad, "ok", "ok", {"model": "tiny", "prompt": "hi", "n": 2}, mode=mode)
    error_of(status, answer, 400, "'n' is 2", f"--mode {mode}", "send 2 requests with n=1")


def test_n_of_1_still_goes_through_in_pull(bad: Proc) -> None:
    status, answer = run(bad, "ok", "ok", {"model": "tiny", "prompt": "hi", "n": 1})
    assert status == 200, answer
    assert answer["echo"]["body"]["n"] == 1 and answer["echo"]["body"]["kv_transfer_params"]


def test_a_body_over_the_size_limit_is_a_413_json_error(bad: Proc) -> None:
    status, answer = run(bad, "ok", "ok", {"model": "tiny", "prompt": "x" * 4096}, max_body_bytes=1024)
    error_of(status, answer, 413, "1024")


def test_a_proxy_bug_mid_stream_ends_the_stream_with_an_error_event(bad: Proc,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Headers are sent: the failure is the stream's last event, not a second HTTP answer on the connection."""
    async def broken(answer: Any) -> AsyncIterator[bytes]:
        raise RuntimeError("a bug")
        yield b""  # an async generator

    monkeypatch.setattr(app_module, "rest_of_stream", broken)

    async def go() -> tuple[int, list[str], bool]:
        async with serve_proxy(config(bad, "ok", "ok")) as (url, app), aiohttp.ClientSession() as client:
            async with client.post(url + "/v1/completions", json={**BODY, "stream": True}) as resp:
                text = (await resp.read()).decode()
            idle = all(n == 0 for pool in (app[STATE].prefill, app[STATE].decode) for n in pool.outstanding.values())
            return resp.status, [line[6:] for line in text.split("\n") if line.startswith("data: ")], idle

    status, events, idle = asyncio.run(go())
    assert status == 200
    assert json.loads(events[0])["choices"][0]["text"] == str(bad.ready["ok"])
    assert "the proxy failed: RuntimeError: a bug" in json.loads(events[-1])["error"]["message"]
    assert idle


def test_pull_forwards_the_prefills_params_and_the_request_id_to_the_decode(bad: Proc) -> None:
    async def go() -> tuple[int, Any]:
        async with serve_proxy(config(bad, "ok", "ok2")) as (url, _):
            return await post(url, BODY, headers={"X-Request-Id": "client-id-7"})

    status, answer = asyncio.run(go())
    assert status == 200
    echo = answer["echo"]
    assert echo["x_request_id"] == "client-id-7"
    assert echo["body"]["kv_transfer_params"]["remote_engine_id"] == "prefill-x"  # what the prefill returned
    assert echo["body"]["max_tokens"] == 4


def test_push_gives_both_instances_the_same_fresh_token_and_names_the_prefill(bad: Proc) -> None:
    async def go() -> list[Any]:
        answers = []
        async with serve_proxy(config(bad, "ok", "ok2", mode="push")) as (url, _):
            for rid in ("push-a", "push-b"):
                answers.append((await post(url, BODY, headers={"X-Request-Id": rid}))[1])
        return answers

    first, second = asyncio.run(go())
    params = first["echo"]["body"]["kv_transfer_params"]
    assert params["do_remote_prefill"] and params["kvplane_mode"] == "push"
    assert params["remote_engine_id"] == "prefill-x" and params["remote_port"] == 5600
    assert params["remote_request_id"] == "cmpl-push-a-0"  # vLLM's id for the prefill request, suffix stripped
    assert "remote_num_tokens" not in params  # 0 would make the decode receive nothing
    assert is_token(params["kvplane_token"])
    assert params["kvplane_token"] != second["echo"]["body"]["kv_transfer_params"]["kvplane_token"]


def test_push_answers_409_to_a_second_request_with_an_x_request_id_in_flight(bad: Proc) -> None:
    """Push names the prefill's request by the X-Request-Id: two at once would meet at the prefill."""
    async def go() -> list[tuple[int, Any]]:
        async with serve_proxy(config(bad, "ok", "slow", mode="push")) as (url, _), \
                aiohttp.ClientSession() as client:
            first = asyncio.ensure_future(post(url, BODY, headers={"X-Request-Id": "same"}))
            await until_metric(client, url, "kvplane_proxy_in_flight 1.0")
            second = await post(url, BODY, headers={"X-Request-Id": "same"})
            return [second, await first, await post(url, BODY, headers={"X-Request-Id": "same"})]

    (status, answer), first, again = asyncio.run(go())
    error_of(status, answer, 409, "X-Request-Id 'same' is already in flight", "unique")
    assert first[0] == 200 and again[0] == 200  # the first was served; once it ended, the id is free again


LEAK_CASES: list[tuple[str, str, str, dict[str, Any], dict[str, Any], int]] = [
    ("pull", "fail", "ok", BODY, {}, 502), ("pull", "garbage", "ok", BODY, {}, 502),
    ("pull", "hang", "ok", BODY, HANG_PREFILL, 504), ("pull", "reset", "ok", BODY, {}, 502),
    ("pull", "ok", "fail", BODY, {}, 502), ("pull", "ok", "garbage", BODY, {}, 502),
    ("pull", "ok", "hang", BODY, HANG_DECODE, 504), ("pull", "ok", "reset", BODY, {}, 502),
    ("pull", "ok", "midstream", {**BODY, "stream": True}, {}, 200), ("pull", "ok", "ok", {"model": "tiny"}, {}, 400),
    # push: the leg still running when the other fails must be stopped, not left to its (long) timeout
    ("push", "hang", "fail", BODY, {"prefill_timeout_s": 600.0}, 502),
    ("push", "fail", "hang", BODY, {"decode_timeout_s": 600.0}, 502),
    ("push", "hang", "ok", BODY, HANG_PREFILL, 504),
    # --on-transfer-failure retry-plain: the failed decode answer is closed and its lease given back
    ("pull", "ok", "kvfail", BODY, RETRY, 200), ("pull", "ok", "kvfail", {**BODY, "stream": True}, RETRY, 200),
    ("push", "ok", "kvfail", BODY, RETRY, 200), ("pull", "ok", "fail", BODY, RETRY, 502),
]


def test_failures_leak_no_task_and_no_connection_and_the_proxy_stays_up(bad: Proc) -> None:
    ports: set[int] = set()  # the proxies' and the instances': the sockets this test opens

    async def settled(baseline: tuple[int, int]) -> tuple[int, int]:
        counts = (len(asyncio.all_tasks()), socket_count(ports))
        for _ in range(100):  # closing sockets may take a loop turn or two
            if counts[0] <= baseline[0] and counts[1] <= baseline[1]:
                break
            await asyncio.sleep(0.05)
            counts = (len(asyncio.all_tasks()), socket_count(ports))
        return counts

    async def go() -> None:
        proxies = [serve_proxy(config(bad, p, d, mode, **kw)) for mode, p, d, _, kw, _ in LEAK_CASES]
        served = [await proxy.__aenter__() for proxy in proxies]
        urls, apps = [url for url, _ in served], [app for _, app in served]
        ports.update(int(u.rsplit(":", 1)[1]) for u in urls)
        ports.update(int(port) for port in bad.ready.values())
        try:
            async with aiohttp.ClientSession() as client:

                async def one(url: str, body: dict[str, Any]) -> int:
                    async with client.post(f"{url}/v1/completions", json=body) as resp:
                        await resp.read()
                        return resp.status

                async def one_round() -> list[int]:  # every case at once: the proxies serve concurrently
                    return list(await asyncio.gather(*(one(url, c[3]) for url, c in zip(urls, LEAK_CASES))))

                assert await one_round() == [c[-1] for c in LEAK_CASES]  # pools reach their steady state
                before = asyncio.all_tasks()
                baseline = (len(before), socket_count(ports))
                for _ in range(3):
                    assert await one_round() == [c[-1] for c in LEAK_CASES]
                tasks, sockets = await settled(baseline)
                for app in apps:  # least-outstanding counts: every request ended, on every path
                    for pool in (app[STATE].prefill, app[STATE].decode):
                        assert set(pool.outstanding.values()) == {0}, (pool.instances, pool.outstanding)
                assert tasks <= baseline[0], f"task(s) left: {asyncio.all_tasks() - before}"
                assert sockets <= baseline[1], f"{sockets - baseline[1]} socket(s) left open"
                for url in urls:
                    async with client.get(f"{url}/health") as resp:
                        assert resp.status == 200
        finally:
            for proxy in reversed(proxies):
                await proxy.__aexit__(None, None, None)

    asyncio.run(go())


def test_metrics_count_requests_errors_by_cause_and_leg_latency(bad: Proc) -> None:
    async def go() -> str:
        async with serve_proxy(config(bad, "ok", "ok2")) as (url, _):
            await post(url, BODY)
            await post(url, {"model": "tiny"})
            async with aiohttp.ClientSession() as client, client.get(f"{url}/metrics") as resp:
                assert resp.status == 200
                return await resp.text()

    text = asyncio.run(go())
    assert 'kvplane_proxy_requests_total{endpoint="/v1/completions",mode="pull",outcome="ok"} 1.0' in text
    assert 'kvplane_proxy_requests_total{endpoint="/v1/completions",mode="pull",outcome="error"} 1.0' in text
    assert 'kvplane_proxy_errors_total{cause="bad_request"} 1.0' in text
    assert 'kvplane_proxy_leg_seconds_count{leg="prefill"} 1.0' in text
    assert 'kvplane_proxy_leg_seconds_count{leg="decode"} 1.0' in text
