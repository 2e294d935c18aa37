"""The connector's metrics go through vLLM's own stats path, on the installed vLLM (0.27.1 and 0.33.0).

vLLM's real ``Scheduler`` steps the connector (``realsched.py``); what it reports per step (``SchedulerStats``,
built by vLLM's ``make_stats`` from ``get_kv_connector_stats``) is handed to vLLM's own ``PrometheusStatLogger``
(which builds ``KVPlanePromMetrics`` through ``build_prom_metrics``) and ``LoggingStatLogger`` (which rebuilds
``KVPlaneStats`` through ``build_kv_connector_stats`` and aggregates them), and two workers' stats go through
vLLM's ``KVOutputAggregator``. The bytes the metrics show are the bytes of the blocks the flows moved.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the vLLM connector tests need vLLM: pip install --no-deps vllm==0.27.1 + .[vllm]")

from ports import free_port  # noqa: E402
from prometheus_client import REGISTRY  # noqa: E402
from realsched import BLOCK, RealEngine  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator  # noqa: E402
from vllm.v1.metrics.loggers import LoggingStatLogger, PrometheusStatLogger  # noqa: E402
from vllm.v1.metrics.prometheus import unregister_vllm_metrics  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402

from kvplane.integrations.vllm import KVPlaneConnector  # noqa: E402
from kvplane.integrations.vllm.stats import KVPlanePromMetrics, KVPlaneStats  # noqa: E402
from kvplane.metrics import recorder  # noqa: E402

PROMPT = [(i * 17 + 3) % 997 for i in range(64)]  # 4 full blocks of 16
QUICK = {"lease_s": 10.0, "heartbeat_s": 0.5, "handshake_timeout_s": 2.0, "transfer_timeout_s": 5.0,
         "drain_timeout_s": 1.0}


@pytest.fixture(autouse=True)
def fresh_metrics() -> Iterator[None]:
    unregister_vllm_metrics()
    recorder().take()  # what earlier tests in this process recorded is not this test's
    yield
    unregister_vllm_metrics()


def sample(name: str, **labels: str) -> float:
    value = REGISTRY.get_sample_value(name, labels)
    assert value is not None, f"{name}{labels} is not in vLLM's registry"
    return value


def record(prom: PrometheusStatLogger, engine: RealEngine, engine_idx: int = 0) -> None:
    for stats in engine.stats:
        prom.record(scheduler_stats=stats, iteration_stats=None, engine_idx=engine_idx)


def test_offload_stats_reach_vllms_prometheus_logger_and_its_log_line(model_dir: str,
                                                                      engines: list[RealEngine]) -> None:
    engine = RealEngine(model_dir, {"offload": {"host_bytes": 4 << 20, "pinned": False}})
    engines.append(engine)
    engine.add("a", PROMPT)
    engine.finish("a")
    engine.drain()
    engine.add("b", PROMPT + [5, 6])
    engine.finish("b")
    engine.drain()
    block = engine.worker.worker.offload.pool.block_bytes[0]
    payloads = [s.kv_connector_stats for s in engine.stats if s.kv_connector_stats is not None]
    assert payloads, "vLLM's scheduler reported no connector stats"
    reported = copy.deepcopy(payloads)

    prom = PrometheusStatLogger(engine.config, engine_indexes=[0])
    assert isinstance(prom.kv_connector_prom.prom_metrics, KVPlanePromMetrics)  # from build_prom_metrics
    record(prom, engine)
    model = engine.config.model_config.served_model_name
    labels = {"model_name": model, "engine": "0", "transport": "cpu"}
    assert sample("vllm:kvplane_transfer_bytes_sum", flow="offload", direction="write", **labels) == 4 * block
    assert sample("vllm:kvplane_transfer_bytes_sum", flow="offload", direction="read", **labels) == 4 * block
    assert sample("vllm:kvplane_transfer_seconds_count", flow="offload", direction="read", **labels) == 1
    hits = sample("vllm:kvplane_offload_hit_tokens_total", model_name=model, engine="0")
    assert hits >= 4 * BLOCK and sample("vllm:kvplane_offload_queried_tokens_total", model_name=model,
                                        engine="0") > hits  # "a" missed
    assert sample("vllm:kvplane_connector_events_total", model_name=model, engine="0", event="stores") >= 1
    assert sample("vllm:kvplane_tier_used_bytes", model_name=model, engine="0", tier="host") == 4 * block
    assert sample("vllm:kvplane_tier_capacity_bytes", model_name=model, engine="0", tier="host") \
        == engine.worker.worker.offload.pool.nbytes

    log = LoggingStatLogger(engine.config)
    for stats in engine.stats:
        log.record(scheduler_stats=stats, iteration_stats=None)
    accumulated = log.kv_connector_logging.transfer_stats_accumulator  # built by build_kv_connector_stats
    assert isinstance(accumulated, KVPlaneStats)
    line: list[str] = []
    log.kv_connector_logging.log(log_fn=lambda fmt, *args: line.append(fmt % args))
    assert line and f"offload write via cpu MB={round(4 * block / 2**20, 3)}" in line[0]
    assert payloads == reported  # vLLM hands the same dicts to every logger: aggregating must not change them


def test_a_pull_between_two_engines_shows_its_bytes_under_vllms_engine_labels(model_dir: str,
                                                                             engines: list[RealEngine]) -> None:
    port = free_port()
    prefill = RealEngine(model_dir, {"disagg": {"mode": "pull", "port": port, **QUICK}}, "kv_producer")
    decode = RealEngine(model_dir, {"disagg": {"mode": "pull", "port": free_port(), **QUICK}}, "kv_consumer")
    engines.extend([prefill, decode])
    prefill.add("p", PROMPT, {"do_remote_decode": True})
    params = prefill.finish("p").kv_transfer_params
    decode.add("d", PROMPT, params)
    decode.finish("d")
    prefill.drain()  # the default bound: a loaded 2-core machine may need more than a few seconds
    decode.drain()
    prom = PrometheusStatLogger(decode.config, engine_indexes=[0, 1])
    record(prom, prefill, 0)
    record(prom, decode, 1)
    model = decode.config.model_config.served_model_name
    # both engines run in this process and share its recorder: whichever worker asked first reported the pull
    moved = sum(REGISTRY.get_sample_value("vllm:kvplane_transfer_bytes_sum", {
        "model_name": model, "engine": e, "flow": "pull", "transport": "mooncake", "direction": "read"}) or 0
        for e in ("0", "1"))
    per_block = decode.worker.worker.decode.spec.bytes_per_token * BLOCK
    assert moved == len(PROMPT) // BLOCK * per_block
    assert sample("vllm:kvplane_requests_in_flight", model_name=model, engine="1", role="decode") == 0


def test_two_workers_stats_add_up_in_vllms_output_aggregator(model_dir: str, engines: list[RealEngine]) -> None:
    engine = RealEngine(model_dir, {"offload": {"host_bytes": 4 << 20, "pinned": False}})
    engines.append(engine)
    engine.add("a", PROMPT)
    engine.finish("a")
    engine.drain()
    data = next(s.kv_connector_stats for s in engine.stats if s.kv_connector_stats and s.kv_connector_stats.get("transfers"))

    def worker_output(stats: Any) -> ModelRunnerOutput:
        return ModelRunnerOutput(req_ids=[], req_id_to_index={},
                                 kv_connector_output=KVConnectorOutput(kv_connector_stats=stats))

    rank0, rank1 = (KVPlaneConnector.build_kv_connector_stats(data) for _ in range(2))
    out = KVOutputAggregator(expected_finished_count=2).aggregate([worker_output(rank0), worker_output(rank1)])
    total = out.kv_connector_output.kv_connector_stats
    assert isinstance(total, KVPlaneStats)
    for key, observations in data["transfers"].items():
        assert total.data["transfers"][key] == observations * 2
    assert total.data.get("stores", 0) == 2 * data.get("stores", 0)


def test_each_worker_logs_one_startup_line_saying_what_it_runs(model_dir: str, engines: list[RealEngine],
                                                               caplog: pytest.LogCaptureFixture) -> None:
    port = free_port()
    with caplog.at_level(logging.INFO, logger="kvplane"):
        engine = RealEngine(model_dir, {"disagg": {"mode": "pull", "port": port, **QUICK},
                                        "offload": {"host_bytes": 4 << 20, "pinned": False}}, "kv_producer")
        engines.append(engine)
    lines = [r.getMessage() for r in caplog.records if r.name == "kvplane" and r.levelno == logging.INFO]
    assert len(lines) == 1, lines
    line = lines[0]
    for part in ("backend=cpu", "layout=gqa:packed_kv;", "prefill mode=pull", "transport=mooncake", "protocol=tcp",
                 f"side_channel=127.0.0.1:{port}", "engine_address=127.0.0.1:", "auth=off",
                 "offload host=4 MiB"):
        assert part in line, f"{part!r} not in {line!r}"
