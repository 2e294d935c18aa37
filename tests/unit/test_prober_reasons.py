"""A failed or timed-out connect names the peer it was for, its engine identity and address (issue 28, finding 7:
an unreachable decode's failure named the prefill's own address). The transport is a stand-in whose connect fails
or blocks; the prober's own threads and deadline run as they do in a side."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from kvplane.errors import PeerUnreachable
from kvplane.flows.disagg.wire.peers import Prober
from kvplane.transports.base import PeerInfo

DECODE = PeerInfo("mooncake", "10.0.0.9:15001", "10.0.0.9", 15001)


class Transport:
    def __init__(self, fail: bool) -> None:
        self.fail, self.release = fail, threading.Event()

    def connect(self, info: PeerInfo) -> str:
        if self.fail:
            raise PeerUnreachable("connect refused")
        self.release.wait(60)
        return "handle"


def outcome(transport: Transport, expire_at: float | None) -> tuple[str, str]:
    got: list[tuple[str, str]] = []
    delivered = threading.Event()

    def deliver(call: Callable[[], None]) -> Any:
        call()
        delivered.set()

    prober = Prober(transport, deliver, timeout_s=2.0)  # type: ignore[arg-type]
    assert prober.connect(DECODE, lambda handle, error: got.append((handle, error)))
    if expire_at is not None:
        prober.expire(expire_at)
        transport.release.set()
    else:
        assert delivered.wait(60)
    return got[0]


def test_a_connect_that_fails_names_the_peer_and_its_address() -> None:
    handle, error = outcome(Transport(fail=True), None)
    assert handle == "" and error.startswith("reaching mooncake peer '10.0.0.9:15001' at 10.0.0.9:15001: ")
    assert "PeerUnreachable: connect refused" in error


def test_a_connect_past_its_deadline_names_the_peer_and_its_address() -> None:
    import time

    handle, error = outcome(Transport(fail=False), time.monotonic() + 3600)
    assert handle == "" and error == ("the transport did not reach mooncake peer '10.0.0.9:15001' at "
                                      "10.0.0.9:15001 within probe_timeout_s=2.0")
