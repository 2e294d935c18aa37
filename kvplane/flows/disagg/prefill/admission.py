"""Which decode ranks a prefill rank talks to: handshakes, and whose messages count.

A decode rank is known by ``(engine_id, rank)`` once its handshake passed ``peers.check_hello`` and its
transport answered (``Prober``, off the loop). Every later message must come from the ZMQ connection that
handshook under that name (``sender``): its routing id and, where the side channel has CURVE keys, its public key
too, so a client that connects under a decode's routing id with another key (libzmq hands the id over to it) is
refused and its word never counts as the decode's. A record is replaced only by the same connection, or once the old
connection is proved gone (a send to it fails: the ROUTER refuses unknown identities), so a replayed handshake
with another rank's engine id cannot take its place; nor can a handshake that names another peer's transport.
The transport is connected only after these checks, so a refused handshake never touches a working connection.

A decode rank whose handshake timed out (this rank stalled: a GC pause, a long step) handshakes again on the same
connection. A handshake that comes on the connection whose handshake under that name is still being checked is
not refused: the latest one is kept and taken once the first is answered (at once when it says the same), so a
decode that asks again is accepted, while another connection still cannot take the name over. Every answer (this
rank's ``Handshake`` or a ``Reject``) carries the ``attempt`` of the handshake it answers, and the decode takes only
the answer to its latest: so a kept handshake is what the one answer answers, and one that says something new (the
decode's transport was reset meanwhile, so the first may name an engine that is gone) is checked on its own, not
refused with the first.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import msgspec

from kvplane.errors import KvplaneError, ManifestMismatch
from kvplane.flows.disagg.wire.limits import RateLimit
from kvplane.flows.disagg.wire.local import LocalKV
from kvplane.flows.disagg.wire.messages import Handshake, Message, Problem, Reject
from kvplane.flows.disagg.wire.peers import PeerRecord, Prober, check_hello, record
from kvplane.kv.manifest import Manifest
from kvplane.transports.base import PeerInfo

logger = logging.getLogger("kvplane.disagg")
Key = tuple[str, int]


class Admission:
    def __init__(self, local: LocalKV, prober: Prober, send: Callable[[bytes, Message], bool],
                 replaced: Callable[[PeerRecord, str], None], limit: RateLimit) -> None:
        self.local, self.prober, self._send, self._replaced, self._limit = local, prober, send, replaced, limit
        self.peers: dict[Key, PeerRecord] = {}
        self._probing: dict[Key, tuple[bytes, str]] = {}  # names being checked -> whose handshake it is
        self._again: dict[Key, Handshake] = {}  # the latest handshake that connection sent meanwhile

    def sender(self, identity: bytes, key: str, engine_id: str, rank: int) -> PeerRecord | None:
        """The peer record a message from connection ``identity`` under CURVE ``key`` claiming ``(engine_id, rank)``
        may speak for, or None."""
        peer = self.peers.get((engine_id, rank))
        return peer if peer is not None and (peer.identity, peer.key) == (identity, key) else None

    def on_handshake(self, identity: bytes, key: str, hello: Handshake) -> None:
        try:
            manifest, info = check_hello(self.local, hello, expect_role="decode")
        except ManifestMismatch as e:
            self._reject(identity, Reject(e.field, repr(e.local), repr(e.remote), str(e), hello.attempt))
            return
        except KvplaneError as e:  # a manifest that does not decode, a descriptor without memory
            self._reject(identity, Reject("handshake", "", "", str(e), hello.attempt))
            return
        name = (hello.engine_id, hello.rank)
        old = self.peers.get(name)
        if old is not None and (old.identity, old.key) == (identity, key) and old.boot_id == hello.boot_id \
                and old.peer_bytes == hello.peer:
            self._answer(identity, hello)  # the same connection asking again
            return
        why = self._refusal(name, identity, key, info)
        if not why and name in self._probing:
            if self._probing[name] == (identity, key):  # the same connection asking again: answered after the first
                self._again[name] = hello
                return
            why = "a handshake under this name is being checked already on another connection; retry once it is " \
                  "answered"
        if why:
            self._reject(identity, Reject("peer", "", "", why, hello.attempt))
            return
        self._probing[name] = (identity, key)

        def connected(handle: str, error: str) -> None:
            self._connected(identity, key, hello, manifest, info, handle, error)

        if not self.prober.connect(info, connected):
            self._probing.pop(name, None)
            self._reject(identity, Reject("handshake", "", "", "too many transports being connected; retry",
                                          hello.attempt))

    def _connected(self, identity: bytes, key: str, hello: Handshake, manifest: Manifest, info: PeerInfo,
                   handle: str, error: str) -> None:
        name = (hello.engine_id, hello.rank)
        self._probing.pop(name, None)
        again = self._again.pop(name, None)
        why = f"this prefill rank cannot reach its transport: {error}" if error else \
            self._refusal(name, identity, key, info)
        # One answer per connection: to the latest handshake it sent (the decode takes no other). A handshake kept
        # meanwhile that says the same gets this one's verdict; one that says something new (its transport was
        # reset, so this one may have named an engine that is gone) is checked on its own and answered then.
        new = again is not None and (again.boot_id, again.peer) != (hello.boot_id, hello.peer)
        latest = again if again is not None and not new else hello
        if why:
            if again is not None and new:
                self.on_handshake(identity, key, again)
            else:
                self._reject(identity, Reject("handshake", "", "", why, latest.attempt))
            return
        old = self.peers.get(name)
        self.peers[name] = record(hello, manifest, info, handle, identity, key)
        if old is not None:
            self._replaced(old, f"decode {hello.engine_id} rank {hello.rank} handshook again (boot {hello.boot_id})")
        if again is not None and new:
            self.on_handshake(identity, key, again)
        else:
            self._answer(identity, latest)

    def _refusal(self, name: Key, identity: bytes, key: str, info: PeerInfo) -> str:
        """Why a handshake from connection ``identity`` under CURVE ``key`` may not (yet) stand for ``name``; ""
        when it may."""
        for other, peer in self.peers.items():
            if peer.identity == identity and peer.key != key:  # libzmq handed the id over: never the same client
                return (f"the routing id of this connection belongs to decode {other[0]!r} rank {other[1]}, which "
                        f"handshook under another CURVE key; a connection under it with key {key!r} is refused "
                        f"(each decode socket picks a random routing id of its own: do not set one)")
        old = self.peers.get(name)
        if old is not None and old.identity != identity and self._alive(old):
            return (f"decode {name[0]!r} rank {name[1]} is connected already (boot {old.boot_id}); a second "
                    f"connection under its name is refused while the first one lives")
        for other, peer in self.peers.items():
            if other != name and peer.transport_name == info.name and self._alive(peer):
                return f"transport {info.name!r} belongs to decode {other[0]!r} rank {other[1]}, which is connected"
        return ""

    def _alive(self, peer: PeerRecord) -> bool:
        """Whether the connection ``peer`` handshook on is still up (the ROUTER refuses a gone identity)."""
        return self._send(peer.identity, Problem("", self.local.config.rank, "connection check; ignore"))

    def _answer(self, identity: bytes, hello: Handshake) -> None:
        """This rank's handshake, as the answer to ``hello`` (its ``attempt``)."""
        self._send(identity, msgspec.structs.replace(self.local.handshake(), attempt=hello.attempt))

    def _reject(self, identity: bytes, reject: Reject) -> None:
        self._limit.warn(logger, "prefill rank %d: handshake refused: %s", self.local.config.rank, reject.reason)
        self._send(identity, reject)
