"""The proxy's Prometheus metrics, in a registry of its own (served at ``/metrics``).

- ``kvplane_proxy_requests_total{endpoint, mode, outcome}``: requests answered (``ok``, ``error``, ``fallback``,
  ``retried``);
- ``kvplane_proxy_leg_seconds{leg}``: time of each leg (``prefill``, ``decode`` to its last byte, ``total``);
- ``kvplane_proxy_errors_total{cause}``: failures by cause (``prefill_timeout``, ``decode_bad_json``, ...);
- ``kvplane_proxy_in_flight``: requests being served; ``kvplane_proxy_instance_up{role, url}``: health;
- ``kvplane_proxy_instance_requests_total{role, url}``: requests sent to each instance;
- ``kvplane_proxy_transfer_retries_total{endpoint, mode}``: P/D requests sent once more without
  ``kv_transfer_params`` after their decode answered a 5xx (``--on-transfer-failure retry-plain``).

``--policy kv-aware`` (``router.py``):

- ``kvplane_proxy_kv_decisions_total{how}``: prefill picks by prefix hit and load (``kv``), or by load alone and
  why (``no_tokens``, ``stopped``, or the phase of a stream not in step: ``fresh``, ``replaying``, ``silent``,
  ``lost``);
- ``kvplane_proxy_kv_events_total{url, outcome}``: per instance, batches applied (``batch``) and each odd thing:
  ``replay``, ``restart``, ``lost``, ``silent``, ``bad_frame``, ``unknown_source``, ``unknown_event``, and
  ``evicted`` (index entries dropped at ``--kv-index-entries``);
- ``kvplane_proxy_kv_expected_hit_tokens``: per request picked by hit, the prompt tokens the router expected the
  chosen prefill to hold (any tier); ``kvplane_proxy_kv_reported_hit_tokens``: what that prefill reported
  (``usage.prompt_tokens_details.cached_tokens``, vLLM's ``--enable-prompt-tokens-details``);
- ``kvplane_proxy_kv_hit_tokens_total{source}``: the sums of both (``expected``, ``reported``) over the requests
  whose prefill reported, so their ratio is the router's accuracy.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

TOKEN_BUCKETS = (0, 16, 64, 256, 1024, 4096, 16384, 65536, 262144)
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class ProxyMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("kvplane_proxy_requests", "Requests answered by the proxy",
                                ["endpoint", "mode", "outcome"], registry=self.registry)
        self.leg_seconds = Histogram("kvplane_proxy_leg_seconds", "Time of each leg of a request", ["leg"],
                                     buckets=BUCKETS, registry=self.registry)
        self.errors = Counter("kvplane_proxy_errors", "Failed requests by cause", ["cause"],
                              registry=self.registry)
        self.in_flight = Gauge("kvplane_proxy_in_flight", "Requests being served", registry=self.registry)
        self.instance_up = Gauge("kvplane_proxy_instance_up", "1 while the instance passes its health checks",
                                 ["role", "url"], registry=self.registry)
        self.instance_requests = Counter("kvplane_proxy_instance_requests", "Requests sent to each instance",
                                         ["role", "url"], registry=self.registry)
        self.transfer_retries = Counter("kvplane_proxy_transfer_retries",
                                        "P/D requests retried without kv_transfer_params after a decode's 5xx",
                                        ["endpoint", "mode"], registry=self.registry)

        self.kv_decisions = Counter("kvplane_proxy_kv_decisions", "kv-aware prefill picks, by hit or by load and why",
                                    ["how"], registry=self.registry)
        self.kv_events = Counter("kvplane_proxy_kv_events", "KV-event batches and stream faults per instance",
                                 ["url", "outcome"], registry=self.registry)
        self.kv_expected_tokens = Histogram("kvplane_proxy_kv_expected_hit_tokens",
                                            "Prompt tokens the router expected the chosen prefill to hold",
                                            buckets=TOKEN_BUCKETS, registry=self.registry)
        self.kv_reported_tokens = Histogram("kvplane_proxy_kv_reported_hit_tokens",
                                            "Prompt tokens the chosen prefill reported cached (cached_tokens)",
                                            buckets=TOKEN_BUCKETS, registry=self.registry)
        self.kv_hit_tokens = Counter("kvplane_proxy_kv_hit_tokens", "Expected and reported hit tokens, summed over "
                                     "requests whose prefill reported cached_tokens", ["source"],
                                     registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)
