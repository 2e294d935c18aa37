"""kvplane's KV events through vLLM's own executor aggregation (``KVOutputAggregator.aggregate``, the path
every multi-worker executor takes): an event is published once every TP rank reported it, and the worker
half's queue stays bounded when nothing takes it."""

from __future__ import annotations

import logging

import numpy as np
import pytest

pytest.importorskip("vllm", reason="the vLLM connector tests need vLLM: pip install --no-deps vllm==0.27.1 + .[vllm]")

from vllm.distributed.kv_events import BlockStored  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402

from kvplane.integrations.vllm.event_inbox import EventInbox  # noqa: E402
from kvplane.integrations.vllm.events import KVPlaneKVEvents, block_stored  # noqa: E402
from kvplane.integrations.vllm.tier_events import TierEvents  # noqa: E402


def rank_output(events: list[object] | None) -> ModelRunnerOutput:
    kv = KVConnectorOutput(kv_cache_events=KVPlaneKVEvents(events) if events else None)
    return ModelRunnerOutput(req_ids=[], req_id_to_index={}, kv_connector_output=kv)


def aggregate(aggregator: KVOutputAggregator, *ranks: list[object] | None) -> KVConnectorOutput:
    out = aggregator.aggregate([rank_output(r) for r in ranks])
    assert out is not None and out.kv_connector_output is not None
    return out.kv_connector_output


def test_an_event_is_published_once_every_tp_rank_reported_it() -> None:
    aggregator = KVOutputAggregator(expected_finished_count=2)  # what a TP 2 executor builds
    inbox = EventInbox()
    both, late = block_stored([11, 12], "CPU", 0), block_stored([13], "MOONCAKE", 0)
    first = aggregate(aggregator, [both, late], [both])
    inbox.add(first.kv_cache_events.get_all_events(), first.expected_finished_count)
    assert inbox.take() == [both]  # rank 1's put of block 13 has not completed yet
    second = aggregate(aggregator, None, [late])
    inbox.add(second.kv_cache_events.get_all_events(), second.expected_finished_count)
    assert inbox.take() == [late] and isinstance(late, BlockStored)


def test_the_worker_queue_keeps_the_newest_events_when_nothing_takes_them(caplog: pytest.LogCaptureFixture) -> None:
    events = TierEvents({0: 8}, limit=2)
    with caplog.at_level(logging.WARNING, logger="kvplane.vllm"):
        for i in range(4):
            events.host_cached(0, np.array([i]), np.array([100 + i], dtype=object))
    assert [e.block_hashes for e in events.take()] == [[102], [103]] and events.dropped == 2
    assert caplog.text.count("dropping the oldest") == 1
