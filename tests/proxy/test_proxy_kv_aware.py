"""``--policy kv-aware`` end to end: vLLM's own ``ZmqEventPublisher`` (built by its ``EventPublisherFactory`` from a
``KVEventsConfig``, as its scheduler builds it) publishes vLLM ``KVEventBatch``es; the proxy's subscriber takes them,
and the proxy sends a request to the prefill instance that holds its prompt. The instances are ``bad_server.py``
``ok`` behaviours (their ``/tokenize`` gives a token per character); which one served shows in
``kvplane_proxy_instance_requests_total``. A publisher that goes silent while events are due, and one that
restarts, leave the router serving by load, and no request is lost.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
import zmq
from ports import free_port
from proxyproc import WAIT_S, Proc, instance, serve_proxy, until, until_metric
from vllm.config.kv_events import KVEventsConfig
from vllm.distributed.kv_events import BlockStored, EventPublisher, EventPublisherFactory, KVEventBatch

from kvplane.proxy import Instance, ProxyConfig

pytestmark = pytest.mark.integration  # the instances are another process (bad_server.py)
BLOCK = 16
PROMPT = "The quick brown fox jumps over the lazy dog, " * 2  # 90 characters: 5 full blocks of 16 tokens


def publisher(port: int, replay: int) -> EventPublisher:
    config = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://*:{port}",
                            replay_endpoint=f"tcp://*:{replay}")
    return EventPublisherFactory.create(config, data_parallel_rank=0)


async def rebound(port: int, replay: int) -> EventPublisher:
    """A new publisher on the ports of one just shut down: libzmq releases them on its own thread, a moment
    later."""
    end = time.monotonic() + WAIT_S
    while True:
        try:
            return publisher(port, replay)
        except zmq.ZMQError:
            assert time.monotonic() < end, f"ports {port}, {replay} not free again within {WAIT_S:g} s"
            await asyncio.sleep(0.05)


def stored(text: str, salt: str, medium: str = "GPU") -> KVEventBatch:
    """vLLM's device-tier event for the full blocks of ``text``; ``salt`` stands for the instance's hash seed."""
    tokens = [ord(c) % 1000 for c in text]
    n = len(tokens) // BLOCK
    hashes = [f"{salt}-{i}".encode() for i in range(n)]
    return KVEventBatch(ts=time.time(), events=[BlockStored(
        block_hashes=hashes, parent_block_hash=None, token_ids=tokens[:n * BLOCK], block_size=BLOCK, lora_id=None,
        medium=medium, lora_name=None, group_idx=0)])


@pytest.fixture
def publishers() -> Iterator[list[tuple[EventPublisher, int, int]]]:
    made = []
    for _ in range(2):
        port, replay = free_port(), free_port()
        made.append((publisher(port, replay), port, replay))
    try:
        yield made
    finally:
        for pub, _, _ in made:
            pub.shutdown()


def kv_instance(bad: Proc, kind: str, port: int, replay: int) -> Instance:
    url = instance(bad, kind, "prefill").url
    return Instance.parse(f"{url},kv_events=tcp://127.0.0.1:{port},kv_events_replay=tcp://127.0.0.1:{replay}",
                          "prefill")


async def prefill_counts(client: aiohttp.ClientSession, url: str, prefills: list[Instance]) -> list[float]:
    async with client.get(f"{url}/metrics") as resp:
        text = await resp.text()
    counts = []
    for inst in prefills:
        line = f'kvplane_proxy_instance_requests_total{{role="prefill",url="{inst.url}"}} '
        counts.append(float(text.split(line)[1].split()[0]) if line in text else 0.0)
    return counts


async def complete(client: aiohttp.ClientSession, url: str, prompt: Any) -> None:
    async with client.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 2}) as r:
        assert r.status == 200, await r.text()


async def in_step(client: aiohttp.ClientSession, url: str, prefills: list[Instance], outcome: str, n: float) -> None:
    for inst in prefills:
        await until_metric(client, url, f'kvplane_proxy_kv_events_total{{outcome="{outcome}",url="{inst.url}"}} {n}')


def test_the_prefill_holding_the_prompt_gets_it_and_a_silent_or_restarted_one_leaves_routing_by_load(
        bad: Proc, publishers: list[tuple[EventPublisher, int, int]]) -> None:
    (pub_a, port_a, replay_a), (pub_b, port_b, replay_b) = publishers
    prefills = [kv_instance(bad, "ok", port_a, replay_a), kv_instance(bad, "ok2", port_b, replay_b)]
    config = ProxyConfig(prefill=tuple(prefills), decode=(instance(bad, "ok", "decode"),), policy="kv-aware",
                         kv_silence_s=0.5)
    pub_a.publish(stored("an unrelated prompt, long enough.", "a"))
    pub_b.publish(stored(PROMPT, "b"))

    async def go() -> None:
        async with serve_proxy(config) as (url, _), aiohttp.ClientSession() as client:
            # published before the proxy subscribed: each stream is caught up by replay
            await in_step(client, url, prefills, "batch", 1.0)
            for prompt in (PROMPT, PROMPT + "!", [ord(c) % 1000 for c in PROMPT]):
                await complete(client, url, prompt)
            assert await prefill_counts(client, url, prefills) == [0.0, 3.0]  # B holds the prompt's blocks
            await until_metric(client, url, 'kvplane_proxy_kv_decisions_total{how="kv"} 3.0')

            # a prompt neither holds goes by load (A, the least loaded first in order); A must now cache new
            # blocks, its events are due, none come: A is silent and the next picks are by load
            await complete(client, url, "a prompt that nobody has seen before today")
            assert await prefill_counts(client, url, prefills) == [1.0, 3.0]
            await asyncio.sleep(2 * config.kv_silence_s)  # the silence limit passes (no batch is coming)
            await complete(client, url, PROMPT)  # by load: A and B both idle, round-robin order gives B
            await complete(client, url, PROMPT)  # then A, although B holds the prompt
            assert await prefill_counts(client, url, prefills) == [2.0, 4.0]
            await until_metric(client, url, 'kvplane_proxy_kv_decisions_total{how="silent"} 2.0')
            pub_a.publish(stored("a prompt that nobody has seen before today", "a"))
            await in_step(client, url, prefills[:1], "batch", 2.0)
            await complete(client, url, PROMPT)  # A is in step again: B holds the prompt
            assert await prefill_counts(client, url, prefills) == [2.0, 5.0]

            # B restarts: its socket closes, its index is forgotten (a new process hashes with a new seed)
            pub_b.shutdown()
            publishers[1] = (await rebound(port_b, replay_b), port_b, replay_b)
            await until(lambda: _restarted(publishers[1][0], url, client, prefills[1]), "B's restart seen")
            before = await prefill_counts(client, url, prefills)
            for _ in range(4):
                await complete(client, url, PROMPT)
            after = await prefill_counts(client, url, prefills)
            assert [a - b for a, b in zip(after, before)] == [2.0, 2.0]  # by load alone: no request lost

    asyncio.run(go())


async def _restarted(pub: EventPublisher, url: str, client: aiohttp.ClientSession, inst: Instance) -> bool:
    """Publishes one more batch of the restarted publisher (the proxy's socket reconnects in its own time, and a
    batch sent before is gone); True once the proxy counted the restart."""
    pub.publish(stored("a batch of the new run of the publisher", "b2"))
    await asyncio.sleep(0.1)
    async with client.get(f"{url}/metrics") as resp:
        return f'kvplane_proxy_kv_events_total{{outcome="restart",url="{inst.url}"}}' in await resp.text()
