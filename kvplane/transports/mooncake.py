"""Mooncake Transfer Engine transport: P2P handshake (no etcd), the backend's protocol (tcp, rdma, ascend).

Flows create it through the transport registry; a peer reaches this rank by ``PeerInfo.name`` =
``"host:rpc_port"``. Mooncake's ``initialize`` installs RDMA wherever its topology discovery finds RDMA NICs,
whatever protocol it is given, so ``tcp`` is asked for with ``MC_FORCE_TCP=1`` around it. kvplane's engine
starts take turns around such variables, so one start never sees another's (the store client's own engine,
started by Mooncake Store's ``setup``, is outside this).

Mooncake's Python binding has no non-blocking batch status (``get_batch_transfer_status`` blocks until the batch
ends or Mooncake's own timeout), so each submitted plan runs on a worker thread: chunks of at most ``max_batch``
descriptors (Mooncake's tcp transport refuses more than 1024 queued per peer), one chunk per peer at a time, each
retried with back-off. That status call loops on the engine's status without sleeping, holding a core while the
batch moves, so the worker first sleeps through most of the batch's expected time (``pacing``). ``notify`` rides
on the last chunk (``batch_transfer_sync`` with a ``TransferNotify``), which Mooncake posts to the peer only once
that batch has completed, and the last chunk starts only after every earlier one completed.

``reset`` is the fence for batches Mooncake may still move after their status call gave up: it waits for the
engine calls in flight to return (bounded by Mooncake's own timeout), destroys the engine (its TCP sessions
close, so nothing queued before can land here) and starts a fresh one on the same memory. Its RPC port, so
``peer_info()``, changes: a peer that writes here must learn it again (a new handshake).

Notification bytes travel as Mooncake strings: kvplane sends ``msg.decode("latin-1")``, so any bytes survive
the UTF-8 round trip, and decodes what arrives with ``latin-1`` (UTF-8 when a foreign sender used characters
beyond U+00FF).
"""

from __future__ import annotations

import functools
import logging
import math
import os
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from importlib import metadata
from typing import Any

from kvplane.backend.base import Backend
from kvplane.descriptors import CopyPlan
from kvplane.errors import PeerUnreachable, PlanError, TransferFailed, TransportError, TransportUnavailable
from kvplane.logs import quiet_engine_logs
from kvplane.transports.base import Op, PeerInfo, Transfer, Transport, TransportConfig, local_remote
from kvplane.transports.batching import Deadline, check_op, check_plan, check_spans
from kvplane.transports.chunked import Job
from kvplane.transports.listener import woken
from kvplane.transports.mooncake_transfer import NOT_SUBMITTED, MooncakeTransfer
from kvplane.transports.pacing import Pace
from kvplane.transports.restarts import RestartBackoff

INSTALL_HINT = (
    "pip install mooncake-transfer-engine-non-cuda (CPU machines) or mooncake-transfer-engine (CUDA); "
    "never both, they install the same module"
)
TIMEOUT_ENV = "MC_TRANSFER_TIMEOUT"  # Mooncake's own bound on a blocking status call, seconds, at least 5
FORCE_TCP_ENV = "MC_FORCE_TCP"  # Mooncake installs TCP only when set, whatever protocol initialize() is given
logger = logging.getLogger("kvplane.transports")


_ENV_LOCK = threading.RLock()  # engine starts take turns: each sees only its own variables (or the user's)


@contextmanager
def _env_default(name: str, value: str | None) -> Iterator[None]:
    """``$name`` set to ``value`` for the block unless the user set it (or value is None); removed after. The
    block holds ``_ENV_LOCK``: another kvplane engine starting on another thread meanwhile waits for it."""
    with _ENV_LOCK:
        own = value is not None and name not in os.environ
        if own:
            os.environ[name] = str(value)
        try:
            yield
        finally:
            if own:
                os.environ.pop(name, None)


def _import_engine() -> Any:
    quiet_engine_logs()
    try:
        import mooncake.engine as engine
    except Exception as e:  # ImportError, or OSError for a missing libibverbs / libcudart
        raise TransportUnavailable(f"mooncake does not import here ({type(e).__name__}: {e}); {INSTALL_HINT}") from e
    return engine


def _version() -> str:
    for dist in ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine"):
        try:
            return f"{dist} {metadata.version(dist)}"
        except metadata.PackageNotFoundError:
            continue
    return "mooncake (version unknown)"


class MooncakeTransport(Transport):
    name = "mooncake"
    engine_limit = 1024  # descriptors per batch: the tcp transport fails larger batches to one peer

    def __init__(self, backend: Backend, config: TransportConfig | None = None, *, agent_name: str = "") -> None:
        super().__init__(backend, config, agent_name=agent_name)
        self._mc = _import_engine()
        for key, value in backend.mooncake_env_defaults.items():
            os.environ.setdefault(key, value)
        self._engine: Any = self._start_engine()
        self._rpc_port = int(self._engine.get_rpc_port())
        self._self_name = f"{self.config.host}:{self._rpc_port}"  # how peers name this engine
        self._spans: list[tuple[int, int]] = []
        self._peer_spans: dict[str, list[tuple[int, int]] | None] = {}
        self._peer_locks: dict[str, threading.Lock] = {}
        self._transfers: list[MooncakeTransfer] = []
        self._lock = threading.Lock()
        self._closed = False
        self.generation = 0  # resets so far: peer_info() differs after each
        self._restarts = RestartBackoff()
        self._pace = Pace()  # how long a waiter sleeps before Mooncake's spinning status call
        self._stop_sleeping = threading.Event()  # set by close and reset: a waiter's head start ends at once

    @classmethod
    def available(cls) -> tuple[bool, str]:
        try:
            _import_engine()
        except TransportUnavailable as e:
            return False, str(e)
        except Exception as e:  # available() must not raise
            return False, f"mooncake probe raised {type(e).__name__}: {e}"
        return True, _version()

    def speaks(self) -> tuple[str, ...]:
        return (self.config.protocol or self.backend.mooncake_protocol,)

    def no_common_fix(self, peer: PeerInfo) -> str:
        return (
            "set one Mooncake protocol on both sides (DisaggConfig.protocol, KVPLANE_MOONCAKE_PROTOCOL): 'tcp' "
            "reaches any device through host memory, 'rdma' needs RDMA NICs on both. An Ascend side ('ascend') "
            "meets an RDMA side only through Mooncake's heterogeneous ascend transport (built with "
            "USE_ASCEND_HETEROGENEOUS on the Ascend side; it writes only, so push modes), which kvplane has not "
            "run (docs/disagg.md, Cross-vendor)"
        )

    def _start_engine(self) -> Any:
        protocol = self.speaks()[0]
        # Mooncake reads its status timeout once, in the engine's constructor: tie it to ours unless set.
        with _env_default(TIMEOUT_ENV, str(max(5, math.ceil(self.config.timeout_s)))):
            engine = self._mc.TransferEngine()
        # initialize() does not install the protocol it is given: it discovers the topology and installs RDMA
        # when it finds RDMA NICs; only MC_FORCE_TCP makes it TCP (docs/deploy.md, Transport options)
        with _env_default(FORCE_TCP_ENV, "1" if protocol == "tcp" else None):
            rc = engine.initialize(self.config.host, "P2PHANDSHAKE", protocol, self.config.device_name)
        if rc != 0:
            raise TransportError(
                f"mooncake initialize(host={self.config.host!r}, protocol={protocol!r}) returned {rc}; "
                f"check that TransportConfig.host is an address of this machine and the protocol's devices exist"
            )
        return engine

    # -- memory and identity ------------------------------------------------------------------------------
    def register(self, spans: Sequence[tuple[int, int]]) -> None:
        self._check_open("register")
        new = check_spans(spans)
        if not new:
            return
        location = self.backend.mooncake_location()
        rc = self._live().batch_register_memory([a for a, _ in new], [n for _, n in new], location)
        if rc != 0:
            raise TransportError(
                f"mooncake batch_register_memory of {len(new)} spans at location={location!r} returned {rc}; "
                f"spans must not overlap ones already registered and must be {location} memory"
            )
        self._spans.extend(new)

    def peer_info(self) -> PeerInfo:
        self._check_open("peer_info")
        if self._engine is None:  # started again by restart() (the flow's transfer thread), not here
            raise TransportError("the mooncake engine is down since a reset; no descriptor yet")
        return PeerInfo(
            engine=self.name,
            name=self._self_name,
            host=self.config.host,
            port=self._rpc_port,
            spans=tuple(self._spans),
            speaks=self.speaks(),
        )

    def connect(self, peer: PeerInfo) -> str:
        self._check_open("connect")
        self._check_engine(peer)
        rc = self._live().send_probe(peer.name)
        if rc != 0:
            raise PeerUnreachable(
                f"mooncake peer {peer.name!r} did not answer a probe (rc={rc}); is its process running and "
                f"{peer.host}:{peer.port} reachable from {self.config.host}?"
            )
        self._peer_spans[peer.name] = list(peer.spans) if peer.spans else None
        return peer.name

    # -- transfers ----------------------------------------------------------------------------------------
    def submit(self, peer: str, op: Op, plan: CopyPlan, notify: bytes | None = None) -> Transfer:
        self._check_open("submit")
        op = check_op(op)
        check_plan(op, plan, self._spans, self._peer_spans.get(peer), peer)
        if notify is not None and not len(plan):
            raise PlanError(f"mooncake carries notify={notify!r} on a transfer, and the plan is empty; "
                            f"send the notify with the last non-empty plan")
        self._live()
        move = functools.partial(self.move, peer, op)
        job = Job.split(self.config, self.engine_limit, peer, op, plan, notify)
        transfer = MooncakeTransfer(move, self.config, job)
        with self._lock:
            self._check_open("submit")  # close() may have run since the check above
            self._transfers = [t for t in self._transfers if not t.finished] + [transfer]
            transfer.start()
            self.submitted.add(plan)
        return transfer

    def move(self, peer: str, op: Op, local: list[int], remote: list[int], lengths: list[int],
             notify: bytes | None) -> int:
        """One engine batch, blocking (the binding releases the GIL); 0 when every descriptor landed."""
        with self._peer_lock(peer):
            engine = self._engine
            if engine is None:
                return NOT_SUBMITTED
            if notify is not None:
                opcode = self._mc.TransferOpcode.Read if op == "READ" else self._mc.TransferOpcode.Write
                note = self._mc.TransferNotify(self._self_name, notify.decode("latin-1"))
                return int(engine.batch_transfer_sync(peer, local, remote, lengths, opcode, note))
            start = engine.batch_transfer_async_read if op == "READ" else engine.batch_transfer_async_write
            submitted = time.monotonic()
            batch = start(peer, local, remote, lengths)
            if not batch:  # 0: the engine could not open the peer's segment or refused the batch
                return NOT_SUBMITTED
            nbytes = sum(lengths)
            head_start_s = self._pace.head_start_s(peer, nbytes, len(lengths))
            if head_start_s:  # the status call spins a core: leave it to the engine for most of the batch
                self._stop_sleeping.wait(head_start_s)
            rc = int(engine.get_batch_transfer_status([batch]))
            if rc == 0:
                self._pace.observe(peer, nbytes, len(lengths), time.monotonic() - submitted)
            return rc

    def raw_move(self, peer: str, op: Op, plan: CopyPlan) -> None:
        """The engine's own batch call (``batch_transfer_sync_read``/``_write``) on ``engine_limit`` descriptors
        at a time, without kvplane's chunking, threads, checks or retries; the bench's baseline."""
        engine = self._live()
        local, remote = local_remote(op, plan)
        call = engine.batch_transfer_sync_read if op == "READ" else engine.batch_transfer_sync_write
        for i in range(0, len(plan), self.engine_limit):
            j = i + self.engine_limit
            rc = call(peer, local[i:j].tolist(), remote[i:j].tolist(), plan.length[i:j].tolist())
            if rc != 0:
                raise TransferFailed(f"raw mooncake batch returned {rc}")

    @contextmanager
    def _peer_lock(self, peer: str) -> Iterator[None]:
        with self._lock:
            lock = self._peer_locks.setdefault(peer, threading.Lock())
        with lock:
            yield

    def notifications(self) -> list[tuple[str, bytes]]:
        self._check_open("notifications")
        out: list[tuple[str, bytes]] = []
        engine = self._engine
        if engine is None:  # being reset
            return out
        for note in engine.get_notifies():
            msg: str = note.msg
            try:
                out.append((str(note.name), msg.encode("latin-1")))
            except UnicodeEncodeError:  # a sender that is not kvplane wrote plain UTF-8 text
                out.append((str(note.name), msg.encode("utf-8")))
        return out

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            transfers, self._transfers = self._transfers, []
        self._stop_sleeping.set()
        for transfer in transfers:  # an engine call in flight must end before its memory goes
            transfer.cancel()
        drain = Deadline.after(self.config.timeout_s + 5)  # Mooncake ends each call by its own timeout
        lingering = [t for t in transfers if not t.join(drain.remaining())]
        engine, self._engine = self._engine, None
        if self._spans and not lingering and engine is not None:  # None: down since a reset
            engine.batch_unregister_memory([a for a, _ in self._spans])
        self._spans = []
        with woken(self._rpc_port):
            del engine  # the binding's destructor closes segments and stops the engine's threads

    def reset(self) -> None:
        self._check_open("reset")
        with self._lock:
            transfers, self._transfers = self._transfers, []
        for transfer in transfers:
            transfer.cancel()
        bound_s = max(5, math.ceil(self.config.timeout_s)) + 5  # past Mooncake's own status timeout
        drain = Deadline.after(bound_s)
        self._stop_sleeping.set()
        try:
            lingering = [t for t in transfers if not t.join(drain.remaining())]
        finally:
            self._stop_sleeping.clear()
        if lingering:
            with self._lock:
                self._transfers = lingering + self._transfers
            raise TransportError(
                f"mooncake reset: {len(lingering)} engine calls still running after {bound_s} s; the engine "
                f"cannot be torn down under them"
            )
        with self._lock:
            engine, self._engine = self._engine, None
            self._restarts.clear()
        self._pace.forget()
        if engine is not None:
            if self._spans:
                engine.batch_unregister_memory([a for a, _ in self._spans])
            with woken(self._rpc_port):
                del engine  # closes the engine's TCP sessions: no batch queued before can land here any more
        self.generation += 1
        for transfer in transfers:
            transfer.engine_reset()
        self.restart()  # the fence holds whether or not it starts now; else it starts again on a later call

    def _running(self) -> Any:
        return self._live()

    def _live(self) -> Any:
        """The engine; after a reset whose restart failed, start it again (at most once per back-off) on the
        same memory."""
        with self._lock:
            if self._engine is not None:
                return self._engine
            self._restarts.check_due("the mooncake engine is down since a reset")
            try:
                fresh = self._start_engine()
                if self._spans:
                    location = self.backend.mooncake_location()
                    rc = fresh.batch_register_memory([a for a, _ in self._spans], [n for _, n in self._spans],
                                                     location)
                    if rc != 0:
                        raise TransportError(f"registering {len(self._spans)} spans again returned {rc}")
            except TransportError as e:
                self._restarts.failed()
                logger.warning("mooncake engine did not start again after a reset (%s); retried with back-off", e)
                raise
            self._engine = fresh
            self._rpc_port = int(fresh.get_rpc_port())
            self._self_name = f"{self.config.host}:{self._rpc_port}"
            self._restarts.clear()
            self.generation += 1
        logger.warning("mooncake engine started again after a reset, now %s", self._self_name)
        return fresh
