"""Metrics: what kvplane's flows count and time, for vLLM's stats path and for Prometheus.

The flows record into one process-wide ``Recorder`` (``recorder()``) with one-line calls, once per transfer or
per request, never per block. Two consumers read it:

- inside vLLM, the worker-side connector hands ``Recorder.take()`` to vLLM as ``KVPlaneStats`` (a
  ``KVConnectorStats``); vLLM aggregates it over workers and steps, logs ``reduce()`` and feeds
  ``KVPlanePromMetrics`` (``build_prom_metrics``) into its own ``/metrics``;
- elsewhere, ``MetricsServer`` (``exporter.py``, needs ``prometheus_client``) serves the same metrics over HTTP.

``names.py`` lists every metric once; ``payload.py`` is the serialisable form that travels between processes.
"""

from kvplane.metrics.record import Recorder, recorder

__all__ = ["Recorder", "recorder"]
