"""``--policy kv-aware`` without sockets: the pool's pick from the router's scores and the load, the router's plan
from the indexes and the streams (by load whenever one stream is not in step), what it records of the prefill's
answer, the prompt's ids, and the flags."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplane.proxy import Instance, ProxyConfig
from kvplane.proxy.cli import add_arguments, config_from
from kvplane.proxy.errors import ProxyConfigError
from kvplane.proxy.kv_cost import LOAD_TOKENS, TIER_WEIGHTS, value
from kvplane.proxy.kv_index import CPU, DEVICE, STORE
from kvplane.proxy.kv_stream import Phase
from kvplane.proxy.metrics import ProxyMetrics
from kvplane.proxy.pool import InstancePool
from kvplane.proxy.prompt_ids import given as ids_given
from kvplane.proxy.prompt_ids import tokenize_body
from kvplane.proxy.router import KvRouter, cached_tokens

A, B, C = (Instance.parse(f"http://10.0.0.{i}:8100,kv_events=tcp://10.0.0.{i}:5557", "prefill") for i in (1, 2, 3))
DECODE = Instance.parse("http://10.0.0.9:8200", "decode")


def test_the_instance_holding_more_of_the_prompt_wins_until_its_load_outweighs_the_hit() -> None:
    pool = InstancePool((A, B), "kv-aware")
    scores = {A.url: 0.0, B.url: 2 * LOAD_TOKENS}
    assert pool.pick(scores=scores) == B
    pool.outstanding[B.url] = 2  # two requests there cost as much as the hit saves: a tie, to the least loaded
    assert pool.pick(scores=scores) == A
    pool.outstanding[B.url] = 1
    assert pool.pick(scores=scores) == B


def test_without_scores_kv_aware_picks_by_load_and_an_instance_out_of_rotation_is_passed_over() -> None:
    pool = InstancePool((A, B, C), "kv-aware")
    pool.outstanding.update({A.url: 2, B.url: 0, C.url: 1})
    assert pool.pick() == B
    pool.up[B.url] = False
    assert pool.pick(scores={B.url: 1e9}) == C  # B holds everything but is out of rotation


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 1e5), st.integers(0, 8), st.booleans()), min_size=3, max_size=3))
def test_the_pick_has_the_highest_value_among_the_instances_in_rotation(rows: list[tuple[float, int, bool]]) -> None:
    pool = InstancePool((A, B, C), "kv-aware")
    scores = {}
    for inst, (score, outstanding, up) in zip((A, B, C), rows):
        scores[inst.url], pool.outstanding[inst.url], pool.up[inst.url] = score, outstanding, up
    chosen = pool.pick(scores=scores)
    candidates = [i for i in (A, B, C) if pool.up[i.url]] or [A, B, C]
    if any(pool.up.values()):
        best = max(value(scores[i.url], pool.outstanding[i.url]) for i in candidates)
        assert value(scores[chosen.url], pool.outstanding[chosen.url]) == best
    assert chosen in candidates


def test_the_tiers_weigh_device_over_cpu_over_store() -> None:
    assert TIER_WEIGHTS[DEVICE] > TIER_WEIGHTS[CPU] > TIER_WEIGHTS[STORE] > 0


@pytest.fixture
def router() -> Iterator[KvRouter]:
    config = ProxyConfig(prefill=(A, B), decode=(DECODE,), policy="kv-aware", kv_silence_s=5.0)
    r = KvRouter.from_config(config, ProxyMetrics())
    assert r is not None
    try:
        yield r
    finally:
        r.close()


def _sync(r: KvRouter, url: str, tokens: list[int] | None = None) -> None:
    """The stream of ``url`` in step (its batch 0 applied), with ``tokens``'s full 4-token blocks on its device."""
    feed = r.feeds[url]
    feed.stream.live(0, [])
    if tokens:
        n = len(tokens) // 4
        feed.index.stored(list(range(1, n + 1)), None, tokens[:n * 4], 4, DEVICE)


def test_the_plan_scores_each_prefill_by_the_blocks_its_index_holds(router: KvRouter) -> None:
    prompt = list(range(13))
    _sync(router, A.url, prompt[:4])
    _sync(router, B.url, prompt[:12])
    plan = router.plan(prompt)
    assert plan.how == "kv" and plan.hits == {A.url: 4, B.url: 12}
    assert plan.scores == {A.url: 4.0, B.url: 12.0}
    assert plan.due == {A.url: True, B.url: False}  # A must cache blocks it lacks: its events are due


def test_one_stream_not_in_step_makes_every_pick_by_load(router: KvRouter) -> None:
    _sync(router, A.url, list(range(8)))  # B has sent nothing yet
    plan = router.plan(list(range(9)))
    assert plan.scores is None and plan.how == "fresh"
    _sync(router, B.url)
    assert router.plan(None).how == "no_tokens"
    router.feeds[B.url].stream.live(5, [])  # a gap, and no replay endpoint: lost
    assert router.plan(list(range(9))).how == "lost"


def test_a_prefill_that_cached_new_blocks_and_sent_no_events_goes_silent(router: KvRouter) -> None:
    _sync(router, A.url, [7, 7, 7, 7])  # A's block size is known: a 9-token prompt has 2 full blocks it lacks
    _sync(router, B.url)
    plan = router.plan(list(range(9)))
    router.answered(A.url, plan, {"usage": {"prompt_tokens_details": {"cached_tokens": 0}}}, now=100.0)
    assert router.in_step(now=104.0) == "kv"
    assert router.in_step(now=106.0) == "silent" and router.feeds[A.url].stream.phase is Phase.SILENT
    router.feeds[A.url].stream.live(1, [])
    assert router.in_step(now=107.0) == "kv"


def test_the_router_counts_expected_against_reported_hit_tokens(router: KvRouter) -> None:
    prompt = list(range(9))
    _sync(router, A.url, prompt[:8])
    _sync(router, B.url)
    plan = router.plan(prompt)
    router.answered(A.url, plan, {"usage": {"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 4}}})
    router.answered(A.url, plan, {"usage": {"prompt_tokens": 9}})  # a server without prompt-tokens details
    text = router.metrics.render().decode()
    assert 'kvplane_proxy_kv_hit_tokens_total{source="expected"} 8.0' in text
    assert 'kvplane_proxy_kv_hit_tokens_total{source="reported"} 4.0' in text
    assert "kvplane_proxy_kv_expected_hit_tokens_count 2.0" in text
    assert "kvplane_proxy_kv_reported_hit_tokens_count 1.0" in text
    assert 'kvplane_proxy_kv_decisions_total{how="kv"} 1.0' in text


def test_cached_tokens_is_read_only_where_vllm_puts_it() -> None:
    assert cached_tokens({"usage": {"prompt_tokens_details": {"cached_tokens": 32}}}) == 32
    assert cached_tokens({"usage": {"prompt_tokens_details": None}}) is None
    assert cached_tokens({"usage": {"prompt_tokens_details": {"cached_tokens": True}}}) is None
    assert cached_tokens({}) is None


def test_the_prompt_ids_are_taken_from_the_request_or_asked_of_tokenize_with_the_clients_fields() -> None:
    assert ids_given("/v1/completions", {"prompt": [5, 6, 7]}) == [5, 6, 7]
    assert ids_given("/v1/completions", {"prompt": [[5, 6]]}) == [5, 6]
    assert ids_given("/v1/completions", {"prompt": "hi"}) is None
    assert tokenize_body("/v1/completions", {"model": "m", "prompt": ["hi"]}) == \
        {"model": "m", "prompt": "hi", "add_special_tokens": True}
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": False,
            "max_tokens": 5, "chat_template_kwargs": {"enable_thinking": False}}
    assert tokenize_body("/v1/chat/completions", chat) == {
        "model": "m", "messages": chat["messages"], "add_generation_prompt": False,
        "chat_template_kwargs": {"enable_thinking": False}}


def test_the_flags_give_kv_aware_its_publishers_and_refuse_what_is_missing_or_malformed() -> None:
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--prefill", "http://h:1,kv_events=tcp://h:5557,kv_events_replay=tcp://h:5558",
                         "--decode", "http://h:2", "--policy", "kv-aware", "--kv-index-entries", "64",
                         "--kv-silence", "3"])
    config = config_from(args)
    assert config.prefill[0].kv_events == "tcp://h:5557" and config.prefill[0].kv_events_replay == "tcp://h:5558"
    assert (config.kv_index_entries, config.kv_silence_s) == (64, 3.0)
    with pytest.raises(ProxyConfigError, match="kv_events='tcp://\\*:5557' is not tcp://HOST:PORT"):
        Instance.parse("http://h:1,kv_events=tcp://*:5557", "prefill")
    with pytest.raises(ProxyConfigError, match="--policy kv-aware needs each prefill's KV-event publisher"):
        ProxyConfig(prefill=(Instance.parse("http://h:1", "prefill"),), decode=(DECODE,), policy="kv-aware")
    with pytest.raises(ProxyConfigError, match="--kv-index-entries 0"):
        ProxyConfig(prefill=(A,), decode=(DECODE,), policy="kv-aware", kv_index_entries=0)
