"""A Prometheus scrape of a test instance after real transfers shows kvplane's metrics with the bytes moved.

Each test runs real flows on 127.0.0.1 (P/D sides with Mooncake TE or NIXL, the offload engine with a real
``mooncake_master``), serves the process's metrics with ``MetricsServer`` and reads them back over HTTP with
``prometheus_client``'s own parser: the bytes a histogram counted equal the bytes the flow moved.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator

import pytest
from offload_fakes import Harness, small_spec
from pair import make, push_params, token_for
from pair import small_spec as pd_spec
from prometheus_client.parser import text_string_to_metric_families

from kvplane.blocks import block_hashes
from kvplane.flows.offload import MooncakeMaster, StoreConfig
from kvplane.flows.offload.store import StoreTier
from kvplane.metrics import recorder
from kvplane.metrics.exporter import MetricsServer
from kvplane.metrics.record import STORE_TRANSPORT
from kvplane.startup import describe

pytestmark = pytest.mark.integration
MiB = 1 << 20
TOKENS = 48  # three whole blocks of 16 tokens
QUICK = {"lease_s": 1.0, "heartbeat_s": 0.1}

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(server: MetricsServer) -> Samples:
    with urllib.request.urlopen(server.url, timeout=10) as response:
        text = response.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    key = (name, frozenset(labels.items()))
    assert key in samples, f"{name}{labels} not in the scrape: {sorted(n for n, _ in samples if n.startswith(name))}"
    return samples[key]


@pytest.fixture
def server() -> Iterator[MetricsServer]:
    with MetricsServer() as s:
        recorder().take()  # what earlier tests in this process recorded is not this test's
        yield s


@pytest.mark.parametrize("engine", ["mooncake", "nixl"])
def test_a_pull_shows_its_bytes_latency_failures_and_gauges_in_a_scrape(server: MetricsServer, engine: str) -> None:
    spec = pd_spec()
    prefill = make("prefill", spec, seed=3, engine=engine, **QUICK)
    decode = make("decode", spec, engine=engine, **QUICK)
    try:
        src, dst = prefill.allocate(TOKENS), decode.allocate(TOKENS)
        params = prefill.side.request_finished("r1", src, TOKENS)
        decode.side.start_pull("r1", params, dst, TOKENS)
        assert decode.wait("r1").ok and prefill.wait("r1").ok
        lonely = prefill.allocate(TOKENS)
        prefill.side.request_finished("lonely", lonely, TOKENS)  # nobody pulls it: its lease expires
        assert prefill.wait("lonely").state == "timed_out"
        moved = TOKENS * spec.bytes_per_token
        s = scrape(server)
        labels = {"flow": "pull", "transport": engine, "direction": "read"}
        assert value(s, "kvplane_transfer_bytes_sum", **labels) == moved
        assert value(s, "kvplane_transfer_bytes_count", **labels) == 1
        assert value(s, "kvplane_transfer_seconds_count", **labels) == 1
        assert value(s, "kvplane_transfer_seconds_sum", **labels) > 0
        assert value(s, "kvplane_transfer_bytes_bucket", **labels, le="+Inf") == 1
        assert value(s, "kvplane_leases_expired_total") == 1
        assert value(s, "kvplane_failures_total", flow="pull", cause="request_timed_out") == 1
        assert value(s, "kvplane_requests_in_flight", role="decode") == decode.side.pending_requests() == 0
        assert value(s, "kvplane_transfers_in_flight", role="prefill") == prefill.side.transfers_in_flight() == 0
        assert value(s, "kvplane_transfer_bytes_sum", **labels) == moved  # a second scrape adds nothing
    finally:
        prefill.close()
        decode.close()


def test_a_layerwise_push_counts_every_layer_under_its_flow(server: MetricsServer) -> None:
    spec = pd_spec()
    prefill = make("prefill", spec, seed=5, mode="layerwise")
    decode = make("decode", spec, mode="layerwise")
    try:
        src, dst = prefill.allocate(TOKENS), decode.allocate(TOKENS)
        decode.side.register_push("r2", push_params(prefill.side.base_port, "r2", prefill.side.config.engine_id),
                                  dst, TOKENS)
        prefill.side.start_request("r2", src, TOKENS, token=token_for("r2"))
        for name in spec.layer_names:
            prefill.side.save_layer(name)
        prefill.side.request_finished("r2", src, TOKENS, token=token_for("r2"))
        assert decode.wait("r2").ok and prefill.wait("r2").ok
        s = scrape(server)
        labels = {"flow": "layerwise", "transport": "mooncake", "direction": "write"}
        assert value(s, "kvplane_transfer_bytes_sum", **labels) == TOKENS * spec.bytes_per_token
        assert value(s, "kvplane_transfer_bytes_count", **labels) >= 1
    finally:
        prefill.close()
        decode.close()


def test_offload_and_store_tiers_show_bytes_hit_rate_and_occupancy(server: MetricsServer,
                                                                   master: MooncakeMaster) -> None:
    config = StoreConfig(master.address, segment_bytes=32 * MiB, local_buffer_bytes=16 * MiB, timeout_s=1.0,
                         write_through=True, namespace="metrics-scrape")
    h = Harness(small_spec(), host_blocks=4, store_tier=StoreTier(config))
    # the store's used bytes are what this process wrote since the recorder started: earlier tests' count too
    written = recorder().total_bytes("store", STORE_TRANSPORT, "write")
    try:
        block = h.engine.pool.block_bytes[0]
        hashes = block_hashes(range(100, 106), 2)  # three blocks of two tokens
        assert h.store("a", hashes, [1, 2, 3]) == 3
        h.engine.wait_idle()
        assert h.engine.lookup(hashes) == 6
        assert h.engine.lookup(block_hashes(range(7, 11), 2)) == 0  # a miss: 4 tokens queried, none found
        assert h.load("b", hashes, [5, 6, 7]) == 6
        s = scrape(server)
        for direction in ("write", "read"):
            labels = {"flow": "offload", "transport": h.backend.name, "direction": direction}
            assert value(s, "kvplane_transfer_bytes_sum", **labels) == 3 * block
            assert value(s, "kvplane_transfer_seconds_count", **labels) == 1
        store = {"flow": "store", "transport": "mooncake_store", "direction": "write"}
        assert value(s, "kvplane_transfer_bytes_sum", **store) == 3 * block
        assert value(s, "kvplane_offload_queried_tokens_total") == 6 + 4
        assert value(s, "kvplane_offload_hit_tokens_total") == 6
        assert value(s, "kvplane_tier_used_bytes", tier="host") == 3 * block
        assert value(s, "kvplane_tier_capacity_bytes", tier="host") == h.engine.pool.nbytes
        assert value(s, "kvplane_tier_used_bytes", tier="store") == written + 3 * block
        assert value(s, "kvplane_tier_capacity_bytes", tier="store") == 32 * MiB
    finally:
        h.engine.close()


@pytest.mark.parametrize("engine", ["mooncake", "nixl"])
def test_the_startup_line_gives_each_transports_own_address_or_agent(engine: str) -> None:
    prefill = make("prefill", pd_spec(), engine=engine)
    try:
        line = describe(prefill.side.backend, None, prefill=prefill.side, engine_id="p")
        info = prefill.side.local.transport.peer_info()
        if engine == "mooncake":  # Mooncake TE's RPC port: a firewall must open it
            assert f"engine_address={info.host}:{info.port or info.name.rsplit(':', 1)[1]}" in line, line
        else:  # UCX picks its own ports: the line names the agent, and says so, never an agent name as an address
            assert f"nixl_agent={info.name}" in line and "engine_address" not in line, line
        assert f"side_channel=127.0.0.1:{prefill.side.port}" in line and "auth=off" in line, line
    finally:
        prefill.close()
