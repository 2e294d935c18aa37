"""Checking a peer's handshake: role, compatibility hash and manifest, then connecting the transport to it.

Both sides call ``check_peer`` on the other's ``Handshake``, before any byte moves. A model that differs
(layers, heads, dtype, KV-cache groups, layout family, kvplane version) raises ``ManifestMismatch`` naming the
field and both values; the prefill side answers it with a ``Reject`` and the decode side fails the requests
waiting on that peer with the same words.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from kvplane.errors import ManifestMismatch
from kvplane.flows.disagg.errors import HandshakeError
from kvplane.flows.disagg.local import LocalKV
from kvplane.flows.disagg.messages import Handshake
from kvplane.kv.manifest import Manifest, check_compatible
from kvplane.transports.base import PeerInfo


@dataclass
class PeerRecord:
    """A peer rank that handshook: who it is, this lifetime of it, its manifest, and the transport's handle."""

    engine_id: str
    rank: int
    tp_size: int
    boot_id: str
    manifest: Manifest
    handle: str
    identity: bytes = b""  # the peer's ZMQ routing id (prefill side)


def check_peer(local: LocalKV, hello: Handshake, *, expect_role: str, identity: bytes = b"") -> PeerRecord:
    if hello.role != expect_role:
        raise HandshakeError(
            f"handshake from {hello.engine_id!r} rank {hello.rank} says role={hello.role!r}, expected "
            f"{expect_role!r}; point decode instances at prefill instances"
        )
    manifest = Manifest.decode(hello.manifest)
    if manifest.fingerprint != hello.fingerprint:
        raise HandshakeError(
            f"handshake from {hello.engine_id!r}: its fingerprint {hello.fingerprint} does not match its own "
            f"manifest ({manifest.fingerprint}); the peer runs an incompatible kvplane"
        )
    if manifest.fingerprint != local.manifest.fingerprint:
        check_compatible(local.manifest, manifest)  # raises ManifestMismatch naming the field
        raise ManifestMismatch("fingerprint", local.manifest.fingerprint, manifest.fingerprint)
    if manifest.tp_size != hello.tp_size or manifest.rank != hello.rank:
        raise HandshakeError(
            f"handshake from {hello.engine_id!r}: rank/tp_size {hello.rank}/{hello.tp_size} disagree with its "
            f"manifest's {manifest.rank}/{manifest.tp_size}"
        )
    try:
        peer_info = msgspec.msgpack.decode(hello.peer, type=PeerInfo)
    except (msgspec.MsgspecError, ValueError) as e:
        raise HandshakeError(f"handshake from {hello.engine_id!r}: transport descriptor does not decode: {e}") from None
    handle = local.transport.connect(peer_info)
    return PeerRecord(hello.engine_id, hello.rank, hello.tp_size, hello.boot_id, manifest, handle, identity)
