"""P/D in live `vllm serve` processes behind `kvplane proxy`: greedy outputs equal one plain instance token for
token, the KV really moved (vLLM's own `/metrics` on the decode, kvplane's byte counters on the side that moved
it), and the faults a client meets (malformed requests, a prefill killed with requests in flight and restarted,
a decode killed during a push).

One pair of servers per (mode, engine), shared by the module's tests (module scope: server starts are the cost).
`make test` runs pull over Mooncake and layer-wise push over NIXL; `make test-serve-full` every mode on both
engines. The plain reference is the prefill instance itself, asked without `kv_transfer_params` and with its own
`cache_salt`, so vLLM computes the whole prompt there and shares no prefix-cache block with the P/D requests.
"""

from __future__ import annotations

import concurrent.futures
import time
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
KV_BYTES_PER_TOKEN = 4 * 2 * 2 * 64 * 4  # layers x (k, v) x KV heads x head_dim x float32 (kvplane.bench.serve.model)
BLOCK_TOKENS = 128  # vLLM's block size on CPU
SKIPPED = 'vllm:kvplane_connector_events_total{event="receive_skipped_blocks"}'


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


def start_pair(model: Path, logs: Path, mode: str, engine: str) -> Pair:
    hp, hd, hx, sp, sd = (free_port() for _ in range(5))
    # a loaded 2-core machine may take seconds to answer: the bounds a test must not trip on are wide
    disagg = {"mode": mode, "transport": engine, "host": "127.0.0.1", "handshake_timeout_s": 60.0, "lease_s": 120.0}
    argv_p = vllm_argv(model, hp, kv_config("kv_producer", {"disagg": {**disagg, "port": sp}}, "prefill-0"),
                       "0")
    argv_d = vllm_argv(model, hd, kv_config("kv_consumer", {"disagg": {**disagg, "port": sd}}, "decode-0"),
                       "1")
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


def test_outputs_equal_one_instance_and_the_kv_moved(pair: Pair) -> None:
    before_d, before_p = metrics(pair.decode.url), metrics(pair.prefill.url)
    texts = prompts()
    got = [via_proxy(pair, p) for p in texts]
    after_d, after_p = metrics(pair.decode.url), metrics(pair.prefill.url)
    want = [reference(pair, p) for p in texts]
    equal = sum(g == w for g, w in zip(got, want))
    by_source = delta(after_d, before_d, "vllm:prompt_tokens_by_source_total")
    moved = {**delta(after_d, before_d, "vllm:kvplane_transfer_bytes_sum"),
             **{"prefill " + k: v for k, v in delta(after_p, before_p, "vllm:kvplane_transfer_bytes_sum").items()}}
    prompt_tokens = after_d["vllm:prompt_tokens_total"] - before_d["vllm:prompt_tokens_total"]
    skipped = delta(after_d, before_d, SKIPPED).get(SKIPPED, 0.0)
    print(f"\n{pair.mode}/{pair.engine}: {equal}/{len(texts)} equal; decode prompt tokens {prompt_tokens}, "
          f"by source {by_source}; kvplane bytes {moved}; blocks the decode held and did not move {skipped}")
    assert got == want
    local = by_source.get('vllm:prompt_tokens_by_source_total{source="local_compute"}', 0.0)
    external = by_source.get('vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}', 0.0)
    assert local <= len(texts), f"the decode computed {local} prompt tokens itself: {by_source}"
    assert external > 0 and sum(moved.values()) >= external * KV_BYTES_PER_TOKEN, (by_source, moved)
    hit = by_source.get('vllm:prompt_tokens_by_source_total{source="local_cache_hit"}', 0.0)
    assert hit > 0 and skipped * BLOCK_TOKENS == hit, f"{hit} tokens held by the decode, {skipped} blocks not moved"


def test_malformed_requests_leave_the_proxy_up(pair: Pair) -> None:
    url = pair.proxy.url + "/v1/completions"
    cases = {
        "no prompt": {"model": "x", "max_tokens": 4},
        "longer than the context": {"model": "x", "prompt": "the " * 5000, "max_tokens": 4},
        "max_tokens not a number": {"model": "x", "prompt": "the kv", "max_tokens": "many"},
    }
    for name, body in cases.items():
        code, answer = post(url, body)
        assert 400 <= code < 500, (name, code, answer)
    code, _ = post(url, {"raw": "x"}, headers={"content-type": "text/plain"})
    assert 400 <= code < 500
    assert status(pair.proxy.url + "/health") == 200
    assert via_proxy(pair, prompts()[0]) == reference(pair, prompts()[0])


def test_a_killed_prefill_fails_its_requests_clearly_and_a_restarted_one_serves(pair: Pair) -> None:
    if pair.mode != "pull" or pair.engine != "mooncake":
        pytest.skip("the prefill-kill case runs once, on the pull/mooncake pair (server restarts are the cost)")
    texts = prompts()
    with concurrent.futures.ThreadPoolExecutor(len(texts)) as pool:
        started = time.monotonic()
        futures = [pool.submit(complete, pair.proxy.url, p, model=str(pair.model)) for p in texts]
        time.sleep(0.2)
        pair.prefill.kill()
        answers = [f.result() for f in futures]
    took = time.monotonic() - started
    codes = [code for code, _ in answers]
    print(f"\nprefill killed: answers {codes} in {took:.1f} s")
    for code, answer in answers:
        assert code == 200 or (code >= 500 and "error" in answer), (code, answer)
    # the decode serves the next requests itself
    code, answer = complete(pair.decode.url, texts[0], model=str(pair.model))
    assert code == 200, answer
    print(f"prefill restarted in {pair.restart_prefill():.1f} s")
    assert via_proxy(pair, texts[1]) == reference(pair, texts[1])
