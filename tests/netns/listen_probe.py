"""Start one kvplane transport and print the TCP addresses its process listens on: ``python listen_probe.py ENGINE
HOST``. Run inside a network namespace by ``test_engine_listeners.py``.

It registers 1 MiB of host memory (so every listener an engine opens for serving is up), takes ``peer_info``,
lists the process's listening sockets with ``ss -ltnpH`` and prints one line, ``LISTEN <json list of
"address:port">``, then closes the transport.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys


def main(engine: str, host: str) -> None:
    from kvplane.backend import get_backend
    from kvplane.transports.base import TransportConfig
    from kvplane.transports.mooncake import MooncakeTransport
    from kvplane.transports.nixl import NixlTransport

    backend = get_backend("cpu")
    classes = {"mooncake": MooncakeTransport, "nixl": NixlTransport}
    transport = classes[engine](backend, TransportConfig(host=host, protocol="tcp" if engine == "mooncake" else ""))
    try:
        buf = backend.alloc_host(1 << 20)
        transport.register([(int(buf.data_ptr()), 1 << 20)])
        transport.peer_info()
        table = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True, timeout=30).stdout
        mine = [line.split()[3] for line in table.splitlines() if f"pid={os.getpid()}," in line]
        print("LISTEN " + json.dumps(mine), flush=True)
    finally:
        transport.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
