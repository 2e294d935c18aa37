"""A NIXL handshake is loaded only when the agent named inside its metadata is the peer that sent it (issue 28,
finding 3): another peer's metadata under a new name, whole or cut short, is refused before NIXL parses it, and
the real peer's entry keeps moving bytes."""

from __future__ import annotations

import ctypes

import msgspec
import numpy as np
import pytest

from kvplane.backend import get_backend
from kvplane.descriptors import CopyPlan
from kvplane.errors import PeerUnreachable
from kvplane.transports.base import TransportConfig
from kvplane.transports.nixl import NixlTransport, metadata_agent

pytestmark = pytest.mark.integration
cpu = get_backend("cpu")


def test_metadata_names_its_agent_and_anything_else_names_none() -> None:
    md = b"nixlSerDes|Agent" + (5).to_bytes(8, "little") + b"dec-0|Conns..."
    assert metadata_agent(md) == "dec-0"
    assert metadata_agent(md[:20]) is None and metadata_agent(b"garbage") is None
    assert metadata_agent(b"nixlSerDes|Agent" + (1 << 40).to_bytes(8, "little") + b"x") is None


def test_another_peers_metadata_under_a_new_name_is_refused_and_the_real_peer_still_works() -> None:
    ok, why = NixlTransport.available()
    if not ok:
        pytest.skip(f"nixl is not usable here: {why}")
    a_buf, b_buf = np.zeros(1 << 16, np.uint8), np.arange(1 << 16, dtype=np.uint64).astype(np.uint8)
    a = NixlTransport(cpu, TransportConfig(timeout_s=30.0))
    b = NixlTransport(cpu, TransportConfig(timeout_s=30.0))
    try:
        a.register([(a_buf.ctypes.data, a_buf.nbytes)])
        b.register([(b_buf.ctypes.data, b_buf.nbytes)])
        real = b.peer_info()
        handle = a.connect(real)
        for metadata in (real.metadata, real.metadata[: len(real.metadata) // 2]):
            forged = msgspec.structs.replace(real, name="impostor", metadata=metadata)
            with pytest.raises(PeerUnreachable, match=rf"names agent {real.name!r}.*refused"):
                a.connect(forged)
        plan = CopyPlan(np.array([b_buf.ctypes.data], np.int64), np.array([a_buf.ctypes.data], np.int64),
                        np.array([4096], np.int64))  # READ: from the peer's memory into ours
        a.transfer(handle, "READ", plan)
        assert bytes(a_buf[:4096]) == ctypes.string_at(b_buf.ctypes.data, 4096)
    finally:
        a.close()
        b.close()
