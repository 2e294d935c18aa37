"""The transport interface: moves a ``CopyPlan`` between the memory of two ranks through a transfer engine.

A transport registers the backend's memory spans, publishes a ``PeerInfo`` that a peer needs to reach it,
connects to peers, submits READ and WRITE plans (split to the engine's limits, retried with bounded back-off),
polls them, and delivers notifications. Every wait has a deadline: a vanished peer or an address outside
the peer's registered memory becomes a typed error (``kvplane.errors``), never a hang.

Plan direction: ``plan.src`` is always where bytes come from and ``plan.dst`` where they go. For ``WRITE``
``src`` is local and ``dst`` remote; for ``READ`` ``src`` is remote and ``dst`` local.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

import msgspec

from kvplane.backend.base import Backend
from kvplane.descriptors import CopyPlan, Int64Array
from kvplane.errors import TransportError
from kvplane.transports.options import NIXL_DEFAULT_BACKENDS

Op = Literal["READ", "WRITE"]
DEFAULT_TIMEOUT_S = 30.0


def local_remote(op: Op, plan: CopyPlan) -> tuple[Int64Array, Int64Array]:
    """``(local, remote)`` address arrays: WRITE sends ``src`` to the peer, READ fetches ``src`` from it."""
    return (plan.src, plan.dst) if op == "WRITE" else (plan.dst, plan.src)


class PeerInfo(msgspec.Struct, frozen=True):
    """What a peer needs to reach this rank's transport (sent in the handshake, msgpack-encoded)."""

    engine: str  # the transport's name, e.g. "mooncake" or "nixl"
    name: str  # engine-level identity: Mooncake "host:rpc_port", NIXL agent name
    host: str
    port: int = 0
    metadata: bytes = b""  # engine metadata a peer must load (NIXL agent metadata)
    spans: tuple[tuple[int, int], ...] = ()  # registered (addr, length) ranges, so a peer can check a plan
    speaks: tuple[str, ...] = ()  # what the engine can reach a peer by: Mooncake its protocol, NIXL its backends


@dataclass(frozen=True)
class TransportConfig:
    host: str = "127.0.0.1"
    timeout_s: float = DEFAULT_TIMEOUT_S  # deadline for one submitted plan
    retries: int = 3  # resubmissions of a failed batch
    backoff_s: float = 0.05  # first back-off, doubled per retry
    max_batch: int | None = None  # descriptors per engine call; None: the engine's own limit
    # engine options (checked by DisaggConfig, transports/options.py): Mooncake's protocol ("" = the backend's)
    # and RDMA NICs ("" = discover); the NIXL backends to start
    protocol: str = ""
    device_name: str = ""
    nixl_backends: tuple[str, ...] = NIXL_DEFAULT_BACKENDS


class Transfer(ABC):
    """A submitted plan. ``poll`` is non-blocking; ``wait`` blocks until done or the deadline."""

    @abstractmethod
    def poll(self) -> bool:
        """True when every descriptor is done; raises ``TransferFailed`` if the engine failed it."""

    @abstractmethod
    def wait(self, timeout_s: float | None = None) -> None:
        """Block until done; ``TransferTimeout`` past the deadline, ``TransferFailed`` on failure."""

    def call_when_done(self, wake: Callable[[], None]) -> bool:
        """Have ``wake()`` called, from any thread, once ``poll`` would return True or raise, so a poller can
        sleep until then; False when this engine cannot tell (its transfers move only while polled, as NIXL's):
        nothing is called, and the poller keeps its interval."""
        return False

    @property
    def settled(self) -> bool:
        """Whether the engine can no longer move a byte of this transfer: it finished, the engine reported it
        terminal, or the engine was reset. A transfer that timed out while the engine still had it queued is not
        settled: it may resume (a link that comes back) and write the destination. Engines that can leave a
        failed transfer running override this; until a failed transfer settles, its destination is not free."""
        return True


@dataclass
class Submitted:
    """What a transport's ``submit`` handed its engine so far: transfers, and the descriptors in them (before
    chunking). Counted on the submitting thread; read anywhere (a snapshot may lag by one transfer)."""

    transfers: int = 0
    descriptors: int = 0

    def add(self, plan: CopyPlan) -> None:
        self.transfers += 1
        self.descriptors += len(plan)


class Transport(ABC):
    name: ClassVar[str]
    engine_limit: ClassVar[int]  # descriptors per batch the engine accepts by default
    generation: int = 0  # bumped by each ``reset`` and each restart: ``peer_info()`` may differ after each
    _closed: bool = False  # set by ``close``; ``_check_open`` refuses calls after it

    def __init__(self, backend: Backend, config: TransportConfig | None = None, *, agent_name: str = "") -> None:
        self.backend = backend
        self.config = config or TransportConfig()
        self.agent_name = agent_name
        self.submitted = Submitted()

    @classmethod
    @abstractmethod
    def available(cls) -> tuple[bool, str]:
        """Whether the engine imports here, and why not. Must not raise."""

    @abstractmethod
    def register(self, spans: Sequence[tuple[int, int]]) -> None:
        """Register ``(addr, length)`` spans of local memory (normally ``backend.registration_spans``)."""

    @abstractmethod
    def peer_info(self) -> PeerInfo:
        """This rank's ``PeerInfo``, valid after ``register``."""

    @abstractmethod
    def connect(self, peer: PeerInfo) -> str:
        """Make ``peer`` reachable; returns the handle ``submit`` takes. Raises ``PeerUnreachable``."""

    @abstractmethod
    def submit(self, peer: str, op: Op, plan: CopyPlan, notify: bytes | None = None) -> Transfer:
        """Start moving ``plan``; ``notify`` is delivered to the peer once all of it has landed."""

    @abstractmethod
    def notifications(self) -> list[tuple[str, bytes]]:
        """Notifications received since the last call, as ``(sender, message)``."""

    @abstractmethod
    def close(self) -> None:
        """Unregister memory and release the engine. Idempotent."""

    def reset(self) -> None:
        """The fence: tear the engine down and start a fresh one on the same memory. Once it returns, no
        transfer submitted before can read or write local memory (each ends failed and settled); peers stay
        connected under the same handles, and ``peer_info()`` may change (peers that write here must load it
        again). Raises ``TransportError`` when the engine could not be torn down in time."""
        raise TransportError(f"the {self.name} transport cannot reset its engine")

    def restart(self) -> bool:
        """Start the engine again if a ``reset`` could not (a device still down); True when it runs (or the
        transport is closed). Cheap while a back-off runs; the flow's transfer thread calls it until it is True."""
        if self._closed:
            return True
        try:
            self._running()
        except TransportError:
            return False
        return True

    def _running(self) -> object:
        """The running engine, started again (at most once per back-off) where a reset left none; raises
        ``TransportError`` while it cannot start. Engines that never go down need not override it."""
        return None

    def raw_move(self, peer: str, op: Op, plan: CopyPlan) -> None:
        """Move ``plan`` with the engine's own batch call, without kvplane's chunking, threads, checks or
        retries; blocking. The bench's baseline, not for flows. Raises ``TransferFailed`` or
        ``TransferTimeout`` when the engine fails it."""
        raise TransportError(f"the {self.name} transport has no raw engine call for the bench's baseline")

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise TransportError(f"{what}() on a closed {self.name} transport; create a new transport")

    def speaks(self) -> tuple[str, ...]:
        """What this engine reaches peers by (``PeerInfo.speaks``); a peer must share one. () where any will do."""
        return ()

    def unreachable(self, peer: PeerInfo) -> str:
        """Why no byte could move between this transport and ``peer`` ("" when some could, or a side does not
        say): the two share nothing they speak. Checked at the handshake, before any transfer."""
        mine = self.speaks()
        if not mine or not peer.speaks or set(mine) & set(peer.speaks):
            return ""
        return self.no_common_fix(peer)

    def no_common_fix(self, peer: PeerInfo) -> str:
        """What would let this transport and ``peer`` reach each other (their ``speaks`` share nothing)."""
        return f"configure both sides' {self.name} transports to share one of {sorted({*self.speaks(), *peer.speaks})}"

    def _check_engine(self, peer: PeerInfo) -> None:
        if peer.engine != self.name:
            raise TransportError(
                f"PeerInfo.engine={peer.engine!r} but this transport is {self.name!r}; both ranks must use one"
            )

    def transfer(self, peer: str, op: Op, plan: CopyPlan, notify: bytes | None = None) -> None:
        """``submit`` then ``wait`` with the configured deadline."""
        self.submit(peer, op, plan, notify).wait(self.config.timeout_s)

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
