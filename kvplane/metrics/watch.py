"""What the gauges read: a P/D side's published counts and an offload engine's tiers, at take time only.

The flows register themselves with one line (``watch_side(self, "prefill")``, ``watch_offload(self)``); the
recorder keeps a weak reference and calls the readers here when a consumer takes a payload, on the consumer's
thread. They read counts the flows already publish for other threads (``transfers_in_flight``,
``held_requests``/``pending_requests``, the host index's free list), so nothing is added to a hot path.

Draining requests: a side with a ``draining_requests()`` method (requests that ended but wait for transfers into
their blocks to drain; the decode side's, from issue 18) is reported as ``requests_draining``; a side without it
reports nothing for that gauge.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from kvplane.metrics import names
from kvplane.metrics.record import STORE_TRANSPORT, Gauge, recorder


def side_gauges(role: str) -> Any:
    def read(side: Any) -> Iterator[Gauge]:
        yield names.TRANSFERS_IN_FLIGHT.name, (role,), side.transfers_in_flight()
        requests = side.held_requests() if role == "prefill" else side.pending_requests()
        yield names.REQUESTS_IN_FLIGHT.name, (role,), requests
        draining = getattr(side, "draining_requests", None)
        if callable(draining):
            yield names.REQUESTS_DRAINING.name, (role,), draining()

    return read


_READERS = {role: side_gauges(role) for role in ("prefill", "decode")}


def watch_side(side: Any, role: str) -> None:
    """Report ``side``'s (a ``PrefillSide`` or ``DecodeSide``) gauges under ``role`` for as long as it lives."""
    recorder().watch(side, _READERS[role])


def offload_gauges(engine: Any) -> Iterator[Gauge]:
    pool = engine.pool
    used = sum((pool.num_blocks - engine.index.pools[g].num_unused) * n for g, n in pool.block_bytes.items())
    yield names.TIER_USED.name, ("host",), used
    yield names.TIER_CAPACITY.name, ("host",), pool.nbytes
    if engine.store is not None:
        yield names.TIER_USED.name, ("store",), recorder().total_bytes("store", STORE_TRANSPORT, "write")
        yield names.TIER_CAPACITY.name, ("store",), engine.store.tier.config.segment_bytes


def watch_offload(engine: Any) -> None:
    """Report an ``OffloadEngine``'s host and store tier occupancy for as long as it lives."""
    recorder().watch(engine, offload_gauges)


def record_offload(engine: Any, job: Any, direction: str) -> None:
    """A store (``write``, device to host) or load (``read``) job of an ``OffloadEngine`` retired: its bytes and
    the time since it started (retirement is seen when the engine polls, once a step)."""
    if recorder().enabled and not job.aborted:
        nbytes = sum(len(b.host_ids) * engine.pool.block_bytes[g] for g, b in job.groups.items())
        if nbytes:
            recorder().transfer("offload", engine.backend.name, direction, nbytes, time.monotonic() - job.started)
