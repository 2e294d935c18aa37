"""Data parallelism in live `vllm serve` processes: a prefill started with `--data-parallel-size 2` (two engines
behind one HTTP port, one core each) and a decode, push over Mooncake behind `kvplane proxy` with the prefill given
as `dp_size=2`. The proxy names a DP rank in vLLM's `X-data-parallel-rank` header and tells the decode that rank's
engine id (vLLM's `prefill-dp_dp<rank>`) and side channel (base port + rank): every answer equals the prefill's
own, both ranks served requests (the proxy's per-target counts), and the decode computed no prompt token it was
sent (vLLM's `prompt_tokens_by_source` on the decode: the rest came over kvplane).
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from servers import vllm_argv

from kvplane.bench.serve import client
from kvplane.bench.serve.procs import PROXY, Server, delta, free_port, kv_config, metrics, start_all

pytestmark = pytest.mark.integration
SOURCE = "vllm:prompt_tokens_by_source_total"
MAX_TOKENS = 8


@dataclass
class DP:
    prefill: Server
    decode: Server
    proxy: Server


def side_ports() -> int:
    """A base port whose next port is free too (DP rank 1 listens on base + 1)."""
    while True:
        base = free_port()
        if base < 65535 and free_port_is(base + 1):
            return base


def free_port_is(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.fixture(scope="module")
def dp(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DP]:
    logs = tmp_path_factory.mktemp("dp")
    side = side_ports()
    disagg = {"mode": "push", "transport": "mooncake", "host": "127.0.0.1", "handshake_timeout_s": 120.0,
              "probe_timeout_s": 60.0, "lease_s": 600.0, "transfer_timeout_s": 300.0, "push_timeout_s": 600.0}
    hp, hd, hx = free_port(), free_port(), free_port()
    prefill = Server("prefill", [*vllm_argv(model, hp, kv_config("kv_producer", {"disagg": {**disagg, "port": side}},
                                                                 "prefill-dp"), "0|1"), "--data-parallel-size", "2"],
                     f"http://127.0.0.1:{hp}", logs)
    decode = Server("decode", vllm_argv(model, hd, kv_config("kv_consumer", {"disagg": {**disagg, "port": free_port()}},
                                                             "decode-0"), "1"), f"http://127.0.0.1:{hd}", logs)
    made = [prefill, decode]
    try:
        print(f"\nDP 2 prefill + decode: server start {start_all(made)}")
        flag = f"{prefill.url},engine_id=prefill-dp,side_channel=127.0.0.1:{side},dp_size=2"
        proxy = Server("proxy", [*PROXY, "--mode", "push", "--port", str(hx), "--prefill", flag, "--decode",
                                 decode.url, "--prefill-timeout", "600", "--decode-timeout", "600"],
                       f"http://127.0.0.1:{hx}", logs)
        made.append(proxy)
        start_all([proxy])
        yield DP(prefill, decode, proxy)
    finally:
        for s in reversed(made):
            s.stop()


def test_push_from_a_dp_2_prefill_reaches_each_rank_s_side_channel_and_answers_as_the_prefill(dp: DP,
                                                                                               model: Path) -> None:
    prompts = [f"[dp {i}] " + " ".join(["kv cache transfer between decode and prefill"] * (30 + 12 * i))
               for i in range(4)]
    before = metrics(dp.decode.url)
    got = [client.stream(dp.proxy.url, str(model), p, MAX_TOKENS).text for p in prompts]
    by_source = delta(metrics(dp.decode.url), before, SOURCE + "{")
    want = [client.stream(dp.prefill.url, str(model), p, MAX_TOKENS).text for p in prompts]
    per_rank = {k.split('url="')[1].rstrip('"}'): v for k, v in metrics(dp.proxy.url).items()
                if k.startswith("kvplane_proxy_instance_requests_total") and 'role="prefill"' in k}
    print(f"\nDP 2 push: per rank {per_rank}; decode prompt tokens by source {by_source}")
    assert got == want
    assert per_rank == {f"{dp.prefill.url}#dp0": 2.0, f"{dp.prefill.url}#dp1": 2.0}
    computed = sum(v for k, v in by_source.items() if 'source="local_compute"' in k)
    received = sum(v for k, v in by_source.items() if 'source="external_kv_transfer"' in k)
    assert received > 0 and computed <= len(prompts)  # at most the one token vLLM recomputes per request
