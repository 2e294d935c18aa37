"""Two hosts: a `vllm serve` prefill in one network namespace, its decode in another, and `kvplane proxy` in the
root namespace, each started with the commands of docs/vllm.md's "Two CPU hosts" section and CURVE on, as
written there (keys made with `kvplane keys`, the public ones copied to the other host).

The docs name the prefill host 10.0.0.7 and the decode host 10.0.0.8; the test puts the namespaces' addresses
in their place and nothing else. The side channel and the transfers cross the veth pair between the two
namespaces; the proxy reaches each instance over a second network from the root namespace.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from nslink import Link, unavailable
from servers import doc_command, expand, vllm_argv
from test_serve_pd import MAX_TOKENS

from kvplane.bench.serve.model import prompts
from kvplane.bench.serve.procs import Server, free_port, start_all

pytestmark = pytest.mark.integration
DOC_HOSTS = ("10.0.0.7", "10.0.0.8")


@dataclass
class Hosts:
    link: Link
    prefill: Server
    decode: Server
    proxy: Server
    model: Path


def doc_config(name: str, hosts: tuple[str, str]) -> dict[str, object]:
    """The JSON of `KV_CONFIG='...'` after `# serve: NAME`, with the docs' host addresses replaced by `hosts`."""
    line = doc_command(name)
    assert line.startswith("KV_CONFIG="), line
    text = expand(line, {})[0].removeprefix("KV_CONFIG=")
    for doc, real in zip(DOC_HOSTS, hosts):
        text = text.replace(doc, real)
    config: dict[str, object] = json.loads(text)
    return config


@pytest.fixture(scope="module")
def hosts(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hosts]:
    why = unavailable()
    if why:
        pytest.skip(why)
    link = Link()
    try:
        logs = tmp_path_factory.mktemp("netns")
        dirs = {"prefill": logs / "prefill-host", "decode": logs / "decode-host"}
        for d in dirs.values():
            d.mkdir()
        kvplane = [sys.executable, "-m", "kvplane.cli.main"]
        for role, d in dirs.items():  # each host makes its own key pair ...
            keys = expand(doc_command(f"keys-{role}"), {})
            assert keys[0] == "kvplane", keys
            subprocess.run([*kvplane, *keys[1:]], cwd=d, check=True, capture_output=True)
        shutil.copy(dirs["prefill"] / "prefill.pub", dirs["decode"])  # ... and copies its public key over
        shutil.copy(dirs["decode"] / "decode.pub", dirs["prefill"])
        http_a, http_b = link.join_root()
        data = (link.a.addr, link.b.addr)
        servers = []
        for role, side, http_port, cpus in (("prefill", link.a, 8100, "0"), ("decode", link.b, 8200, "1")):
            argv = vllm_argv(model, http_port, doc_config(f"{role}-config", data), cpus)
            url = f"http://{http_a if role == 'prefill' else http_b}:{http_port}"
            servers.append(Server(role, argv, url, dirs[role], prefix=side.exec_prefix()))
        print(f"\ntwo hosts: server start {start_all(servers)}")
        port = free_port()
        words = expand(doc_command("proxy"), {}) + ["--health-interval", "1"]
        argv = [w.replace(DOC_HOSTS[0], http_a).replace(DOC_HOSTS[1], http_b) for w in words]
        assert argv[:2] == ["kvplane", "proxy"], argv
        i = argv.index("--port")
        argv[i + 1] = str(port)
        proxy = Server("proxy", [*kvplane, *argv[1:]], f"http://127.0.0.1:{port}", logs)
        start_all([proxy])
        yield Hosts(link, servers[0], servers[1], proxy, model)
        for s in (proxy, *servers):
            s.stop()
    finally:
        link.close()


def test_pd_across_two_hosts_with_curve_as_the_docs_say(hosts: Hosts) -> None:
    from kvplane.bench.serve.procs import post

    texts = prompts()[:4]
    got, want = [], []
    for p in texts:
        body = {"model": str(hosts.model), "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0}
        code, answer = post(hosts.proxy.url + "/v1/completions", body)
        assert code == 200, answer
        got.append(answer["choices"][0]["text"])  # type: ignore[index]
        code, answer = post(hosts.prefill.url + "/v1/completions", {**body, "cache_salt": "reference"})
        assert code == 200, answer
        want.append(answer["choices"][0]["text"])  # type: ignore[index]
    print(f"\ntwo hosts: {sum(g == w for g, w in zip(got, want))}/{len(texts)} equal")
    assert got == want
