"""An engine that does not start again after a reset (``RestartBackoff``): the fence holds, the transport reports
itself down, and once the cause is gone ``restart`` brings the engine back on the same memory (real engines)."""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
import pytest

from kvplane.backend import get_backend
from kvplane.errors import TransportError
from kvplane.transports.base import TransportConfig
from kvplane.transports.mooncake import MooncakeTransport
from kvplane.transports.nixl import NixlTransport

pytestmark = pytest.mark.integration
RESTART_BOUND_S = 30.0  # the back-off is at most 1 s a try; this only bounds a broken restart


def test_a_nixl_agent_that_cannot_start_after_a_reset_is_retried_until_it_runs_on_the_same_memory() -> None:
    ok, why = NixlTransport.available()
    if not ok:
        pytest.skip(f"nixl is not usable here: {why}")
    buf = np.zeros(1 << 20, dtype=np.uint8)
    span = (buf.ctypes.data, buf.nbytes)
    transport = NixlTransport(get_backend("cpu"), TransportConfig())
    try:
        transport.register([span])
        good = transport.config
        transport.config = replace(good, nixl_backends=("NO_SUCH_BACKEND",))  # every start fails from here
        transport.reset()
        with pytest.raises(TransportError, match="down since a reset"):
            transport.peer_info()
        assert not transport.restart()
        transport.config = good
        until = time.monotonic() + RESTART_BOUND_S
        while not transport.restart():
            assert time.monotonic() < until, "the agent did not start again after its cause was gone"
            time.sleep(0.05)
        assert transport.peer_info().spans == (span,)
    finally:
        transport.close()


def test_a_mooncake_reset_starts_a_fresh_engine_on_the_same_memory() -> None:
    ok, why = MooncakeTransport.available()
    if not ok:
        pytest.skip(f"mooncake is not usable here: {why}")
    buf = np.zeros(1 << 20, dtype=np.uint8)
    span = (buf.ctypes.data, buf.nbytes)
    transport = MooncakeTransport(get_backend("cpu"), TransportConfig())
    try:
        transport.register([span])
        before = transport.generation
        transport.reset()
        assert transport.restart()
        assert transport.generation > before
        assert transport.peer_info().spans == (span,)
    finally:
        transport.close()
