"""xPyD behind ``kvplane proxy``, one proxy per policy: the ``serve-routing`` bench row and tests/serve's live
kv-aware test (``test_serve_kv_routing.py``) start the same set-up and send the same workload.

``start_xpyd``: 2 prefill instances (``kv_producer`` with kvplane's host tier and vLLM's KV events,
``--kv-events-config`` over ipc sockets) and 2 decodes (``kv_consumer``), pull over Mooncake; then one proxy per
policy, all at once, each over the same four instances (a ZMQ publisher serves every subscriber), the kv-aware
one subscribed to both prefills' events. ``conversations``: conversations that grow round by round (each round
adds a question to the last prompt), every text unique to its tag, so a policy's requests hit only blocks its own
earlier rounds left. ``run_policy`` sends one policy's conversations through its proxy, a round at a time (the
round's conversations at once), with no ``cache_salt`` (a salt would put every request in a prefix cache of its
own, and its blocks would carry extra keys the kv-aware index does not learn), and reads from the prefills'
``/metrics`` the prompt tokens they computed and those they found cached. Policies run one after the other, each
on its own conversations: the prefills' counters then belong to one policy at a time.
"""

from __future__ import annotations

import concurrent.futures
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvplane.bench.serve import client
from kvplane.bench.serve.command import vllm_argv
from kvplane.bench.serve.model import WORDS
from kvplane.bench.serve.procs import PROXY, Server, delta, free_port, kv_config, metrics, start_all

POLICIES = ("round-robin", "least-outstanding", "kv-aware")
CPUS = ("0", "1")  # prefill i and decode 1 - i share a core: each core holds one of each
HOST_BYTES = 128 << 20
MAX_TOKENS = 8
SOURCE = "vllm:prompt_tokens_by_source_total"
SETTLE_S = 60.0  # the longest a reading waits for the prefills to count what was sent


@dataclass
class XPyD:
    prefills: list[Server]
    decodes: list[Server]
    proxies: dict[str, Server]  # by policy
    start_s: dict[str, float] = field(default_factory=dict)

    def close(self) -> None:
        for s in [*self.proxies.values(), *self.decodes, *self.prefills]:
            s.stop()


def _prefill(python: Path, model: Path, logs: Path, i: int, disagg: dict[str, Any]) -> tuple[Server, str]:
    """Prefill ``i`` and the proxy's ``--prefill`` flag naming its side channel and KV events."""
    port, side = free_port(), free_port()
    pub, replay = f"ipc://{logs / f'events-{i}.sock'}", f"ipc://{logs / f'replay-{i}.sock'}"
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": pub, "replay_endpoint": replay}
    kv = kv_config("kv_producer", {"disagg": {**disagg, "port": side}, "offload": {"host_bytes": HOST_BYTES}},
                   f"prefill-{i}")
    argv = [*vllm_argv(python, model, port, kv, CPUS[i]), "--kv-events-config", json.dumps(events),
            "--enable-prompt-tokens-details"]  # usage.prompt_tokens_details.cached_tokens: the proxy's metrics
    url = f"http://127.0.0.1:{port}"
    return (Server(f"prefill-{i}", argv, url, logs),
            f"{url},engine_id=prefill-{i},side_channel=127.0.0.1:{side},kv_events={pub},kv_events_replay={replay}")


def start_xpyd(python: Path, model: Path, logs: Path, policies: tuple[str, ...] = POLICIES,
               engine: str = "mooncake") -> XPyD:
    # wide bounds: four servers on two cores, beside other work, stalled an engine for 60 s and a pull past the
    # default 30 s transfer timeout; a prefill's events may come that late too (--kv-silence)
    disagg = {"mode": "pull", "transport": engine, "host": "127.0.0.1", "handshake_timeout_s": 120.0,
              "probe_timeout_s": 60.0, "lease_s": 600.0, "transfer_timeout_s": 300.0}
    made: list[Server] = []
    try:  # whatever started goes again when a later step fails
        flags = []
        for i in range(2):
            server, flag = _prefill(python, model, logs, i, disagg)
            made.append(server)
            flags.append(flag)
        for i in range(2):
            port = free_port()
            kv = kv_config("kv_consumer", {"disagg": {**disagg, "port": free_port()}}, f"decode-{i}")
            made.append(Server(f"decode-{i}", vllm_argv(python, model, port, kv, CPUS[1 - i]),
                               f"http://127.0.0.1:{port}", logs))
        starts = start_all(made)
        decodes = made[2:4]  # before the proxies join `made`: a proxy must not route to another proxy
        proxies = {}
        for policy in policies:
            port = free_port()
            argv = [*PROXY, "--mode", "pull", "--port", str(port), "--policy", policy, "--health-interval", "1",
                    "--kv-silence", "300", "--prefill-timeout", "600", "--decode-timeout", "600"]
            argv += [w for flag in flags for w in ("--prefill", flag)]
            argv += [w for d in decodes for w in ("--decode", d.url)]
            proxies[policy] = Server(f"proxy-{policy}", argv, f"http://127.0.0.1:{port}", logs)
            made.append(proxies[policy])
        starts |= start_all(list(proxies.values()))
    except BaseException:
        for s in made:
            s.stop()
        raise
    return XPyD(made[:2], made[2:4], proxies, starts)


def conversations(tag: str, count: int = 4, rounds: int = 4, words: int = 250, grow: int = 120) -> list[list[str]]:
    """``count`` conversations of ``rounds`` prompts each: a ``words``-word opening, then ``grow`` more words a
    round; every text starts with ``tag`` and its conversation's number, so no two conversations share a block."""
    rng = random.Random(tag)

    def text(n: int) -> str:
        return " ".join(rng.choice(WORDS) if rng.random() < 0.85 else str(rng.randrange(1000)) for _ in range(n))

    out = []
    for c in range(count):
        prompt = f"[{tag} {c}] {text(words)}"
        turns = []
        for r in range(rounds):
            if r:
                prompt += f" Question {r}: {text(grow)}"
            turns.append(prompt)
        out.append(turns)
    return out


@dataclass
class PolicyRun:
    policy: str
    ttft_s: list[float]
    texts: dict[str, str]  # prompt -> answer
    sent: int  # the prompt tokens of its requests (vLLM's usage in each answer)
    prompt_tokens: float  # the prefills' prompt tokens, all sources
    computed: float  # ... of which they computed (vLLM's local_compute)

    @property
    def hit_rate(self) -> float:
        return 1.0 - self.computed / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def ttft_median_s(self) -> float:
        return statistics.median(self.ttft_s)


def run_policy(setup: XPyD, model: str, policy: str, convs: list[list[str]]) -> PolicyRun:
    before = [metrics(p.url) for p in setup.prefills]
    ttft: list[float] = []
    texts: dict[str, str] = {}
    sent = 0
    url = setup.proxies[policy].url
    with concurrent.futures.ThreadPoolExecutor(len(convs)) as pool:
        for r in range(len(convs[0])):
            prompts = [turns[r] for turns in convs]
            for prompt, got in zip(prompts, pool.map(
                    lambda p: client.stream(url, model, p, MAX_TOKENS, shared=True), prompts)):
                ttft.append(got.ttft_s)
                texts[prompt] = got.text
                sent += got.prompt_tokens
    by_source = settled(setup.prefills, before, sent)
    computed = sum(v for k, v in by_source.items() if 'source="local_compute"' in k)
    return PolicyRun(policy, ttft, texts, sent, sum(by_source.values()), computed)


def settled(prefills: list[Server], before: list[dict[str, float]], sent: int) -> dict[str, float]:
    """The prefills' prompt tokens by source since ``before``, once they count the ``sent`` tokens (vLLM's API
    server may update ``/metrics`` after it answered), or at ``SETTLE_S``. The row compares the two: a count that
    differs from ``sent`` means a prefill ran requests twice (it did when a proxy was given another as a decode)."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        by_source: dict[str, float] = {}
        for server, was in zip(prefills, before):
            for key, value in delta(metrics(server.url), was, SOURCE + "{").items():
                by_source[key] = by_source.get(key, 0.0) + value
        if sum(by_source.values()) >= sent or time.monotonic() > deadline:
            return by_source
        time.sleep(0.1)
