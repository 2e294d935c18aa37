"""``channel.receive`` reads and decodes one message at a time, as its caller handles them, and at most
``RECEIVE_BUDGET`` a call, so a flood waits in libzmq while the I/O loop's other work runs (issue 28, finding 2:
489 heartbeats of 4096 ids were all decoded into one list first: 234-269 MiB of RSS and a 1-15 s stall)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import zmq

from kvplane.flows.disagg.wire import channel, messages
from kvplane.flows.disagg.wire.messages import Cancel


@pytest.fixture
def pair() -> Iterator[tuple[zmq.Socket[bytes], zmq.Socket[bytes]]]:
    ctx = zmq.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    router.bind("inproc://receive-test")
    dealer.connect("inproc://receive-test")
    try:
        yield router, dealer
    finally:
        router.close(linger=0)
        dealer.close(linger=0)
        ctx.term()


def _send(dealer: zmq.Socket[bytes], n: int) -> None:
    for i in range(n):
        dealer.send(messages.encode(Cancel(f"r{i}", "decode", 0)))


def test_one_call_takes_at_most_the_budget_and_the_rest_stays_queued(
    pair: tuple[zmq.Socket[bytes], zmq.Socket[bytes]],
) -> None:
    router, dealer = pair
    _send(dealer, channel.RECEIVE_BUDGET * 3 + 5)
    assert router.poll(10_000) == zmq.POLLIN
    counters = channel.Counters()
    first = list(channel.receive(router, 1 << 20, counters, True))
    assert [m.request_id for _, _, m in first] == [f"r{i}" for i in range(channel.RECEIVE_BUDGET)]  # type: ignore[union-attr]
    assert router.poll(0) == zmq.POLLIN  # the rest waits, and the loop sees the socket readable again
    rest = []
    while router.poll(0):
        rest += list(channel.receive(router, 1 << 20, counters, True))
    assert len(rest) == channel.RECEIVE_BUDGET * 2 + 5 and counters.rejected == 0


def test_each_message_is_read_only_once_the_one_before_was_handled(
    pair: tuple[zmq.Socket[bytes], zmq.Socket[bytes]],
) -> None:
    router, dealer = pair
    _send(dealer, 3)
    assert router.poll(10_000) == zmq.POLLIN
    received = channel.receive(router, 1 << 20, channel.Counters(), True)
    identity, _, message = next(received)
    assert isinstance(message, Cancel) and message.request_id == "r0"
    # the other two are still in libzmq: another reader takes them before the generator goes on
    taken = [messages.decode(router.recv_multipart()[-1], 1 << 20) for _ in range(2)]
    assert [m.request_id for m in taken] == ["r1", "r2"]  # type: ignore[union-attr]
    assert list(received) == []
