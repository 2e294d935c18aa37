"""The outbox retires a transfer that ended inside the engine's submit call in the same pump.

NIXL over UCX cma (same host) copies inside ``transfer()``: by the time ``submit`` returns, the bytes are there.
The request's callback must run in that pump, not one poll interval later, or every small pull waits for the
transfer thread's next wake-up. Two real NIXL agents in this process, the engine driven to completion inside
its ``transfer`` call, as UCX does on this path.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvplane.bench.peer import KVBuffer
from kvplane.errors import KvplaneError
from kvplane.flows.disagg.wire.outbox import Outbox
from tests.integration.test_nixl_handles_under_lock import finishing
from tests.integration.test_nixl_prepped import (
    NUM_BLOCKS,
    Pair,
    assert_moved,
    cpu,
    ids,
    make_pair,
    plan_for,
    spec,
)

pytestmark = pytest.mark.integration


@pytest.fixture
def pair() -> Iterator[Pair]:
    p = make_pair(KVBuffer(spec(), "packed_kv", NUM_BLOCKS, cpu.alloc_host),
                  KVBuffer(spec(), "packed_kv", NUM_BLOCKS, cpu.alloc_host))
    yield p
    p.close()


def test_a_transfer_done_inside_submit_is_retired_by_the_same_pump(pair: Pair) -> None:
    pair.a.agent.transfer = finishing(pair.a.agent)
    outbox = Outbox(pair.a, "READ", max_inflight=2)
    ended: list[KvplaneError | None] = []
    plan = plan_for(pair, "READ", ids(1), ids(2))
    outbox.put(pair.handle, plan, ended.append)
    outbox.pump()
    assert ended == [None], "the transfer had ended inside submit, and its request still waits for another pump"
    assert not outbox.busy
    assert_moved(plan)
