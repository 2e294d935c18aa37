"""``protocol: tcp`` means TCP with the installed Mooncake, even where it would pick RDMA itself.

Mooncake's Python ``initialize`` does not install the transport it is given: it auto-discovers the topology and
installs RDMA when it finds RDMA NICs, TCP otherwise; only ``MC_FORCE_TCP`` makes it TCP whatever it finds
(``transfer_engine_impl.cpp``; its startup logs "MC_FORCE_TCP is set, using TCP transport only").
``MC_FORCE_HCA=1`` is Mooncake's own switch that makes discovery install RDMA as on a host with NICs; this
machine has none, so an engine that still goes for RDMA fails to start, and one that honours tcp moves bytes.
Each case runs in a child process: Mooncake reads these variables from the process environment.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.integration

CHILD = textwrap.dedent("""
    import os
    import numpy as np
    from kvplane.backend import get_backend
    from kvplane.descriptors import CopyPlan
    from kvplane.transports.base import TransportConfig
    from kvplane.transports.mooncake import MooncakeTransport

    cpu = get_backend("cpu")
    a, b = (MooncakeTransport(cpu, TransportConfig(protocol="tcp")) for _ in range(2))
    src = np.arange(1 << 16, dtype=np.uint8)
    dst = np.zeros(1 << 16, dtype=np.uint8)
    a.register([(src.ctypes.data, src.nbytes)])
    b.register([(dst.ctypes.data, dst.nbytes)])
    peer = a.connect(b.peer_info())
    a.transfer(peer, "WRITE", CopyPlan(np.array([src.ctypes.data], dtype=np.int64),
                                       np.array([dst.ctypes.data], dtype=np.int64),
                                       np.array([src.nbytes], dtype=np.int64)))
    assert (dst == src).all()
    print("MC_FORCE_TCP left set:", os.environ.get("MC_FORCE_TCP"))
    a.close(); b.close()
""")


def run_child(**env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MC_")}
    return subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120,
                          env={**clean, "KVPLANE_ENGINE_LOGS": "1", **env})  # Mooncake's INFO lines shown


def test_protocol_tcp_is_tcp_where_mooncake_would_install_rdma_and_leaves_the_environment_as_it_was() -> None:
    proc = run_child(MC_FORCE_HCA="1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "MC_FORCE_TCP is set, using TCP transport only" in proc.stderr
    assert "MC_FORCE_TCP left set: None" in proc.stdout


def test_a_user_who_set_mc_force_tcp_keeps_it() -> None:
    proc = run_child(MC_FORCE_HCA="1", MC_FORCE_TCP="1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "MC_FORCE_TCP left set: 1" in proc.stdout
