"""The stats payload: the plain, serialisable dict a ``Recorder`` hands out and vLLM carries between processes.

vLLM moves it from each worker to the engine core and on to the metrics loggers (pickled or msgpack-encoded), adds
workers' and steps' payloads together through ``KVPlaneStats.aggregate`` (``merge`` here) and logs ``reduce``.
Layout, all keys strings::

    {"loads": 3, ...}                                      # the connector's event counts (added)
    "counts":    {"failures|pull|transfer_timeout": 1}     # name|label values -> count (added)
    "transfers": {"pull|nixl|read": [[bytes, seconds]]}    # flow|transport|direction -> observations (joined)
    "gauges":    {"4711|requests_in_flight|decode": 2.0}   # source|name|label values -> value (latest wins)

A gauge is keyed by its source (a process id) so that workers add up while a later step replaces an earlier one.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

Payload = dict[str, Any]
SEP = "|"
SECTIONS = ("counts", "transfers", "gauges")


def key(*parts: str) -> str:
    return SEP.join(parts)


def split(k: str) -> list[str]:
    return k.split(SEP)


def empty() -> Payload:
    return {"counts": {}, "transfers": {}, "gauges": {}}


def merge(into: Payload, other: Payload) -> Payload:
    """Add ``other`` to ``into`` (in place) and return it: counts add, observations join, gauges are replaced."""
    for name, value in other.items():
        if name == "counts":
            counts = into.setdefault("counts", {})
            for k, n in value.items():
                counts[k] = counts.get(k, 0) + n
        elif name == "transfers":
            transfers = into.setdefault("transfers", {})
            for k, observations in value.items():
                transfers.setdefault(k, []).extend(observations)
        elif name == "gauges":
            into.setdefault("gauges", {}).update(value)
        elif isinstance(value, (int, float)):
            into[name] = into.get(name, 0) + value
    return into


def is_empty(payload: Payload) -> bool:
    """No event, count or observation (gauges alone do not make a payload worth logging)."""
    return not (
        any(v for k, v in payload.items() if k not in SECTIONS and isinstance(v, (int, float)))
        or any(payload.get("counts", {}).values())
        or any(payload.get("transfers", {}).values())
    )


def gauge_totals(gauges: dict[str, float]) -> dict[str, float]:
    """``name|labels`` -> the sum over sources (each source's latest value)."""
    out: dict[str, float] = defaultdict(float)
    for k, value in gauges.items():
        out[SEP.join(split(k)[1:])] += value
    return dict(out)


def reduce(payload: Payload) -> dict[str, int | float]:
    """One interval in a few numbers for vLLM's log line: events, per-flow volume and mean latency, failures."""
    out: dict[str, int | float] = {
        k: v for k, v in payload.items() if k not in SECTIONS and isinstance(v, (int, float))
    }
    for k, observations in sorted(payload.get("transfers", {}).items()):
        if observations:
            flow, transport, direction = split(k)
            label = f"{flow} {direction} via {transport}"
            total_bytes = sum(b for b, _ in observations)
            out[f"{label} MB"] = round(total_bytes / 2**20, 3)
            out[f"{label} avg ms"] = round(1e3 * sum(s for _, s in observations) / len(observations), 3)
    counts = payload.get("counts", {})
    for k, n in sorted(counts.items()):
        if k.startswith("failures" + SEP) and n:
            _, flow, cause = split(k)
            out[f"{flow} failures ({cause})"] = n
    if counts.get("leases_expired"):
        out["leases expired"] = counts["leases_expired"]
    if counts.get("dropped_observations"):
        out["dropped observations"] = counts["dropped_observations"]
    queried = counts.get("offload_queried_tokens", 0)
    if queried:
        out["offload hit rate"] = round(counts.get("offload_hit_tokens", 0) / queried, 4)
    return out
