"""End to end: ``kvplane proxy`` in front of two real engine processes with kvplane's P/D flow between them.

The prefill and decode instances are separate processes serving the tiny paged-KV decoder over the OpenAI API
(``engine_server.py``); the KV moves through Mooncake TE or NIXL on 127.0.0.1, pulled, pushed or pushed layer by
layer. The tokens a client gets through the proxy, streamed or not, equal one process running the whole request.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
import torch
from engine_server import LAYOUT, NUM_BLOCKS, tokens_of
from proxyproc import Proc, engine_spec, serve_proxy, spawn_all
from tiny_model import Shape, TinyDecoder

from kvplane.kv.binding import allocate_cache
from kvplane.proxy import Instance, ProxyConfig
from kvplane.proxy.app import STATE

pytestmark = pytest.mark.integration
PROMPT = [int(t) for t in np.random.default_rng(5).integers(0, 64, 41)]
STEPS = 6
PAIRS = [("pull", "mooncake"), ("push", "mooncake"), ("layerwise", "mooncake"), ("pull", "nixl"), ("push", "nixl")]


def one_process(prompt: list[int], steps: int) -> list[int]:
    """The tokens one process generates: the whole prompt's forward, then greedy decoding."""
    threads = torch.get_num_threads()
    try:
        model = TinyDecoder(Shape("gqa"), LAYOUT, allocate_cache(Shape("gqa").spec(), LAYOUT, NUM_BLOCKS))
        table = {0: list(range(NUM_BLOCKS - 1, NUM_BLOCKS - 1 - -(-(len(prompt) + steps) // 16), -1))}
        first = int(model.forward(prompt, 0, table)[-1].argmax())
        rest, _ = model.decode(first, len(prompt), steps - 1, table)
        return [first, *rest]
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=PAIRS, ids=[f"{m}-{t}" for m, t in PAIRS])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Proc, Proc]]:
    mode, transport = request.param
    tmp = tmp_path_factory.mktemp(f"{mode}-{transport}")
    prefill, decode = spawn_all([engine_spec("prefill", mode, transport, "prefill"),
                                 engine_spec("decode", mode, transport, "decode")], tmp)
    try:
        yield mode, prefill, decode
    finally:
        decode.stop()
        prefill.stop()


def config(mode: str, prefill: Proc, decode: Proc) -> ProxyConfig:
    p = Instance.parse(f"{prefill.url()},engine_id={prefill.ready['engine_id']},"
                       f"side_channel=127.0.0.1:{prefill.ready['side_port']}", "prefill")
    return ProxyConfig(prefill=(p,), decode=(Instance.parse(decode.url(), "decode"),), mode=mode,  # type: ignore[arg-type]
                       prefill_timeout_s=60.0, decode_timeout_s=60.0)


async def ask(url: str, path: str, body: dict[str, Any], request_id: str | None = None) -> tuple[int, Any, str]:
    headers = {"X-Request-Id": request_id} if request_id else {}
    async with aiohttp.ClientSession() as client, client.post(url + path, json=body, headers=headers) as resp:
        raw = await resp.read()
        rid = resp.headers.get("X-Request-Id", "")
        if body.get("stream"):
            events = [line[6:] for line in raw.decode().split("\n") if line.startswith("data: ")]
            assert events[-1] == "[DONE]", events
            return resp.status, [json.loads(e) for e in events[:-1]], rid
        return resp.status, json.loads(raw), rid


def streamed_tokens(events: list[dict[str, Any]]) -> list[int]:
    return [t for e in events for t in e["choices"][0]["token_ids"]]


def test_completions_through_the_proxy_equal_one_process(pair: tuple[str, Proc, Proc]) -> None:
    mode, prefill, decode = pair
    want = one_process(PROMPT, STEPS)

    async def go() -> None:
        async with serve_proxy(config(mode, prefill, decode)) as (url, _):
            for i in range(2):  # twice: the second request reuses the handshaken peers and pooled connections
                status, answer, rid = await ask(url, "/v1/completions", {"model": "tiny", "prompt": PROMPT,
                                                                         "max_tokens": STEPS}, f"req-{mode}-{i}")
                assert status == 200, answer
                assert rid == f"req-{mode}-{i}"
                assert answer["choices"][0]["token_ids"] == want

    asyncio.run(go())


def test_streamed_completions_equal_one_process(pair: tuple[str, Proc, Proc]) -> None:
    mode, prefill, decode = pair
    want = one_process(PROMPT, STEPS)

    async def go() -> None:
        async with serve_proxy(config(mode, prefill, decode)) as (url, _):
            status, events, rid = await ask(url, "/v1/completions", {"model": "tiny", "prompt": PROMPT,
                                                                     "max_tokens": STEPS, "stream": True})
            assert status == 200 and rid  # the proxy drew an id where the client gave none
            assert streamed_tokens(events) == want

    asyncio.run(go())


def test_chat_completions_equal_one_process(pair: tuple[str, Proc, Proc]) -> None:
    mode, prefill, decode = pair
    body = {"model": "tiny", "messages": [{"role": "user", "content": "the proxy routes this chat, " * 2}],
            "max_tokens": STEPS}
    want = one_process(tokens_of("/v1/chat/completions", body), STEPS)

    async def go() -> None:
        async with serve_proxy(config(mode, prefill, decode)) as (url, _):
            status, answer, _ = await ask(url, "/v1/chat/completions", body)
            assert status == 200, answer
            assert answer["choices"][0]["token_ids"] == want
            status, events, _ = await ask(url, "/v1/chat/completions", {**body, "stream": True})
            assert status == 200 and streamed_tokens(events) == want

    asyncio.run(go())


def test_neither_engine_logged_a_traceback(pair: tuple[str, Proc, Proc]) -> None:
    _, prefill, decode = pair
    for proc in (prefill, decode):
        assert "Traceback" not in Path(proc.log).read_text(errors="replace"), proc.log


def test_two_prefills_and_two_decodes_each_serve_and_decode_equals_one_process(tmp_path: Path) -> None:
    """2P2D in push mode, under each policy: the proxy names whichever prefill it picked in that decode's
    params."""
    procs = spawn_all([engine_spec(role, "push", "mooncake", f"{role}{i}") for role in ("prefill", "decode")
                       for i in range(2)], tmp_path)
    try:
        prefills = tuple(Instance.parse(f"{p.url()},engine_id={p.ready['engine_id']},side_channel=127.0.0.1:"
                                        f"{p.ready['side_port']}", "prefill") for p in procs[:2])
        decodes = tuple(Instance.parse(d.url(), "decode") for d in procs[2:])
        prompts = [PROMPT, PROMPT[:20], PROMPT[5:], PROMPT[::-1]]

        async def go(policy: str) -> list[list[int]]:
            cfg = ProxyConfig(prefill=prefills, decode=decodes, mode="push", policy=policy,  # type: ignore[arg-type]
                              prefill_timeout_s=60.0, decode_timeout_s=60.0)
            async with serve_proxy(cfg) as (url, app):
                answers = await asyncio.gather(*(ask(url, "/v1/completions", {"model": "tiny", "prompt": p,
                                                                              "max_tokens": STEPS}) for p in prompts))
                served = app[STATE].metrics.render().decode()
                assert 'outcome="ok"} 4.0' in served, served
                for inst in prefills + decodes:  # round-robin: two of the four each; least-outstanding: some
                    count = app[STATE].metrics.registry.get_sample_value(
                        "kvplane_proxy_instance_requests_total", {"role": inst.role, "url": inst.url})
                    assert count == 2 if policy == "round-robin" else count >= 1, (policy, inst, served)
            assert all(status == 200 for status, _, _ in answers), answers
            return [a["choices"][0]["token_ids"] for _, a, _ in answers]

        want = [one_process(p, STEPS) for p in prompts]
        for policy in ("round-robin", "least-outstanding"):
            assert asyncio.run(go(policy)) == want, policy
        for proc in procs:
            assert "Traceback" not in proc.log.read_text(errors="replace")
    finally:
        for proc in procs:
            proc.stop()
