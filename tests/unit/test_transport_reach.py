"""What two ranks' transports reach each other by (``PeerInfo.speaks``), checked at the handshake.

Mooncake speaks its protocol (the config's, else the backend's: ``ascend`` on Ascend, ``rdma`` on CUDA and MLU,
``tcp`` on cpu) and NIXL its backends. Two ranks sharing none of them could not move a byte; a peer that says
nothing (an older kvplane) is not refused for it. Real engines, on this machine's cpu backend.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvplane.backend import get_backend
from kvplane.transports.base import PeerInfo, TransportConfig
from kvplane.transports.mooncake import MooncakeTransport
from kvplane.transports.nixl import NixlTransport

cpu = get_backend("cpu")


def peer(engine: str, *speaks: str) -> PeerInfo:
    return PeerInfo(engine=engine, name="peer", host="127.0.0.1", spans=((4096, 4096),), speaks=speaks)


@pytest.fixture
def mooncake_tcp() -> Iterator[MooncakeTransport]:
    transport = MooncakeTransport(cpu, TransportConfig(protocol="tcp"))
    yield transport
    transport.close()


def test_mooncake_says_its_protocol_the_configs_or_the_backends(mooncake_tcp: MooncakeTransport) -> None:
    assert mooncake_tcp.speaks() == ("tcp",) and mooncake_tcp.peer_info().speaks == ("tcp",)
    default = MooncakeTransport(cpu)
    try:
        assert default.speaks() == (cpu.mooncake_protocol,)
    finally:
        default.close()


def test_mooncake_refuses_a_peer_of_another_protocol_naming_what_would_work(mooncake_tcp: MooncakeTransport) -> None:
    assert mooncake_tcp.unreachable(peer("mooncake", "tcp")) == ""
    assert mooncake_tcp.unreachable(peer("mooncake")) == ""  # says nothing: not refused for it
    why = mooncake_tcp.unreachable(peer("mooncake", "rdma"))
    assert "KVPLANE_MOONCAKE_PROTOCOL" in why and "'tcp' reaches any device" in why


def test_nixl_speaks_its_backends_and_needs_one_in_common() -> None:
    transport = NixlTransport(cpu, TransportConfig(nixl_backends=("UCX",)))
    try:
        assert transport.peer_info().speaks == ("UCX",)
        assert transport.unreachable(peer("nixl", "GDS", "UCX")) == ""
        assert "share one of ['GDS', 'UCX']" in transport.unreachable(peer("nixl", "GDS"))
    finally:
        transport.close()
