"""Mooncake waiters sleep before the engine's spinning status call, and that sleep never holds anything up.

Two real Mooncake engines (TCP) in this process. The bytes of a paced transfer land; ``close`` and ``reset``
end a waiter's head start at once instead of waiting it out (here the head start is set to an hour, so a
close or reset that waited would fail the test's bound).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from kvplane.backend import get_backend
from kvplane.descriptors import CopyPlan
from kvplane.transports.base import TransportConfig
from kvplane.transports.mooncake import MooncakeTransport
from kvplane.transports.pacing import Pace

pytestmark = pytest.mark.integration

BOUND_S = 30.0
BLOCK, BLOCKS = 256 << 10, 64
cpu = get_backend("cpu")


@pytest.fixture
def engines() -> Iterator[tuple[MooncakeTransport, MooncakeTransport, CopyPlan, np.ndarray, np.ndarray]]:
    ok, why = MooncakeTransport.available()
    if not ok:
        pytest.skip(f"mooncake is not usable here: {why}")
    a = MooncakeTransport(cpu, TransportConfig(timeout_s=BOUND_S))
    b = MooncakeTransport(cpu, TransportConfig(timeout_s=BOUND_S))
    src = np.random.default_rng(1).integers(0, 255, BLOCK * BLOCKS, dtype=np.uint8)
    dst = np.zeros_like(src)
    a.register([(dst.ctypes.data, dst.nbytes)])
    b.register([(src.ctypes.data, src.nbytes)])
    order = np.random.default_rng(2).permutation(BLOCKS).astype(np.int64)
    plan = CopyPlan(src.ctypes.data + order * BLOCK, dst.ctypes.data + np.arange(BLOCKS, dtype=np.int64) * BLOCK,
                    np.full(BLOCKS, BLOCK, dtype=np.int64))
    a.connect(b.peer_info())
    yield a, b, plan, src.reshape(BLOCKS, BLOCK)[order], dst.reshape(BLOCKS, BLOCK)
    a.close()
    b.close()


def ends_within(bound_s: float, call: Callable[[], None]) -> None:
    done = threading.Event()

    def run() -> None:
        call()
        done.set()

    threading.Thread(target=run, daemon=True).start()
    assert done.wait(bound_s), f"{call} did not return within {bound_s} s"


def test_a_paced_transfer_moves_every_byte(engines: tuple[MooncakeTransport, MooncakeTransport, CopyPlan,
                                                          np.ndarray, np.ndarray]) -> None:
    a, b, plan, want, dst = engines
    for _ in range(4):  # the first teaches the rate, the rest sleep before their status call
        dst[:] = 0
        a.transfer(b.peer_info().name, "READ", plan)
        assert (dst == want).all()


@pytest.mark.parametrize("end", ["close", "reset"])
def test_close_and_reset_cut_a_waiters_head_start_short(
    engines: tuple[MooncakeTransport, MooncakeTransport, CopyPlan, np.ndarray, np.ndarray],
    monkeypatch: pytest.MonkeyPatch, end: str
) -> None:
    a, b, plan, want, dst = engines
    monkeypatch.setattr(Pace, "head_start_s", lambda self, peer, nbytes, descriptors: 3600.0)
    transfer = a.submit(b.peer_info().name, "READ", plan)
    ends_within(BOUND_S, getattr(a, end))
    transfer.wait(BOUND_S)  # ended, and its bytes landed before the engine went
    assert (dst == want).all()
