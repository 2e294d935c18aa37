"""``--policy kv-aware``: which prefill instance holds most of a request's prompt, weighed against load.

``KvRouter`` owns one ``Feed`` per prefill instance (its prefix index and stream machine, ``kv_events.py``) and the
subscriber thread that fills them. For a request, ``plan`` walks the prompt's token ids through every instance's
index (under that feed's lock: a dict lookup per block, no I/O) and gives ``InstancePool.pick`` the weighted hit
tokens per instance (``kv_cost.py``). It gives none, and the pool picks by load alone, while any instance's stream
is not ``SYNCED`` (not started, replaying, silent, lost) or the prompt's ids are unknown: the hits of the others
would be weighed against an unknown. ``answered`` records what the chosen prefill reported
(``usage.prompt_tokens_details.cached_tokens``, with vLLM's ``--enable-prompt-tokens-details``) against what the
router expected, and, when the prompt had full blocks the instance lacked, that a batch of events is now due there.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from kvplane.proxy import kv_cost
from kvplane.proxy.config import ProxyConfig
from kvplane.proxy.kv_events import Feed, Subscriber
from kvplane.proxy.kv_index import PrefixIndex, token_bytes
from kvplane.proxy.kv_stream import Phase, Stream
from kvplane.proxy.metrics import ProxyMetrics

logger = logging.getLogger("kvplane.proxy")


@dataclass
class Plan:
    scores: dict[str, float] | None  # weighted hit tokens per prefill URL; None: pick by load
    how: str  # "kv", or why by load: "no_tokens", or the phase of the first stream not in step
    hits: dict[str, int] = field(default_factory=dict)  # expected hit tokens (any tier) per URL
    due: dict[str, bool] = field(default_factory=dict)  # the prompt has full blocks the instance lacks


class KvRouter:
    def __init__(self, feeds: list[Feed], metrics: ProxyMetrics) -> None:
        self.feeds = {feed.url: feed for feed in feeds}
        self.metrics = metrics
        self.subscriber = Subscriber(feeds, lambda url, outcome, n: metrics.kv_events.labels(url, outcome).inc(n))

    @classmethod
    def from_config(cls, config: ProxyConfig, metrics: ProxyMetrics) -> KvRouter | None:
        if config.policy != "kv-aware":
            return None
        feeds = [Feed(inst.name, inst.kv_events, inst.kv_events_replay, PrefixIndex(config.kv_index_entries),
                      Stream(bool(inst.kv_events_replay), config.kv_silence_s)) for inst in config.prefill]
        return cls(feeds, metrics)

    def start(self) -> None:
        self.subscriber.start()

    def close(self) -> None:
        self.subscriber.close()

    def in_step(self, now: float | None = None) -> str:
        """``"kv"`` while every stream is ``SYNCED``, else the lower-case phase of the first that is not
        (``"stopped"``: the subscriber's thread ended)."""
        now = time.monotonic() if now is None else now
        if not self.subscriber.alive:
            return "stopped"
        for feed in self.feeds.values():
            with feed.lock:
                if feed.stream.tick(now):
                    self.metrics.kv_events.labels(feed.url, "silent").inc()
                    feed.once("silent", "a prefill there cached new blocks and no batch came within %g s "
                              "(--kv-silence); routing by load until one comes", feed.stream.silence_s)
                phase = feed.stream.phase
            if phase is not Phase.SYNCED:
                return phase.name.lower()
        return "kv"

    def plan(self, tokens: list[int] | None, now: float | None = None) -> Plan:
        how = self.in_step(now)
        if how == "kv" and tokens is None:
            how = "no_tokens"
        self.metrics.kv_decisions.labels(how).inc()
        if how != "kv" or tokens is None:
            return Plan(None, how)
        scores: dict[str, float] = {}
        plan = Plan(scores, how)
        raw = token_bytes(tokens)
        for url, feed in self.feeds.items():
            with feed.lock:
                tiers, size = feed.index.hit(raw), feed.index.block_size
            scores[url] = kv_cost.weighted(tiers, size)
            plan.hits[url] = len(tiers) * size
            plan.due[url] = size > 0 and len(tiers) < (len(tokens) - 1) // size
        return plan

    def answered(self, url: str, plan: Plan | None, answer: dict[str, Any], now: float | None = None) -> None:
        """The prefill ``url`` answered ``answer`` (its JSON) to a request routed by ``plan``."""
        if plan is None or plan.scores is None or url not in self.feeds:
            return
        expected = plan.hits.get(url, 0)
        self.metrics.kv_expected_tokens.observe(expected)
        reported = cached_tokens(answer)
        if reported is not None:
            self.metrics.kv_reported_tokens.observe(reported)
            self.metrics.kv_hit_tokens.labels("expected").inc(expected)
            self.metrics.kv_hit_tokens.labels("reported").inc(reported)
        if plan.due.get(url):
            feed = self.feeds[url]
            with feed.lock:
                feed.stream.expect(time.monotonic() if now is None else now)


def cached_tokens(answer: dict[str, Any]) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` of a vLLM answer (``vllm/entrypoints/openai/engine/
    protocol.py`` ``PromptTokenUsageInfo``: the prompt's tokens found cached, on the device or loaded by the KV
    connector), or None when the server does not report it."""
    usage = answer.get("usage")
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return cached if isinstance(cached, int) and not isinstance(cached, bool) else None
