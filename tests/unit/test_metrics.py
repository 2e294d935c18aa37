"""The metric objects: what the recorder keeps and hands out, how payloads add up, and what Prometheus sees."""

from __future__ import annotations

import gc
import re
import socket
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvplane.errors import KvplaneError, TransferFailed, TransferTimeout
from kvplane.metrics import names, payload, record, watch
from kvplane.metrics.exporter import MetricsServer
from kvplane.metrics.prom import PromMetrics
from kvplane.metrics.record import Recorder, cause_of

DOCS = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def enabled() -> Recorder:
    r = Recorder(source="w0")
    r.enable()
    return r


def test_a_recorder_nobody_reads_records_nothing_and_hands_callbacks_back_unwrapped() -> None:
    r = Recorder()
    r.transfer("pull", "nixl", "read", 10, 0.1)
    r.failure("pull", "x")
    r.lookup(16, 16)
    done: list[object] = []
    callback = done.append
    assert r.timed("pull", "nixl", "read", 10, callback) is callback
    assert r.take() == {"counts": {}, "transfers": {}, "gauges": {}}


def test_take_hands_out_counts_and_observations_once() -> None:
    r = enabled()
    r.transfer("pull", "nixl", "read", 4096, 0.5)
    r.transfer("pull", "nixl", "read", 8192, 0.25)
    r.failure("pull", "transfer_timeout")
    r.lease_expired()
    r.lookup(64, 48)
    r.request_ended("push", "done")
    r.request_ended("push", "timed_out")
    taken = r.take()
    assert taken["transfers"] == {"pull|nixl|read": [[4096, 0.5], [8192, 0.25]]}
    assert taken["counts"] == {"failures|pull|transfer_timeout": 1, "leases_expired": 1, "offload_queried_tokens": 64,
                               "offload_hit_tokens": 48, "failures|push|request_timed_out": 1}
    assert r.take() == {"counts": {}, "transfers": {}, "gauges": {}}
    assert r.total_bytes("pull", "nixl", "read") == 12288  # totals stay (the store tier's occupancy)


def test_a_timed_callback_records_success_by_bytes_and_failure_by_the_errors_class() -> None:
    r = enabled()
    seen: list[object] = []
    r.timed("layerwise", "mooncake", "write", 1000, seen.append)(None)
    error = TransferTimeout("gone")
    r.timed("layerwise", "mooncake", "write", 1000, seen.append)(error)
    assert seen == [None, error]  # the flow's callback still runs, with what it was given
    taken = r.take()
    [[nbytes, seconds]] = taken["transfers"]["layerwise|mooncake|write"]
    assert nbytes == 1000 and seconds >= 0
    assert taken["counts"] == {"failures|layerwise|transfer_timeout": 1}
    assert cause_of(TransferFailed("x")) == "transfer_failed"
    callback = seen.append
    assert r.timed("pull", "nixl", "read", 0, callback) is callback  # an empty plan is no transfer


def test_a_store_call_counts_the_bytes_of_the_keys_it_moved_and_each_failed_code() -> None:
    r = enabled()
    assert r.store_call("write", [100, 200, 300], lambda: [0, -200, 0])() == [0, -200, 0]
    assert r.store_call("read", [100, 200], lambda: [100, -704])() == [100, -704]

    def broken() -> list[int]:
        raise RuntimeError("rpc")

    with pytest.raises(RuntimeError):
        r.store_call("read", [100], broken)()
    taken = r.take()
    assert [b for b, _ in taken["transfers"]["store|mooncake_store|write"]] == [400]
    assert [b for b, _ in taken["transfers"]["store|mooncake_store|read"]] == [100]
    assert taken["counts"] == {"failures|store|write_rc-200": 1, "failures|store|read_rc-704": 1,
                               "failures|store|runtime_error": 1}


def test_observations_beyond_the_bound_are_dropped_and_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(record, "MAX_OBSERVATIONS", 2)
    r = enabled()
    for _ in range(5):
        r.transfer("offload", "cpu", "write", 1, 0.0)
    taken = r.take()
    assert len(taken["transfers"]["offload|cpu|write"]) == 2 and taken["counts"] == {"dropped_observations": 3}


class Side:
    def __init__(self, n: int) -> None:
        self.n = n

    def transfers_in_flight(self) -> int:
        return self.n


def read(side: Side) -> list[tuple[str, tuple[str, ...], float]]:
    return [("transfers_in_flight", ("decode",), side.n)]


def test_gauges_are_read_at_take_time_summed_over_objects_and_forgotten_with_them() -> None:
    r = enabled()
    a, b = Side(2), Side(3)
    r.watch(a, read)
    r.watch(b, read)
    assert r.take()["gauges"] == {"w0|transfers_in_flight|decode": 5.0}
    a.n = 0
    assert r.take()["gauges"] == {"w0|transfers_in_flight|decode": 3.0}
    del b
    gc.collect()
    assert r.take()["gauges"] == {"w0|transfers_in_flight|decode": 0.0}


def test_payloads_add_counts_join_observations_and_keep_each_sources_latest_gauge() -> None:
    step1 = {"loads": 1, "counts": {"leases_expired": 1}, "transfers": {"pull|nixl|read": [[10, 0.1]]},
             "gauges": {"w0|requests_in_flight|decode": 2.0, "w1|requests_in_flight|decode": 1.0}}
    step2 = {"loads": 2, "counts": {"leases_expired": 2}, "transfers": {"pull|nixl|read": [[30, 0.3]]},
             "gauges": {"w0|requests_in_flight|decode": 0.0}}
    total = payload.merge(payload.empty(), step1)
    payload.merge(total, step2)
    assert total["loads"] == 3 and total["counts"] == {"leases_expired": 3}
    assert total["transfers"] == {"pull|nixl|read": [[10, 0.1], [30, 0.3]]}
    assert payload.gauge_totals(total["gauges"]) == {"requests_in_flight|decode": 1.0}
    reduced = payload.reduce(total)
    assert reduced["pull read via nixl MB"] == round(40 / 2**20, 3) and reduced["pull read via nixl avg ms"] == 200
    assert reduced["loads"] == 3 and reduced["leases expired"] == 3
    assert payload.is_empty({"counts": {}, "transfers": {}, "gauges": {"w0|x|y": 1.0}})
    assert not payload.is_empty(step2)


def prom(registry: CollectorRegistry) -> PromMetrics:
    return PromMetrics({Counter: Counter, Gauge: Gauge, Histogram: Histogram}, "t_", ["engine"], registry=registry)


def test_prom_metrics_observe_histograms_counters_and_per_source_gauges() -> None:
    registry = CollectorRegistry()
    m = prom(registry)
    m.observe({"stores": 2, "counts": {"failures|pull|request_failed": 1, "offload_hit_tokens": 32},
               "transfers": {"pull|nixl|read": [[4096, 0.002], [8192, 0.004]]},
               "gauges": {"w0|requests_in_flight|decode": 2.0, "w1|requests_in_flight|decode": 1.0}}, ["0"])
    m.observe({"gauges": {"w0|requests_in_flight|decode": 0.0}}, ["0"])  # w1 said nothing: it keeps 1
    labels = {"engine": "0", "flow": "pull", "transport": "nixl", "direction": "read"}
    assert registry.get_sample_value("t_transfer_bytes_sum", labels) == 12288
    assert registry.get_sample_value("t_transfer_seconds_count", labels) == 2
    assert registry.get_sample_value("t_transfer_bytes_bucket", {**labels, "le": "4096.0"}) == 1
    assert registry.get_sample_value("t_failures_total", {"engine": "0", "flow": "pull", "cause": "request_failed"}) == 1
    assert registry.get_sample_value("t_offload_hit_tokens_total", {"engine": "0"}) == 32
    assert registry.get_sample_value("t_connector_events_total", {"engine": "0", "event": "stores"}) == 2
    assert registry.get_sample_value("t_requests_in_flight", {"engine": "0", "role": "decode"}) == 1


def test_gauges_keep_the_most_recent_value_across_processes_as_vllms_own_gauges_do() -> None:
    m = prom(CollectorRegistry())  # under PROMETHEUS_MULTIPROC_DIR the default ("all") adds a pid label per process
    gauges = [metric for metric in names.ALL if metric.kind == "gauge"]
    assert gauges and all(m.metrics[g.name]._multiprocess_mode == "mostrecent" for g in gauges)


def test_docs_list_every_metric_with_its_labels() -> None:
    text = DOCS.read_text()
    for m in names.ALL:
        exposed = m.name + ("_total" if m.kind == "counter" else "")
        row = re.search(rf"^\| `kvplane_{exposed}` \|([^\n]*)$", text, re.MULTILINE)
        assert row, f"docs/metrics.md has no row for kvplane_{exposed}"
        assert all(f"`{label}`" in row.group(1) for label in m.labels), f"{exposed}: labels {m.labels} not all listed"


def test_a_metrics_server_on_a_taken_port_names_the_address_and_leaves_recording_off() -> None:
    r = Recorder()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(KvplaneError, match=rf"127\.0\.0\.1:{port}.*port=0"):
            MetricsServer(port=port, source=r)
    assert not r.enabled  # nobody will take what it would record


def test_closing_a_metrics_server_stops_its_thread_frees_its_port_and_stops_recording() -> None:
    r = Recorder()
    server = MetricsServer(source=r)
    r.transfer("pull", "nixl", "read", 4096, 0.01)
    with urllib.request.urlopen(server.url, timeout=10) as response:
        assert 'kvplane_transfer_bytes_sum{direction="read",flow="pull",transport="nixl"} 4096.0' in response.read().decode()
    server.close()
    server.close()  # twice is harmless
    assert not server.thread.is_alive() and not r.enabled
    r.transfer("pull", "nixl", "read", 4096, 0.01)
    assert r.take()["transfers"] == {}  # off: nothing piles up for a consumer that is gone
    with socket.socket() as again:
        again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a scrape's TIME_WAIT, not a listener
        again.bind(("127.0.0.1", server.port))


class DrainingSide(Side):
    def pending_requests(self) -> int:
        return 3

    def draining_requests(self) -> int:  # the decode side's public count (issue 18's fence)
        return 1


def test_a_side_that_counts_draining_requests_reports_them_and_one_that_does_not_reports_none() -> None:
    r = enabled()
    with_count, without = DrainingSide(0), Side(0)
    without.pending_requests = lambda: 2  # type: ignore[attr-defined]
    r.watch(with_count, watch.side_gauges("decode"))
    assert r.take()["gauges"]["w0|requests_draining|decode"] == 1.0
    r2 = enabled()
    r2.watch(without, watch.side_gauges("decode"))
    assert not any("requests_draining" in k for k in r2.take()["gauges"])


def test_observations_dropped_for_want_of_a_consumer_show_in_prometheus_and_the_log_line() -> None:
    registry = CollectorRegistry()
    prom(registry).observe({"counts": {"dropped_observations": 3}}, ["0"])
    assert registry.get_sample_value("t_dropped_observations_total", {"engine": "0"}) == 3  # the histograms undercount
    assert payload.reduce({"counts": {"dropped_observations": 3}}) == {"dropped observations": 3}
