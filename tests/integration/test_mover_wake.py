"""The transfer thread learns that a plan ended from the engine when the engine can tell, and polls otherwise.

Mooncake's transfers end on a thread of their own and wake the ``Mover`` (``Transfer.call_when_done``), so it
need not poll them every ``POLL_S``; NIXL's move only while polled, so it keeps polling them. With the woken
engines' safety-net interval set far beyond the test's bound, every plan still ends within the bound, with its
bytes: on Mooncake only because the wake came, on NIXL because the poll goes on.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from kvplane.backend import get_backend
from kvplane.descriptors import CopyPlan
from kvplane.errors import KvplaneError
from kvplane.flows.disagg.wire import mover
from kvplane.transports.base import Transport, TransportConfig
from kvplane.transports.mooncake import MooncakeTransport
from kvplane.transports.nixl import NixlTransport

pytestmark = pytest.mark.integration

BOUND_S = 30.0  # far below the safety net the test sets, far above any plan's time here
BLOCK, BLOCKS = 64 << 10, 256
cpu = get_backend("cpu")


@pytest.fixture(params=[MooncakeTransport, NixlTransport], ids=["mooncake", "nixl"])
def engines(request: pytest.FixtureRequest) -> Iterator[tuple[Transport, Transport]]:
    cls: type[Transport] = request.param
    ok, why = cls.available()
    if not ok:
        pytest.skip(f"{cls.name} is not usable here: {why}")
    a, b = cls(cpu, TransportConfig(timeout_s=BOUND_S)), cls(cpu, TransportConfig(timeout_s=BOUND_S))
    yield a, b
    a.close()
    b.close()


def test_every_plan_ends_within_the_bound_when_the_woken_safety_net_is_far_beyond_it(
    engines: tuple[Transport, Transport], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(mover, "WOKEN_POLL_S", 3600.0)
    a, b = engines
    src = np.random.default_rng(1).integers(0, 255, BLOCK * BLOCKS, dtype=np.uint8)
    dst = np.zeros_like(src)
    a.register([(dst.ctypes.data, dst.nbytes)])
    b.register([(src.ctypes.data, src.nbytes)])
    handle = a.connect(b.peer_info())
    order = np.random.default_rng(2).permutation(BLOCKS).astype(np.int64)
    plan = CopyPlan(src.ctypes.data + order * BLOCK, dst.ctypes.data + np.arange(BLOCKS, dtype=np.int64) * BLOCK,
                    np.full(BLOCKS, BLOCK, dtype=np.int64))
    ended: list[KvplaneError | None] = []
    done = threading.Event()

    def deliver(fn: Callable[[], None]) -> None:  # the loop's submit: here, run on the mover's thread
        fn()

    def callback(error: KvplaneError | None) -> None:
        ended.append(error)
        done.set()

    m = mover.Mover("test-mover", a, "READ", max_inflight=2, deliver=deliver)
    try:
        for _ in range(3):  # the second and third start while the thread sleeps between transfers
            done.clear()
            dst[:] = 0
            m.put(handle, plan, callback)
            assert done.wait(BOUND_S), f"the {a.name} plan had not ended after {BOUND_S} s"
            assert (dst.reshape(BLOCKS, BLOCK) == src.reshape(BLOCKS, BLOCK)[order]).all()
    finally:
        m.stop()
    assert ended == [None, None, None]
