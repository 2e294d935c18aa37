"""The offload and store bench scenarios run end to end in ``--quick`` mode and report verified results.

Behaviour only: figures on a shared machine are noise, so nothing here compares timings. The store scenarios
start and stop their own loopback ``mooncake_master``; none may be left running.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvplane.backend import get_backend
from kvplane.bench import offload as offload_bench
from kvplane.bench.scenarios import load_all

pytestmark = pytest.mark.integration

NEW_KINDS = ("offload-", "store-")
SCENARIOS = sorted(n for n, s in load_all().items() if n.startswith(NEW_KINDS) and s.default)


@pytest.fixture(scope="module", autouse=True)
def _release_rigs() -> Iterator[None]:
    yield None
    offload_bench._release()  # a store scenario keeps its model's buffers for the load scenario


def test_every_model_has_an_offload_and_a_store_scenario_in_the_default_set() -> None:
    for model in ("qwen3-0.6b", "deepseek-v3"):
        for suffix in ("offload-{m}-store", "offload-{m}-load", "store-{m}-put", "store-{m}-get"):
            assert suffix.format(m=model) in SCENARIOS
    assert not load_all()["store-qwen3-0.6b-put-10k"].default  # the big variants are asked for by name


@pytest.mark.parametrize("name", SCENARIOS)
def test_scenario_returns_a_verified_result_in_quick_mode(name: str) -> None:
    result = load_all()[name].run(get_backend("cpu"), True)
    assert result.scenario == name
    assert result.verified is True
    assert result.bytes > 0 and result.gbps > 0 and result.baseline_gbps > 0
    if result.kind == "offload":
        assert result.params["tokens"] == 2000
        if name.endswith("-load"):
            p = result.params
            assert 0.0 <= p["overlap_hidden"] <= 1.0 and p["layerwise_s"] > 0 and p["serial_s"] > 0
    else:
        assert result.kind == "store" and result.params["tokens"] == 512
        assert result.params["engine_gbps"] > 0
