"""An offload engine with a real store tier in its own process: ``python offload_peer.py MASTER_ADDRESS``.

It builds the unit tests' ``Harness`` (small GQA spec, cpu backend) over a ``StoreTier`` that writes through to
the Mooncake Store at ``MASTER_ADDRESS``, and serves framed msgpack commands (``tests/unit/framed.py``). The
first reply is ``{"fingerprint": fp}``. Commands (``cmd``):

- ``store`` (``hashes``, ``ids``) -> ``{"stored": n, "sha256": hex}``: fill device blocks ``ids`` with the bytes
  of ``hashes``, store them (write-through puts them in the store), wait until the puts are done; the digest
  covers those device blocks, slot by slot;
- ``exit``: close the engine and leave (its store segment goes with it: keep it alive while others read).
"""

from __future__ import annotations

import hashlib
import sys
from typing import Any

from framed import read_frame, reply_channel, write_frame


def digest(harness: Any, ids: list[int]) -> str:
    h = hashlib.sha256()
    for i in range(len(harness.slots)):
        h.update(harness.slot_bytes(i)[ids].contiguous().numpy().tobytes())
    return h.hexdigest()


def main(master_address: str) -> None:
    replies = reply_channel()  # Mooncake logs to stdout and stderr; keep the reply channel clean
    from offload_fakes import Harness, small_spec

    from kvplane.flows.offload import StoreConfig
    from kvplane.flows.offload.store import StoreTier

    config = StoreConfig(master_address, write_through=True, segment_bytes=32 << 20, local_buffer_bytes=16 << 20)
    harness = Harness(small_spec(), host_blocks=8, store_tier=StoreTier(config))
    write_frame(replies, {"fingerprint": harness.engine.fingerprint})
    while (msg := read_frame(sys.stdin.buffer)) is not None:
        if msg["cmd"] == "exit":
            break
        if msg["cmd"] == "store":
            stored = harness.store(msg["rid"], msg["hashes"], msg["ids"])
            harness.engine.wait_idle()
            write_frame(replies, {"stored": stored, "sha256": digest(harness, msg["ids"])})
    harness.engine.close()


if __name__ == "__main__":
    main(sys.argv[1])
