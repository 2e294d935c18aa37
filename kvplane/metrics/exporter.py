"""``MetricsServer``: kvplane's metrics over HTTP for engines that are not vLLM (vLLM serves them on its own
``/metrics`` through the connector, see ``integrations/vllm/stats.py``).

It enables the process's ``Recorder`` and, on every scrape, takes what was recorded since the last one into
``prometheus_client`` objects in a registry of its own (so nothing else in the process shows up, and two servers
in one test do not collide), then serves the registry with ``prometheus_client.start_http_server``. Only one
consumer should take from the recorder: run one server per process, and not inside vLLM. Needs the ``metrics``
extra (``pip install kvplane[metrics]``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from kvplane.errors import KvplaneError
from kvplane.metrics.prom import PromMetrics
from kvplane.metrics.record import Recorder, recorder

PREFIX = "kvplane_"


class _TakeOnCollect:
    """Registered first: collecting it moves what the recorder holds into the metrics, then yields nothing."""

    def __init__(self, server: MetricsServer) -> None:
        self._server = server

    def collect(self) -> Iterator[Any]:
        self._server.refresh()
        return iter(())


class MetricsServer:
    def __init__(self, host: str = "127.0.0.1", port: int = 0, source: Recorder | None = None) -> None:
        """Serve on ``host:port`` (0: a free port, read back from ``.port``); ``host`` 0.0.0.0 exposes it."""
        try:
            from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
        except ImportError as e:
            raise KvplaneError(
                f"MetricsServer needs prometheus_client ({e}); pip install 'kvplane[metrics]'"
            ) from e
        self.recorder = source or recorder()
        self.registry = CollectorRegistry(auto_describe=False)
        self._lock = threading.Lock()
        self.registry.register(_TakeOnCollect(self))
        self.metrics = PromMetrics({Counter: Counter, Gauge: Gauge, Histogram: Histogram}, PREFIX,
                                   registry=self.registry)
        try:
            self._server, self.thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as e:
            raise KvplaneError(
                f"MetricsServer cannot listen on {host}:{port} ({e}); pass a free port, or port=0 for any"
            ) from e
        self.host, self.port = host, int(self._server.server_port)
        self.recorder.enable()  # only once the server is up: nothing is recorded for a consumer that never was

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def refresh(self) -> None:
        """Move what was recorded since the last refresh into the metrics (each scrape does it first)."""
        with self._lock:
            self.metrics.observe(self.recorder.take())

    def close(self) -> None:
        """Stop serving (the port is free again, the thread ended) and stop recording: nobody takes it any more."""
        self.recorder.disable()
        self._server.shutdown()
        self._server.server_close()
        self.thread.join()

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
