"""Checking a peer's handshake (role, compatibility hash, manifest), and connecting the transport to it off
the I/O loop.

Both sides call ``check_hello`` on the other's ``Handshake``, before any byte moves. A model that differs
(layers, heads, dtype, KV-cache groups, layout family, kvplane version) raises ``ManifestMismatch`` naming the
field and both values, and transports that share no protocol (an ``ascend`` side and an ``rdma`` one) raise
``TransportMismatch`` naming both sides' devices, protocols and what would work; the prefill side answers it with a ``Reject`` and the decode side fails the requests
waiting on that peer with the same words. Connecting the transport (Mooncake's ``send_probe``, which a silent
listener holds for a minute; NIXL's ``add_remote_agent``, which waits for the agent lock a transfer holds) runs
on a ``Prober`` thread with a short deadline, and the result comes back to the loop.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from kvplane.errors import ManifestMismatch, TransportMismatch
from kvplane.flows.disagg.wire.errors import HandshakeError
from kvplane.flows.disagg.wire.local import LocalKV
from kvplane.flows.disagg.wire.messages import Handshake
from kvplane.kv.manifest import Manifest, check_compatible
from kvplane.transports.base import PeerInfo, Transport

MAX_PROBE_THREADS = 16  # connects running at once, hung ones included; more handshakes are refused meanwhile


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
    transport_name: str = ""  # PeerInfo.name: the engine-level identity the transport knows it by
    peer_bytes: bytes = b""  # Handshake.peer as received, to recognise a repeated handshake
    key: str = ""  # the peer's CURVE public key (Z85) where the side channel has keys (prefill side)


def check_hello(local: LocalKV, hello: Handshake, *, expect_role: str) -> tuple[Manifest, PeerInfo]:
    """The peer's manifest and transport descriptor, once every check passed; raises naming the problem."""
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
    problem = local.transport.unreachable(peer_info)
    if problem:
        raise TransportMismatch(_speaking(local.manifest.device_type, local.transport.speaks()),
                                _speaking(manifest.device_type, peer_info.speaks), problem)
    if not peer_info.spans:
        raise HandshakeError(
            f"handshake from {hello.engine_id!r}: its transport descriptor names no registered memory (spans), so "
            f"no plan could be checked against it; the peer must register its KV cache"
        )
    return manifest, peer_info


def _speaking(device: str, speaks: tuple[str, ...]) -> str:
    return f"is {device} speaking {', '.join(speaks)}"


def record(hello: Handshake, manifest: Manifest, info: PeerInfo, handle: str, identity: bytes = b"",
           key: str = "") -> PeerRecord:
    return PeerRecord(hello.engine_id, hello.rank, hello.tp_size, hello.boot_id, manifest, handle, identity,
                      info.name, hello.peer, key)


Done = Callable[[str, str], None]  # (handle, error): exactly one of them is non-empty


def where(info: PeerInfo) -> str:
    """The peer a connect was for, as failure reasons name it: its engine identity and address."""
    return f"{info.engine} peer {info.name!r} at {info.host}" + (f":{info.port}" if info.port else "")


class Prober:
    """Connects the transport to peers on short-lived threads; ``done`` runs on the loop (via ``deliver``),
    exactly once per ``connect``: with the handle, or with the error, or with a timeout from ``expire``.
    A thread per connect (bounded by ``MAX_PROBE_THREADS``), not one ``Executor``: a connect stuck for a minute
    on a silent listener must not hold up the connects behind it."""

    def __init__(self, transport: Transport, deliver: Callable[[Callable[[], None]], object], timeout_s: float
                 ) -> None:
        self._transport, self._deliver, self.timeout_s = transport, deliver, timeout_s
        self._pending: dict[int, tuple[float, Done, str]] = {}  # loop thread only; the peer's address last
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._alive = 0

    def connect(self, info: PeerInfo, done: Done) -> bool:
        """Start connecting to ``info``; False (nothing started) while too many connects are running."""
        with self._lock:
            if self._alive >= MAX_PROBE_THREADS:
                return False
            self._alive += 1
        probe = next(self._ids)
        self._pending[probe] = (time.monotonic() + self.timeout_s, done, where(info))
        threading.Thread(target=self._run, args=(probe, info), name="kvplane-probe", daemon=True).start()
        return True

    def expire(self, now: float) -> None:
        """On the loop: fail connects past their deadline (their threads end when the engine returns)."""
        for probe, (deadline, done, peer) in list(self._pending.items()):
            if now > deadline:
                del self._pending[probe]
                done("", f"the transport did not reach {peer} within probe_timeout_s={self.timeout_s}")

    def _run(self, probe: int, info: PeerInfo) -> None:
        handle, error = "", ""
        try:
            handle = self._transport.connect(info)
        except Exception as e:  # PeerUnreachable, TransportError, or an engine binding's own error
            error = f"reaching {where(info)}: {type(e).__name__}: {e}"
        finally:
            with self._lock:
                self._alive -= 1
        self._deliver(lambda: self._finish(probe, handle, error or ("" if handle else "no handle")))

    def _finish(self, probe: int, handle: str, error: str) -> None:
        entry = self._pending.pop(probe, None)
        if entry is not None:
            entry[1]("" if error else handle, error)
