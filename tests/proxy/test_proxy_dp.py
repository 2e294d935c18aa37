"""Data-parallel instances behind the proxy: ``--prefill URL,dp_size=N`` (and ``--decode``) makes one routing
target per DP rank. Each request names its rank in vLLM's ``X-data-parallel-rank`` header; a push decode is told
that rank's engine id (vLLM's ``ID_dp<rank>``) and side channel (base port + rank * tp_size), and a pull decode
gets the params the rank answered. The
instances are ``bad_server.py``'s ``ok``, which answers as a DP prefill does (its params name port 5600 + rank).
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
from proxyproc import Proc, serve_proxy

from kvplane.proxy import Instance, ProxyConfig
from kvplane.proxy.errors import ProxyConfigError

pytestmark = pytest.mark.integration  # the instances are another process (bad_server.py)
BODY = {"model": "tiny", "prompt": "hello", "max_tokens": 2}


def test_an_instance_with_dp_size_is_one_target_per_rank_with_its_side_channel_and_events() -> None:
    inst = Instance.parse("http://h:8000,engine_id=p,side_channel=h:5600,tp_size=2,dp_size=3,"
                          "kv_events=tcp://h:5557,kv_events_replay=tcp://h:5567", "prefill")
    config = ProxyConfig(prefill=(inst,), decode=(Instance.parse("http://d:8000", "decode"),), mode="push")
    assert [(i.name, i.engine_id, i.side_port, i.kv_events, i.kv_events_replay, i.headers)
            for i in config.prefill] == [
        (f"http://h:8000#dp{r}", f"p_dp{r}", 5600 + 2 * r, f"tcp://h:{5557 + r}", f"tcp://h:{5567 + r}",
         {"X-data-parallel-rank": str(r)}) for r in range(3)]
    assert [(i.name, i.headers) for i in config.decode] == [("http://d:8000", {})]


@pytest.mark.parametrize("bad, why", [
    ("dp_size=0", "dp_size='0' is not a positive integer"),
    ("dp_size=2,kv_events=ipc:///tmp/e", "refuses ipc:// there; give tcp://HOST:PORT"),
])
def test_a_bad_dp_size_is_refused_naming_it(bad: str, why: str) -> None:
    with pytest.raises(ProxyConfigError, match=why.replace("(", r"\(")):
        Instance.parse(f"http://h:8000,{bad}", "prefill")


def ranks_and_ports(bad: Proc, mode: str, n: int) -> list[tuple[Any, ...]]:
    url = f"http://127.0.0.1:{bad.ready['ok']}"
    side = ",engine_id=prefill-x,side_channel=127.0.0.1:5600,tp_size=2" if mode != "pull" else ""
    config = ProxyConfig(prefill=(Instance.parse(f"{url}{side},dp_size=2", "prefill"),),
                         decode=(Instance.parse(f"http://127.0.0.1:{bad.ready['ok2']},dp_size=2", "decode"),),
                         mode=mode, decode_timeout_s=30.0)  # type: ignore[arg-type]

    async def go() -> list[tuple[Any, ...]]:
        seen = []
        async with serve_proxy(config) as (proxy, _), aiohttp.ClientSession() as client:
            for _ in range(n):
                async with client.post(f"{proxy}/v1/completions", json=BODY) as resp:
                    echo = (await resp.json())["echo"]  # the decode's: what the proxy sent it
                    params = echo["body"]["kv_transfer_params"]
                    seen.append((echo["dp_rank"], params["remote_port"], params["remote_engine_id"]))
        return seen

    return asyncio.run(go())


def test_pull_sends_each_prefill_to_a_dp_rank_and_the_decode_the_params_that_rank_answered(bad: Proc) -> None:
    # round-robin over the ranks of both; the prefill's rank r answers port 5600 + r
    assert ranks_and_ports(bad, "pull", 4) == [("0", 5600, "prefill-x"), ("1", 5601, "prefill-x")] * 2


def test_push_tells_the_decode_the_side_channel_of_the_prefill_s_dp_rank(bad: Proc) -> None:
    assert ranks_and_ports(bad, "push", 4) == [("0", 5600, "prefill-x_dp0"), ("1", 5602, "prefill-x_dp1")] * 2
