"""Streams run their work in order, events mark points in them and order work across streams.

On an emulated device the vendor memcpy is synchronous, so these hold trivially there; they bind on hardware
and on the cpu backend (ordered worker threads).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import pytest

from kvplane.backend.base import Backend
from kvplane.conformance.helpers import (
    SOURCE_BLOCKS,
    Cache,
    cache_in,
    fill_random,
    mismatches,
    plan_between,
    spec_for,
)
from kvplane.descriptors import CopyPlan
from kvplane.kv.spec import KVSpec

LAYOUT = "split_kv"


@dataclass
class Chain:
    """A host cache of random bytes, copied up to the device (blocks reversed) and back to a second host cache."""

    spec: KVSpec
    first: Cache
    device: Cache  # held here: plans borrow the memory they copy, they do not keep it alive
    last: Cache
    ids: npt.NDArray[np.int64]
    up: CopyPlan
    down: CopyPlan

    def arrived(self) -> list[str]:
        return mismatches(self.spec, LAYOUT, self.first, self.ids, self.last, self.ids)


@pytest.fixture
def chain(kvplane_backend: Backend) -> Chain:
    spec = spec_for(LAYOUT)
    first = cache_in(kvplane_backend, "host", spec, LAYOUT, SOURCE_BLOCKS)
    device = cache_in(kvplane_backend, "device", spec, LAYOUT, SOURCE_BLOCKS)
    last = cache_in(kvplane_backend, "host", spec, LAYOUT, SOURCE_BLOCKS)
    fill_random(kvplane_backend, spec, first, LAYOUT, seed=11)
    ids = np.arange(SOURCE_BLOCKS, dtype=np.int64)
    reversed_ids = ids[::-1].copy()
    up = plan_between(spec, LAYOUT, first, ids, device, reversed_ids)
    down = plan_between(spec, LAYOUT, device, reversed_ids, last, ids)
    return Chain(spec, first, device, last, ids, up, down)


def test_work_on_one_stream_runs_in_submission_order(kvplane_backend: Backend, chain: Chain) -> None:
    stream, done = kvplane_backend.new_stream(), kvplane_backend.new_event()
    kvplane_backend.execute(chain.up, stream, direction="h2d")
    kvplane_backend.execute(chain.down, stream, direction="d2h")  # reads what the first plan wrote
    done.record(stream)
    done.synchronize()
    assert done.query()
    assert chain.arrived() == []


def test_an_event_orders_work_across_two_streams(kvplane_backend: Backend, chain: Chain) -> None:
    producer, consumer = kvplane_backend.new_stream(), kvplane_backend.new_stream()
    kvplane_backend.execute(chain.up, producer, direction="h2d")
    ready = kvplane_backend.new_event()
    ready.record(producer)
    consumer.wait_event(ready)
    kvplane_backend.execute(chain.down, consumer, direction="d2h")
    consumer.synchronize()
    assert ready.query() and consumer.query()
    assert chain.arrived() == []


def test_events_complete_once_recorded_work_is_done(kvplane_backend: Backend, chain: Chain) -> None:
    assert kvplane_backend.new_event().query()  # never recorded: nothing to wait for, as torch.Event
    stream = kvplane_backend.new_stream()
    kvplane_backend.execute(chain.up, stream, direction="h2d")
    event = kvplane_backend.new_event()
    event.record(stream)
    event.synchronize()
    assert event.query()
    stream.synchronize()
    assert stream.query()


def test_the_current_stream_and_no_stream_both_run_plans(kvplane_backend: Backend, chain: Chain) -> None:
    kvplane_backend.execute(chain.up, kvplane_backend.current_stream(), direction="h2d")
    kvplane_backend.synchronize()
    kvplane_backend.execute(chain.down, None, direction="d2h")  # done when it returns
    assert chain.arrived() == []
