"""P/D in live `vllm serve` processes behind `kvplane proxy`: greedy outputs equal one plain instance token for
token, the KV really moved (vLLM's own `/metrics` on the decode, kvplane's byte counters on the side that moved
it), and the faults and bad input a client meets: malformed requests and an unknown model, a stream the client
drops, a prefill killed with requests in flight and restarted, a decode request whose prefill restarted after the
proxy's first leg, and a decode killed during a push. After each, both instances' KV usage in vLLM's `/metrics`
returns to idle (`wait_idle`: no request running or waiting, `kv_cache_usage_perc` back to its reading before).

One pair of servers per (mode, engine), shared by the module's tests (module scope: server starts are the cost).
`make test` runs pull over Mooncake and layer-wise push over NIXL; `make test-serve-full` every mode on both
engines. The plain reference is the prefill instance itself, asked without `kv_transfer_params` and with its own
`cache_salt`, so vLLM computes the whole prompt there and shares no prefix-cache block with the P/D requests.
"""

from __future__ import annotations

import concurrent.futures
import json
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from servers import FULL, vllm_argv

from kvplane.bench.serve.model import prompts
from kvplane.bench.serve.procs import (
    PROXY,
    Server,
    delta,
    free_port,
    kv_config,
    metrics,
    post,
    start_all,
    status,
)

pytestmark = pytest.mark.integration
PAIRS = [("pull", "mooncake"), ("layerwise", "nixl")]
if FULL:
    PAIRS += [("push", "mooncake"), ("pull", "nixl"), ("push", "nixl"), ("layerwise", "mooncake")]
MAX_TOKENS = 16
LONG_TOKENS = 1024  # the decode-kill test's answers: the longest prompt (2039 tokens) plus these fit 4096
KV_BYTES_PER_TOKEN = 4 * 2 * 2 * 64 * 4  # layers x (k, v) x KV heads x head_dim x float32 (kvplane.bench.serve.model)
BLOCK_TOKENS = 128  # vLLM's block size on CPU
SKIPPED = 'vllm:kvplane_connector_events_total{event="receive_skipped_blocks"}'
SOURCE = "vllm:prompt_tokens_by_source_total"
USAGE, RUNNING, WAITING = "vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting"
LEASE_S = 45.0  # a prefill holds a request whose decode vanished this long (the default 30 s, widened for load)
IDLE_DEADLINE_S = 600.0  # far past LEASE_S: only turns a leak into a failure


@dataclass
class Pair:
    mode: str
    engine: str
    model: Path
    logs: Path
    prefill: Server
    decode: Server
    proxy: Server
    started: dict[str, float]
    prefill_argv: list[str]

    def restart_prefill(self) -> float:
        self.prefill = Server("prefill", self.prefill_argv, self.prefill.url, self.logs)
        return self.prefill.wait_ready()


def start_pair(model: Path, logs: Path, mode: str, engine: str, extra: tuple[str, ...] = ()) -> Pair:
    """A prefill and a decode (``extra``: more vLLM flags for both) behind `kvplane proxy`."""
    hp, hd, hx, sp, sd = (free_port() for _ in range(5))
    # a loaded 2-core machine may take seconds to answer: the bounds a test must not trip on are wide
    disagg = {"mode": mode, "transport": engine, "host": "127.0.0.1", "handshake_timeout_s": 60.0, "lease_s": LEASE_S,
              "probe_timeout_s": 30.0}
    argv_p = [*vllm_argv(model, hp, kv_config("kv_producer", {"disagg": {**disagg, "port": sp}}, "prefill-0"),
                         "0"), *extra]
    argv_d = [*vllm_argv(model, hd, kv_config("kv_consumer", {"disagg": {**disagg, "port": sd}}, "decode-0"),
                         "1"), *extra]
    prefill = Server("prefill", argv_p, f"http://127.0.0.1:{hp}", logs)
    decode = Server("decode", argv_d, f"http://127.0.0.1:{hd}", logs)
    started = start_all([prefill, decode])
    prefill_flag = f"http://127.0.0.1:{hp},engine_id=prefill-0,side_channel=127.0.0.1:{sp}"
    proxy = Server("proxy", [*PROXY, "--mode", mode, "--port", str(hx), "--prefill", prefill_flag, "--decode",
                             decode.url, "--health-interval", "1"], f"http://127.0.0.1:{hx}", logs)
    started |= start_all([proxy])
    return Pair(mode, engine, model, logs, prefill, decode, proxy, started, argv_p)


@pytest.fixture(scope="module", params=PAIRS, ids=[f"{m}-{e}" for m, e in PAIRS])
def pair(request: pytest.FixtureRequest, model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    mode, engine = request.param
    made = start_pair(model, tmp_path_factory.mktemp(f"{mode}-{engine}"), mode, engine)
    print(f"\n{mode}/{engine}: server start {made.started}")
    yield made
    for s in (made.proxy, made.decode, made.prefill):
        s.stop()


def complete(url: str, prompt: str, **extra: object) -> tuple[int, dict[str, object]]:
    body = {"model": "", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, **extra}
    return post(url + "/v1/completions", body)


def reference(pair: Pair, prompt: str) -> str:
    body = {"model": str(pair.model), "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "cache_salt": uuid.uuid4().hex}
    code, answer = post(pair.prefill.url + "/v1/completions", body)
    assert code == 200, answer
    return str(answer["choices"][0]["text"])  # type: ignore[index]


def via_proxy(pair: Pair, prompt: str) -> str:
    from openai import OpenAI

    client = OpenAI(base_url=pair.proxy.url + "/v1", api_key="none", max_retries=0, timeout=300)
    answer = client.completions.create(model=str(pair.model), prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    return answer.choices[0].text


def outputs_equal_and_kv_moved(pair: Pair, label: str, kv_bytes_per_token: int) -> tuple[dict[str, float], float]:
    """The 8 prompts through the proxy equal the prefill asked plainly, the decode computed no prompt token beyond
    one per request, and kvplane moved the bytes of every token received; (the decode's prompt tokens by source,
    blocks its own prefix cache held and kvplane did not move)."""
    before_d, before_p = metrics(pair.decode.url), metrics(pair.prefill.url)
    texts = prompts()
    got = [via_proxy(pair, p) for p in texts]
    after_d, after_p = metrics(pair.decode.url), metrics(pair.prefill.url)
    want = [reference(pair, p) for p in texts]
    equal = sum(g == w for g, w in zip(got, want))
    by_source = delta(after_d, before_d, SOURCE)
    moved = {**delta(after_d, before_d, "vllm:kvplane_transfer_bytes_sum"),
             **{"prefill " + k: v for k, v in delta(after_p, before_p, "vllm:kvplane_transfer_bytes_sum").items()}}
    prompt_tokens = after_d["vllm:prompt_tokens_total"] - before_d["vllm:prompt_tokens_total"]
    skipped = delta(after_d, before_d, SKIPPED).get(SKIPPED, 0.0)
    print(f"\n{label}: {equal}/{len(texts)} equal; decode prompt tokens {prompt_tokens}, by source {by_source}; "
          f"kvplane bytes {moved}; blocks the decode held and did not move {skipped}")
    assert got == want
    local = by_source.get(f'{SOURCE}{{source="local_compute"}}', 0.0)
    external = by_source.get(f'{SOURCE}{{source="external_kv_transfer"}}', 0.0)
    assert local <= len(texts), f"the decode computed {local} prompt tokens itself: {by_source}"
    assert external > 0 and sum(moved.values()) >= external * kv_bytes_per_token, (by_source, moved)
    return by_source, skipped


def test_outputs_equal_one_instance_and_the_kv_moved(pair: Pair) -> None:
    by_source, skipped = outputs_equal_and_kv_moved(pair, f"{pair.mode}/{pair.engine}", KV_BYTES_PER_TOKEN)
    hit = by_source.get(f'{SOURCE}{{source="local_cache_hit"}}', 0.0)
    assert hit > 0 and skipped * BLOCK_TOKENS == hit, f"{hit} tokens held by the decode, {skipped} blocks not moved"


def idle(url: str) -> tuple[float, float]:
    """(KV usage, requests running or waiting) of one instance."""
    m = metrics(url)
    return m[USAGE], m[RUNNING] + m[WAITING]


def wait_idle(servers: list[Server], usage_before: dict[str, float]) -> None:
    """Wait until every server runs no request and holds no more KV than `usage_before[name]`; fail naming the
    server and its readings when that does not happen far past the leases' bound."""
    started = time.monotonic()
    while True:
        now = {s.name: idle(s.url) for s in servers}
        if all(usage <= usage_before[name] + 1e-9 and busy == 0 for name, (usage, busy) in now.items()):
            print(f"idle again in {time.monotonic() - started:.1f} s: {now}")
            return
        assert time.monotonic() - started < IDLE_DEADLINE_S, f"still busy (usage, requests): {now}, {usage_before}"
        time.sleep(0.5)


def test_malformed_requests_and_an_unknown_model_leave_the_proxy_up_and_the_instances_idle(pair: Pair) -> None:
    url = pair.proxy.url + "/v1/completions"
    before = {s.name: idle(s.url)[0] for s in (pair.prefill, pair.decode)}
    cases = {
        "no prompt": {"model": "x", "max_tokens": 4},
        "longer than the context": {"model": "x", "prompt": "the " * 5000, "max_tokens": 4},
        "max_tokens not a number": {"model": "x", "prompt": "the kv", "max_tokens": "many"},
        "unknown model": {"model": "no-such-model", "prompt": prompts()[0], "max_tokens": 4},
    }
    for name, body in cases.items():
        code, answer = post(url, body)
        assert 400 <= code < 500, (name, code, answer)
    code, _ = post(url, {"raw": "x"}, headers={"content-type": "text/plain"})
    assert 400 <= code < 500
    assert status(pair.proxy.url + "/health") == 200
    wait_idle([pair.prefill, pair.decode], before)
    assert via_proxy(pair, prompts()[0]) == reference(pair, prompts()[0])


def test_a_stream_the_client_drops_leaves_both_instances_idle(pair: Pair) -> None:
    before = {s.name: idle(s.url)[0] for s in (pair.prefill, pair.decode)}
    body = {"model": str(pair.model), "prompt": prompts()[2], "max_tokens": 200, "temperature": 0, "stream": True,
            "ignore_eos": True}
    req = urllib.request.Request(pair.proxy.url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        first = r.readline()  # the first event: the decode is streaming, then the client goes away
    assert first.startswith(b"data: "), first
    wait_idle([pair.prefill, pair.decode], before)
    assert via_proxy(pair, prompts()[1]) == reference(pair, prompts()[1])


def test_a_killed_prefill_fails_its_requests_clearly_and_a_restarted_one_serves(pair: Pair) -> None:
    if pair.mode != "pull" or pair.engine != "mooncake":
        pytest.skip("the prefill-kill case runs once, on the pull/mooncake pair (server restarts are the cost)")
    texts = prompts()
    # the proxy's first leg done by hand: the prefill holds this request's KV for a pull that comes after its restart
    code, first_leg = complete(pair.prefill.url, texts[4], model=str(pair.model), max_tokens=1,
                               kv_transfer_params={"do_remote_decode": True})
    assert code == 200 and first_leg.get("kv_transfer_params"), first_leg
    # fresh salts: neither side's prefix cache holds these prompts (the earlier tests sent them), so the KV must
    # move and the kill finds requests in flight, not answers both caches could give without the prefill
    with concurrent.futures.ThreadPoolExecutor(len(texts)) as pool:
        started = time.monotonic()
        futures = [pool.submit(complete, pair.proxy.url, p, model=str(pair.model), cache_salt=uuid.uuid4().hex)
                   for p in texts]
        while sum(idle(pair.prefill.url)) == 0 and not all(f.done() for f in futures):
            time.sleep(0.05)  # the kill comes once the prefill is working on them
        pair.prefill.kill()
        answers = [f.result() for f in futures]
    took = time.monotonic() - started
    codes = [code for code, _ in answers]
    print(f"\nprefill killed: answers {codes} in {took:.1f} s")
    for code, answer in answers:
        assert code == 200 or (code >= 500 and "error" in answer), (code, answer)
    assert any(code >= 500 for code in codes), "the prefill died after every request had its KV"
    # the decode serves the next requests itself
    code, answer = complete(pair.decode.url, texts[0], model=str(pair.model))
    assert code == 200, answer
    print(f"prefill restarted in {pair.restart_prefill():.1f} s")
    before = {pair.prefill.name: 0.0, pair.decode.name: 0.0}
    # the second leg, to the restarted prefill's address: its KV is gone, so the decode must fail it clearly
    code, answer = complete(pair.decode.url, texts[4], model=str(pair.model),
                            kv_transfer_params=first_leg["kv_transfer_params"])
    print(f"a decode leg whose prefill restarted: {code} {str(answer)[:300]}")
    assert code == 200 and answer["choices"][0]["text"] == reference(pair, texts[4]) or (  # type: ignore[index]
        code >= 500 and "error" in answer), (code, answer)
    wait_idle([pair.prefill, pair.decode], before)
    assert via_proxy(pair, texts[1]) == reference(pair, texts[1])


def test_a_decode_killed_during_a_push_leaves_the_prefills_kv_usage_where_it_was(pair: Pair) -> None:
    if pair.mode == "pull":
        pytest.skip("a decode killed during a push needs a push mode; the pull pair's faults are the prefill's")
    texts = prompts()
    before = {pair.prefill.name: idle(pair.prefill.url)[0]}
    bytes_before = metrics(pair.prefill.url)
    # fresh salts (no prefix cache holds these prompts, so every request needs a push) and long answers that
    # ignore EOS (a request the decode runs is still running when the kill comes, on any machine's speed)
    long = {"model": str(pair.model), "max_tokens": LONG_TOKENS, "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(len(texts)) as pool:
        futures = [pool.submit(complete, pair.proxy.url, p, **long, cache_salt=uuid.uuid4().hex) for p in texts]
        pushed: dict[str, float] = {}
        decoding = 0.0
        while not (pushed and decoding) and not all(f.done() for f in futures):
            pushed = delta(metrics(pair.prefill.url), bytes_before, "vllm:kvplane_transfer_bytes_sum")
            decoding = metrics(pair.decode.url)[RUNNING]  # the kill comes once the decode runs pushed requests
            time.sleep(0.05)
        pair.decode.kill()  # the module's last test on this pair: the decode stays dead
        answers = [f.result() for f in futures]
    codes = [code for code, _ in answers]
    print(f"\ndecode killed running {decoding:.0f} after the prefill pushed {pushed}: answers {codes}")
    assert pushed and not all(code == 200 for code in codes), "the decode died after every request had finished"
    for code, answer in answers:
        assert code == 200 or (code >= 500 and "error" in answer), (code, answer)
    # the requests the prefill pushed for end when their lease does (nothing tells the prefill the decode died)
    wait_idle([pair.prefill], before)
    assert status(pair.prefill.url + "/health") == 200
