"""The side channel's sockets as libzmq sees them: heartbeats from ``DisaggConfig.peer_timeout_s`` (checked in
its range), a DEALER routing id of its own, and a clear error where libzmq has no heartbeats."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import zmq

from kvplane.flows.disagg import DisaggConfig
from kvplane.flows.disagg.wire import channel
from kvplane.flows.disagg.wire.errors import DisaggConfigError


@pytest.fixture
def context() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def plain(sock: zmq.Socket[bytes]) -> None:
    """No CURVE keys (auth.Guard's hook)."""


def test_sockets_ping_a_quarter_of_peer_timeout_and_give_up_after_it(context: zmq.Context[zmq.Socket[bytes]]) -> None:
    router, port = channel.router(context, "127.0.0.1", 0, 1 << 20, plain, 1.0)
    dealers = [channel.dealer(context, "127.0.0.1", port, 1 << 20, plain, 2.0) for _ in range(2)]
    assert (router.getsockopt(zmq.HEARTBEAT_IVL), router.getsockopt(zmq.HEARTBEAT_TIMEOUT)) == (250, 1000)
    assert [d.getsockopt(zmq.HEARTBEAT_TIMEOUT) for d in dealers] == [2000, 2000]
    ids = [d.getsockopt(zmq.ROUTING_ID) for d in dealers]
    assert all(len(i) == 16 and i[:1] != b"\0" for i in ids) and ids[0] != ids[1]  # its own, not libzmq's kind


def test_a_libzmq_without_heartbeats_is_refused_naming_the_setting_and_the_fix(
    context: zmq.Context[zmq.Socket[bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(zmq, "zmq_version_info", lambda: (4, 1, 6))
    with pytest.raises(DisaggConfigError, match=r"peer_timeout_s=10.0 needs ZMQ heartbeats.*pip install -U pyzmq"):
        channel.dealer(context, "127.0.0.1", 5555, 1 << 20, plain, 10.0)


@pytest.mark.parametrize("value", [0.0, 0.1, 7000.0])
def test_peer_timeout_out_of_range_is_refused_naming_the_field(value: float) -> None:
    with pytest.raises(DisaggConfigError, match=f"peer_timeout_s={value}"):
        DisaggConfig(engine_id="e", peer_timeout_s=value)
