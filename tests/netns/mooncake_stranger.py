"""Two roles for ``test_engine_listeners.py``: ``python mooncake_stranger.py victim HOST`` and ``python
mooncake_stranger.py stranger HOST NAME``.

victim: a kvplane ``MooncakeTransport`` on ``HOST`` with 1 MiB registered and filled with 0x5A; prints one JSON
line, ``{"name": "host:rpc_port"}``, waits for a line on stdin, then prints ``{"byte0": n}`` (its first byte
then) and closes.

stranger: a raw Mooncake engine on ``HOST`` that is told only the victim's ``NAME`` (what anyone can find by
scanning Mooncake's port range): it asks the victim's engine for its first buffer's address
(``get_first_buffer_address``, answered from the victim's segment descriptor over Mooncake's handshake), reads
4 KiB there, writes 0xEE over them, and prints ``{"addr", "read_rc", "read", "write_rc"}``.
"""

from __future__ import annotations

import json
import os
import sys


def victim(host: str) -> None:
    from kvplane.backend import get_backend
    from kvplane.transports.base import TransportConfig
    from kvplane.transports.mooncake import MooncakeTransport

    backend = get_backend("cpu")
    transport = MooncakeTransport(backend, TransportConfig(host=host, protocol="tcp"))
    buf = backend.alloc_host(1 << 20)
    buf.numpy()[:] = 0x5A
    transport.register([(int(buf.data_ptr()), 1 << 20)])
    print(json.dumps({"name": transport.peer_info().name}), flush=True)
    sys.stdin.readline()
    print(json.dumps({"byte0": int(buf.numpy()[0])}), flush=True)
    transport.close()


def stranger(host: str, name: str) -> None:
    import mooncake.engine as mc
    import numpy as np

    os.environ["MC_FORCE_TCP"] = "1"
    engine = mc.TransferEngine()
    assert engine.initialize(host, "P2PHANDSHAKE", "tcp", "") == 0
    addr = int(engine.get_first_buffer_address(name))
    local = np.zeros(4096, np.uint8)
    assert engine.register_memory(local.ctypes.data, local.nbytes) == 0
    read_rc = engine.transfer_sync_read(name, local.ctypes.data, addr, local.nbytes)
    read = sorted(set(local.tolist()))
    local[:] = 0xEE
    write_rc = engine.transfer_sync_write(name, local.ctypes.data, addr, local.nbytes)
    print(json.dumps({"addr": addr, "read_rc": read_rc, "read": read, "write_rc": write_rc}), flush=True)


if __name__ == "__main__":
    victim(sys.argv[2]) if sys.argv[1] == "victim" else stranger(sys.argv[2], sys.argv[3])
