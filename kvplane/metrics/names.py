"""Every metric kvplane exports, defined once: name, kind, labels, help text and histogram buckets.

``prom.PromMetrics`` builds them with whichever Prometheus classes it is given (vLLM's, or plain
``prometheus_client`` ones), under a prefix (``vllm:kvplane_`` inside vLLM, ``kvplane_`` elsewhere). docs/metrics.md
describes the same list; a test checks the two agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["counter", "gauge", "histogram"]

# transfer flows: offload (device <-> host tier), store (host tier <-> Mooncake Store), and the P/D modes
FLOWS = ("offload", "store", "pull", "push", "layerwise")
# bytes arriving into this rank's KV or host tier ("read") or leaving it ("write")
DIRECTIONS = ("read", "write")
SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BYTES_BUCKETS = tuple(float(4 ** i * 4096) for i in range(12))  # 4 KiB .. 16 GiB


@dataclass(frozen=True)
class Metric:
    name: str  # without prefix; counters get Prometheus's "_total" suffix on exposition
    kind: Kind
    labels: tuple[str, ...]
    help: str
    buckets: tuple[float, ...] = ()


TRANSFER_BYTES = Metric(
    "transfer_bytes", "histogram", ("flow", "transport", "direction"),
    "Bytes per completed transfer (its _sum is the bytes moved), by flow, transport and direction.", BYTES_BUCKETS,
)
TRANSFER_SECONDS = Metric(
    "transfer_seconds", "histogram", ("flow", "transport", "direction"),
    "Seconds from submitting a transfer to seeing it complete, by flow, transport and direction.", SECONDS_BUCKETS,
)
FAILURES = Metric("failures", "counter", ("flow", "cause"), "Failed transfers and requests, by flow and cause.")
LEASES_EXPIRED = Metric("leases_expired", "counter", (), "Prefill leases that expired before decode finished.")
OFFLOAD_QUERIED = Metric("offload_queried_tokens", "counter", (), "Tokens looked up in the offload tiers.")
OFFLOAD_HIT = Metric("offload_hit_tokens", "counter", (), "Looked-up tokens found in the host or store tier.")
TIER_USED = Metric("tier_used_bytes", "gauge", ("tier",),
                   "Bytes held: host = host blocks in use or cached; store = bytes this process put (an upper bound).")
TIER_CAPACITY = Metric("tier_capacity_bytes", "gauge", ("tier",),
                       "Bytes available: host = the host pool; store = the segment this process gave the store.")
REQUESTS_IN_FLIGHT = Metric("requests_in_flight", "gauge", ("role",),
                            "P/D requests handed to kvplane and not yet reported back (prefill: held, decode: receiving).")
TRANSFERS_IN_FLIGHT = Metric("transfers_in_flight", "gauge", ("role",),
                             "P/D transfer plans queued for or moving through the transport.")
REQUESTS_DRAINING = Metric("requests_draining", "gauge", ("role",),
                           "P/D requests that ended but wait for transfers into their blocks to drain.")
DROPPED_OBSERVATIONS = Metric("dropped_observations", "counter", (),
                              "Transfers left out of the histograms: more than MAX_OBSERVATIONS waited for a consumer.")
CONNECTOR_EVENTS = Metric("connector_events", "counter", ("event",),
                          "vLLM connector events: loads, stores, receives, sends, failed_receives, load_error_blocks.")

ALL: tuple[Metric, ...] = (
    TRANSFER_BYTES, TRANSFER_SECONDS, FAILURES, LEASES_EXPIRED, OFFLOAD_QUERIED, OFFLOAD_HIT, TIER_USED,
    TIER_CAPACITY, REQUESTS_IN_FLIGHT, TRANSFERS_IN_FLIGHT, REQUESTS_DRAINING, DROPPED_OBSERVATIONS, CONNECTOR_EVENTS,
)
