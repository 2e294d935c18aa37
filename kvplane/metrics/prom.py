"""``PromMetrics``: kvplane's metrics (``names.ALL``) as Prometheus objects, fed from stats payloads.

Built with the metric classes it is given: vLLM hands its own (``KVConnectorPromMetrics``' ``metric_types``, which
are multiprocess-aware) and its per-engine labels (``model_name``, ``engine``); the standalone exporter passes
``prometheus_client``'s classes and a registry. ``observe`` takes one payload (one step of one engine in vLLM, one
scrape's worth elsewhere): histograms observe each transfer, counters add, gauges are set to the sum over sources
of each source's latest value (a source that reported nothing this step keeps its last value).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvplane.metrics import names, payload

LEGACY_EVENTS = ("loads", "stores", "receives", "sends", "failed_receives", "load_error_blocks")


class PromMetrics:
    def __init__(self, metric_types: Mapping[type, type], prefix: str, base_labels: Sequence[str] = (),
                 registry: Any = None) -> None:
        """``metric_types``: ``{prometheus_client.Counter: cls, Gauge: cls, Histogram: cls}``."""
        from prometheus_client import Counter, Gauge, Histogram

        classes = {"counter": metric_types[Counter], "gauge": metric_types[Gauge],
                   "histogram": metric_types[Histogram]}
        self.base_labels = tuple(base_labels)
        self.metrics: dict[str, Any] = {}
        extra = {} if registry is None else {"registry": registry}
        for m in names.ALL:
            kwargs: dict[str, Any] = {"labelnames": [*self.base_labels, *m.labels], **extra}
            if m.kind == "histogram":
                kwargs["buckets"] = list(m.buckets)
            if m.kind == "gauge":  # as vLLM's gauges: one value per series, not one per process, in multiprocess mode
                kwargs["multiprocess_mode"] = "mostrecent"
            self.metrics[m.name] = classes[m.kind](name=prefix + m.name, documentation=m.help, **kwargs)
        self._gauges: dict[tuple[str, ...], dict[str, float]] = {}  # base labels -> source|name|labels -> value

    def _child(self, metric: names.Metric, base: tuple[str, ...], labels: Sequence[str]) -> Any:
        parent = self.metrics[metric.name]
        return parent.labels(*base, *labels) if base or labels else parent

    def observe(self, data: Mapping[str, Any], base_labelvalues: Sequence[object] = ()) -> None:
        base = tuple(str(v) for v in base_labelvalues)
        for k, observations in data.get("transfers", {}).items():
            labels = payload.split(k)
            sizes = self._child(names.TRANSFER_BYTES, base, labels)
            seconds = self._child(names.TRANSFER_SECONDS, base, labels)
            for nbytes, secs in observations:
                sizes.observe(nbytes)
                seconds.observe(secs)
        for k, n in data.get("counts", {}).items():
            name, *labels = payload.split(k)
            metric = next((m for m in names.ALL if m.name == name and m.kind == "counter"), None)
            if metric is not None and len(labels) == len(metric.labels) and n > 0:
                self._child(metric, base, labels).inc(n)
        for event in LEGACY_EVENTS:
            if data.get(event):
                self._child(names.CONNECTOR_EVENTS, base, (event,)).inc(data[event])
        latest = self._gauges.setdefault(base, {})
        latest.update(data.get("gauges", {}))
        for k, value in payload.gauge_totals(latest).items():
            name, *labels = payload.split(k)
            metric = next((m for m in names.ALL if m.name == name and m.kind == "gauge"), None)
            if metric is not None and len(labels) == len(metric.labels):
                self._child(metric, base, labels).set(value)
