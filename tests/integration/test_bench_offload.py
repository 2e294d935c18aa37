"""The offload and store bench scenarios run end to end in ``--quick`` mode and report verified results.

Behaviour only: figures on a shared machine are noise, so nothing here compares timings. The store scenarios
start and stop their own loopback ``mooncake_master``; none may be left running.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvplane.backend import get_backend
from kvplane.bench import scenarios
from kvplane.bench.held import release_all

pytestmark = pytest.mark.integration

NEW_KINDS = ("offload-", "overhead-", "store-")
DEFAULT = {s.name: s for s in scenarios.default()}
SCENARIOS = sorted(n for n in DEFAULT if n.startswith(NEW_KINDS))


@pytest.fixture(scope="module", autouse=True)
def _release_rigs() -> Iterator[None]:
    yield None
    release_all()  # a store row keeps its model's rig for the load row: no engine may outlive this module's rows


def test_every_model_has_an_offload_an_overhead_and_a_store_scenario_in_the_default_set() -> None:
    for model in ("qwen3-0.6b", "deepseek-v3"):
        for name in ("offload-{m}-store", "offload-{m}-load", "overhead-{m}-store", "overhead-{m}-load",
                     "store-{m}-put", "store-{m}-get"):
            assert name.format(m=model) in SCENARIOS
    assert "store-qwen3-0.6b-put-10k" not in DEFAULT  # the big variants run with --full or by name
    assert "store-qwen3-0.6b-put-10k" in {s.name for s in scenarios.full()}


@pytest.mark.parametrize("name", SCENARIOS)
def test_scenario_returns_a_verified_result_in_quick_mode(name: str) -> None:
    result = DEFAULT[name].run(get_backend("cpu"), True)
    assert result.scenario == name
    assert result.verified is True
    assert result.bytes > 0 and result.gbps > 0 and result.baseline_gbps > 0
    assert result.reps >= 5 and result.descriptors > 0 and result.cpu_seconds > 0
    assert result.spread["min_s"] <= result.spread["median_s"] <= result.spread["max_s"]
    if result.kind == "overhead":
        assert result.params["tokens"] == 2000 and result.params["cpu_ms_per_request"] > 0
    elif result.kind == "offload":
        assert result.params["tokens"] == 2000
        if name.endswith("-load"):
            p = result.params
            assert 0.0 <= p["overlap_hidden"] <= 1.0 and p["layerwise_s"] > 0 and p["serial_s"] > 0
    else:
        assert result.kind == "store" and result.params["tokens"] == 512
        assert result.params["engine_gbps"] > 0


def test_release_all_lets_go_of_every_rig_a_row_kept() -> None:
    """A store row run by itself kept its rig (an offload engine with a host tier) alive after the module's rows,
    and the metrics tests that ran later read its 112 MiB as their host tier's bytes."""
    from kvplane.bench import offload as offload_bench
    from kvplane.bench import store as store_bench

    DEFAULT["store-qwen3-0.6b-put"].run(get_backend("cpu"), True)
    assert store_bench._held
    release_all()
    assert not store_bench._held and not offload_bench._held
