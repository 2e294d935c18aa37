"""A peer rank for the transport tests, run as its own process: ``python transport_peer.py ENGINE NBYTES SEED``.

It allocates ``NBYTES`` of host memory through the cpu backend, fills it with ``numpy.random.default_rng(SEED)
.bytes`` (``SEED`` < 0: leaves it untouched), registers it with the kvplane transport ``ENGINE`` and serves.
Messages are msgpack maps framed as in ``tests/unit/framed.py``: commands on stdin, replies on the process's
original stdout (the engines' own log lines are sent to stderr). The first reply is
``{"info": <msgpack PeerInfo>, "base": addr, "nbytes": n}``. Commands (``cmd``):

- ``connect`` (``peer``: msgpack PeerInfo) -> ``{"name": handle}``: load the test's rank (NIXL needs it
  before that rank's notifications can name their sender);
- ``digest`` -> ``{"sha256": hex}`` of the whole buffer;
- ``reset`` -> ``{}``: restore the initial bytes;
- ``wait_notify`` (``timeout``) -> ``{"sender", "msg", "sha256"}``: poll notifications; the digest is taken
  the moment the first one is seen, so it shows what had landed when the peer was told;
- ``exit``: close the transport and leave.
"""

from __future__ import annotations

import hashlib
import sys
import time
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt
from framed import read_frame, reply_channel, write_frame


def make_transport(engine: str) -> Any:
    from kvplane.backend import get_backend
    from kvplane.transports.mooncake import MooncakeTransport
    from kvplane.transports.nixl import NixlTransport

    classes = {"mooncake": MooncakeTransport, "nixl": NixlTransport}
    backend = get_backend("cpu")
    return backend, classes[engine](backend)


def main(engine: str, nbytes: int, seed: int) -> None:
    replies = reply_channel()  # NIXL and UCX print to stdout; keep the reply channel clean
    from kvplane.transports.base import PeerInfo

    backend, transport = make_transport(engine)
    tensor = backend.alloc_host(nbytes)
    buf = tensor.numpy()
    initial = np.frombuffer(np.random.default_rng(seed).bytes(nbytes), np.uint8) if seed >= 0 else None
    if initial is not None:
        buf[:] = initial
    base = int(tensor.data_ptr())
    transport.register([(base, nbytes)])
    write_frame(replies, {"info": msgspec.msgpack.encode(transport.peer_info()), "base": base, "nbytes": nbytes})
    commands = sys.stdin.buffer
    while (msg := read_frame(commands)) is not None:
        cmd = msg["cmd"]
        if cmd == "exit":
            break
        if cmd == "connect":
            name = transport.connect(msgspec.msgpack.decode(msg["peer"], type=PeerInfo))
            write_frame(replies, {"name": name})
        elif cmd == "digest":
            write_frame(replies, {"sha256": hashlib.sha256(buf.data).hexdigest()})
        elif cmd == "reset":
            if initial is not None:
                buf[:] = initial
            write_frame(replies, {})
        elif cmd == "wait_notify":
            write_frame(replies, wait_notify(transport, buf, float(msg["timeout"])))
    transport.close()


def wait_notify(transport: Any, buf: npt.NDArray[np.uint8], timeout: float) -> dict[str, Any]:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        notes = transport.notifications()
        if notes:
            sha = hashlib.sha256(buf.data).hexdigest()
            sender, message = notes[0]
            return {"sender": sender, "msg": message, "sha256": sha, "count": len(notes)}
        time.sleep(0.0005)
    return {"error": f"no notification within {timeout} s"}


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
