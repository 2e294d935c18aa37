"""Offload in live `vllm serve` processes: a prompt evicted from vLLM's own prefix cache comes back from
kvplane's host tier, and a second instance loads from Mooncake Store what the first stored, against a real
`mooncake_master`. Outputs equal, and vLLM's own `/metrics` say where the prompt's tokens came from.

Eviction is vLLM's `POST /reset_prefix_cache` (dev mode), which empties vLLM's prefix cache and leaves the
connector's tiers alone (`reset_external=false`): the same state a long run of other prompts leaves, reached
without depending on how many blocks fit.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from servers import vllm_argv
from test_serve_pd import MAX_TOKENS

from kvplane.bench.serve.model import prompts
from kvplane.bench.serve.procs import Server, delta, free_port, kv_config, metrics, post, start_all
from kvplane.flows.offload import MooncakeMaster, start_master

pytestmark = pytest.mark.integration
SOURCE = "vllm:prompt_tokens_cached_by_source_total"


@pytest.fixture(scope="module")
def instances(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Server]]:
    master: MooncakeMaster = start_master()
    logs = tmp_path_factory.mktemp("offload")
    store = {"master_address": master.address, "local_hostname": "127.0.0.1", "protocol": "tcp",
             "write_through": True}
    offload = {"offload": {"host_bytes": 256 << 20, "store": store}}
    made = []
    for name, cpus in (("a", "0"), ("b", "1")):
        port = free_port()
        made.append(Server(name, vllm_argv(model, port, kv_config("kv_both", offload), cpus), f"http://127.0.0.1:{port}",
                           logs, env={"VLLM_SERVER_DEV_MODE": "1"}))
    try:
        print(f"\noffload: server start {start_all(made)}")
        yield made[0], made[1]
    finally:
        for s in made:
            s.stop()
        master.stop()


def complete(server: Server, prompt: str) -> str:
    body = {"model": "", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    code, answer = post(server.url + "/v1/completions", {**body, "model": model_name(server)})
    assert code == 200, answer
    return str(answer["choices"][0]["text"])  # type: ignore[index]


def model_name(server: Server) -> str:
    import json

    with urllib.request.urlopen(server.url + "/v1/models", timeout=30) as r:
        return str(json.load(r)["data"][0]["id"])


def test_host_tier_hit_after_eviction_and_a_store_hit_across_instances(instances: tuple[Server, Server]) -> None:
    a, b = instances
    prompt = prompts()[3]
    first = complete(a, prompt)
    code, answer = post(a.url + "/reset_prefix_cache", {})
    assert code == 200, answer
    before = metrics(a.url)
    again = complete(a, prompt)
    host = delta(metrics(a.url), before, SOURCE)
    print(f"\nhost tier after eviction: {host}")
    assert again == first
    assert host.get(f'{SOURCE}{{source="host"}}', 0) > 0, host

    before = metrics(b.url)
    other = complete(b, prompt)
    store = delta(metrics(b.url), before, "vllm:")
    print(f"store across instances: { {k: v for k, v in store.items() if 'prompt_tokens' in k} }")
    assert other == first
    assert store.get(f'{SOURCE}{{source="host"}}', 0) > 0, store
