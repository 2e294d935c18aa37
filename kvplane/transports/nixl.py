"""NIXL transport: one NIXL agent with the configured backends (UCX by default), peers joined by exchanging agent
metadata.

Flows create it through the transport registry. ``PeerInfo.metadata`` carries this agent's metadata (taken
after ``register``, so it names the registered memory); ``connect`` loads a peer's with ``add_remote_agent``.
A plan becomes one NIXL request per chunk, driven by ``poll``: index arrays into descriptor lists prepared
once per peer (``make_prepped_xfer``, ``nixl_prep``), or where a plan does not map onto them, descriptor lists
built for the request (``initialize_xfer``); ``prep_stats`` counts which path each plan took. NIXL's
own progress thread moves the bytes, sleeping between events (``nixl_progress``: NIXL's Python API would have it
spin), and ``poll`` checks the state (which progresses UCX too), starts the next chunk and retries.
``notify`` is attached to the last chunk, which starts only after every earlier one is done; NIXL delivers a
request's notification once its data has landed. The package is ``nixl_cu12`` or ``nixl_cu13`` (both run
CPU-only), imported on first use. Methods may be called from several threads (one lock guards the agent).

``reset`` is the fence for a transfer NIXL left in flight (a timeout while the link is down): it drops the
agent, which closes its UCX workers and their connections, so nothing queued before can land; then it starts
an agent of the same name on the same memory and loads every connected peer's metadata again (same handles).
Prepared lists belong to the dropped agent: they go with it and are made again on each peer's next plan.
Its own metadata changes: a peer that writes here must load it again (a new handshake).
"""

from __future__ import annotations

import gc
import importlib
import logging
import os
import threading
import time
import uuid
import weakref
from collections.abc import Sequence
from typing import Any

from kvplane.backend.base import Backend
from kvplane.descriptors import CopyPlan
from kvplane.errors import PeerUnreachable, TransferTimeout, TransportError, TransportUnavailable
from kvplane.logs import quiet_engine_logs
from kvplane.transports.base import Op, PeerInfo, Transfer, Transport, TransportConfig, local_remote
from kvplane.transports.batching import (
    check_op,
    check_plan,
    check_spans,
    descriptor_table,
)
from kvplane.transports.chunked import Job
from kvplane.transports.nixl_devices import net_devices_env
from kvplane.transports.nixl_prep import Prepper, PrepStats
from kvplane.transports.nixl_progress import progress_delay_us, start_agent
from kvplane.transports.nixl_transfer import NixlTransfer
from kvplane.transports.restarts import RestartBackoff

MODULES = ("nixl_cu12", "nixl_cu13")
INSTALL_HINT = "pip install nixl-cu12 (or nixl-cu13 on CUDA 13 machines)"
RAW_WAIT_S = 120.0  # raw_move's bound on one request (the bench's baseline)
RESTART_WAIT_S = 2.0  # how long connect() waits for an agent that is starting again after a reset
logger = logging.getLogger("kvplane.transports")


SERDES_AGENT = b"nixlSerDes|Agent"  # NIXL's serialized agent metadata starts with the agent's name


def metadata_agent(metadata: bytes) -> str | None:
    """The agent name NIXL metadata carries (``nixlSerDes|Agent``, a little-endian u64 length, the name), or None
    when it does not start that way."""
    head = len(SERDES_AGENT)
    if not metadata.startswith(SERDES_AGENT) or len(metadata) < head + 8:
        return None
    size = int.from_bytes(metadata[head:head + 8], "little")
    name = metadata[head + 8:head + 8 + size]
    if size > 4096 or len(name) != size:
        return None
    try:
        return name.decode()
    except UnicodeDecodeError:
        return None


def _import_nixl() -> tuple[Any, str]:
    quiet_engine_logs()
    failures = []
    for module in MODULES:
        try:
            return importlib.import_module(module), module
        except Exception as e:  # ImportError, or OSError for a shared library that does not load
            failures.append(f"{module}: {type(e).__name__}: {e}")
    raise TransportUnavailable(f"NIXL does not import here ({'; '.join(failures)}); {INSTALL_HINT}")




class NixlTransport(Transport):
    name = "nixl"
    # NIXL has no small per-request cap (UCX posts descriptor by descriptor); the limit bounds the
    # descriptor lists one request builds (65536 x 24 B per side) and how long one request runs.
    engine_limit = 65536

    def __init__(self, backend: Backend, config: TransportConfig | None = None, *, agent_name: str = "") -> None:
        super().__init__(backend, config, agent_name=agent_name)
        self._nixl, self.module = _import_nixl()
        self.agent_name = agent_name or f"kvplane-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.mem_type = backend.nixl_memory_type
        self.dev_id = 0 if self.mem_type == "DRAM" else backend.device_index
        self.progress_delay_us = progress_delay_us()  # how long NIXL's progress thread may sleep (nixl_progress)
        self.lock = threading.RLock()
        self.agent: Any = self._start_agent()
        self.generation = 0  # resets so far: peer_info() differs after each
        self._old: weakref.ref[Any] | None = None  # the agent a reset dropped, until confirmed gone
        self._down = ""  # why no agent runs (a reset whose restart failed); retried from _live()
        self._restarts = RestartBackoff()
        self._regs: list[Any] = []
        self._registered: list[list[tuple[int, int]]] = []  # each register() call's spans, for a reset
        self._spans: list[tuple[int, int]] = []
        self._peer_spans: dict[str, list[tuple[int, int]] | None] = {}
        self._peer_metadata: dict[str, bytes] = {}
        self._unloaded: set[str] = set()  # peers whose metadata a restarted agent could not load yet
        self._transfers: list[NixlTransfer] = []
        self._prep = Prepper()
        self._closed = False

    @classmethod
    def available(cls) -> tuple[bool, str]:
        try:
            _, module = _import_nixl()
        except TransportUnavailable as e:
            return False, str(e)
        except Exception as e:  # available() must not raise
            return False, f"NIXL probe raised {type(e).__name__}: {e}"
        return True, f"{module} (UCX backend)"

    @property
    def prep_stats(self) -> PrepStats:
        """How many plans went through prepared descriptor lists and how many did not (and why)."""
        return self._prep.stats

    @property
    def use_prepped(self) -> bool:
        """Whether plans may use prepared descriptor lists (True by default; the bench turns it off to compare)."""
        return self._prep.enabled

    @use_prepped.setter
    def use_prepped(self, on: bool) -> None:
        self._prep.enabled = on

    def _start_agent(self) -> Any:
        # UCX reads its environment once, when the backend starts: the device's defaults, and the network devices
        # that keep its listeners on host (lo for same-host peers; nixl_devices)
        defaults = {**self.backend.nixl_env_defaults, **net_devices_env(self.config.host)}
        added = [k for k in defaults if k not in os.environ]
        os.environ.update({k: defaults[k] for k in added})
        try:
            backends = list(self.config.nixl_backends)
            agent = start_agent(self._nixl, self.module, self.agent_name, backends, self.progress_delay_us)
        except Exception as e:
            raise TransportError(f"NIXL agent {self.agent_name!r} with backends {backends} did not start: "
                                 f"{type(e).__name__}: {e}") from e
        finally:
            for key in added:
                os.environ.pop(key, None)
        missing = [b for b in backends if b not in agent.backends]  # NIXL skips a missing plugin with a log line
        if missing:
            raise TransportUnavailable(
                f"{self.module} did not start backend(s) {missing} (plugins: {agent.get_plugin_list()}); choose "
                f"TransportConfig.nixl_backends among them, or reinstall {self.module}"
            )
        return agent

    # -- memory and identity ------------------------------------------------------------------------------
    def register(self, spans: Sequence[tuple[int, int]]) -> None:
        self._check_open("register")
        new = check_spans(spans)
        if not new:
            return
        with self.lock:
            self._live()
            self._regs.append(self._register(new))
        self._registered.append(new)
        self._spans.extend(new)

    def _register(self, spans: list[tuple[int, int]]) -> Any:
        try:
            return self.agent.register_memory([(a, n, self.dev_id, "") for a, n in spans], self.mem_type)
        except Exception as e:
            raise TransportError(
                f"NIXL register_memory of {len(spans)} spans as {self.mem_type} (dev {self.dev_id}) failed: "
                f"{type(e).__name__}: {e}; spans must be {self.mem_type} memory not registered before"
            ) from e

    def peer_info(self) -> PeerInfo:
        self._check_open("peer_info")
        with self.lock:
            if self.agent is None:  # started again by restart() (the flow's transfer thread), not here
                raise TransportError(f"the NIXL agent is down since a reset ({self._down}); no descriptor yet")
            md = bytes(self.agent.get_agent_metadata())
        return PeerInfo(engine=self.name, name=self.agent_name, host=self.config.host, metadata=md,
                        spans=tuple(self._spans), speaks=self.speaks())

    def speaks(self) -> tuple[str, ...]:
        return tuple(self.config.nixl_backends)

    def connect(self, peer: PeerInfo) -> str:
        self._check_open("connect")
        self._check_engine(peer)
        if not peer.metadata:
            raise PeerUnreachable(f"PeerInfo for {peer.name!r} has no NIXL metadata; send the peer's peer_info()")
        named = metadata_agent(peer.metadata)
        if named != peer.name:  # checked before NIXL parses anything: a loaded peer's entry is never touched
            raise PeerUnreachable(
                f"NIXL metadata from {peer.name!r} at {peer.host} names agent {named!r}; a peer sends its own "
                f"metadata (peer_info()), refused"
            )
        with self.lock:
            if peer.name in self._peer_spans:  # a restarted peer: load its new metadata afresh
                self._forget(peer.name)
            agent = self._live(wait_s=RESTART_WAIT_S)
            try:
                loaded = agent.add_remote_agent(peer.metadata)
            except Exception as e:
                raise PeerUnreachable(
                    f"NIXL could not load agent {peer.name!r} at {peer.host} ({type(e).__name__}: {e}); "
                    f"is its process running and reachable from {self.config.host}?"
                ) from e
        name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        self._peer_spans[name] = list(peer.spans) if peer.spans else None
        self._peer_metadata[name] = peer.metadata
        return name

    # -- transfers ----------------------------------------------------------------------------------------
    def submit(self, peer: str, op: Op, plan: CopyPlan, notify: bytes | None = None) -> Transfer:
        self._check_open("submit")
        op = check_op(op)
        if peer not in self._peer_spans:
            raise PeerUnreachable(f"NIXL peer {peer!r} is not connected; call connect(peer_info) first")
        if peer in self._unloaded:
            self._reload(peer)
        check_plan(op, plan, self._spans, self._peer_spans[peer], peer)
        with self.lock:
            self._check_open("submit")  # close() may have run since the check above
            job = Job.split(self.config, self.engine_limit, peer, op, plan, notify)
            agent, memory = self._live(), (self.mem_type, self.dev_id)
            prepared = self._prep.plan(agent, peer, local_remote(op, plan), plan.length,
                                       (self._spans, self._peer_spans[peer]), memory)
            transfer = NixlTransfer(agent, self.lock, memory, self.config, job, prepared, self._prep.stats)
            # kept while unfinished, or unsettled (its handle is freed at the reset that fences it, under the lock)
            self._transfers = [t for t in self._transfers if not t.finished or not t.settled] + [transfer]
            transfer.start()
            self.submitted.add(plan)
        return transfer

    def raw_move(self, peer: str, op: Op, plan: CopyPlan) -> None:
        """The engine's own batch call: one NIXL request for the whole plan (descriptors on device 0), polled
        until DONE, without kvplane's chunking, checks or retries; the bench's baseline."""
        local, remote = local_remote(op, plan)
        with self.lock:
            agent = self._live()
            ldesc = agent.get_xfer_descs(descriptor_table(local, plan.length, 0), self.mem_type)
            rdesc = agent.get_xfer_descs(descriptor_table(remote, plan.length, 0), self.mem_type)
            handle = agent.initialize_xfer(op, ldesc, rdesc, peer)
            state = agent.transfer(handle)
        deadline = time.monotonic() + RAW_WAIT_S
        while state != "DONE":
            if state == "ERR" or time.monotonic() > deadline:
                raise TransferTimeout(f"raw nixl transfer ended in state {state!r}")
            with self.lock:
                state = agent.check_xfer_state(handle)
        with self.lock:
            agent.release_xfer_handle(handle)

    def notifications(self) -> list[tuple[str, bytes]]:
        self._check_open("notifications")
        with self.lock:
            if self.agent is None:  # down since a reset: nothing can have arrived
                return []
            notes: dict[str, list[bytes]] = self.agent.get_new_notifs()
        return [(str(sender), bytes(msg)) for sender, msgs in notes.items() for msg in msgs]

    def close(self) -> None:
        with self.lock:
            if self._closed:
                return
            self._closed = True
            for transfer in self._transfers:
                transfer.abandon()
            self._transfers = []
            self._prep.drop_all()
            for peer in list(self._peer_spans):
                self._forget(peer)
            for reg in self._regs if self.agent is not None else []:
                try:
                    self.agent.deregister_memory(reg)
                except Exception:  # close() must finish: the agent's destructor releases what is left
                    pass
            self._regs, self._spans = [], []
            self.agent = None  # drops the agent: UCX workers and ports close with it

    def reset(self) -> None:
        self._check_open("reset")
        with self.lock:
            for transfer in self._transfers:
                transfer.abandon()
            self._transfers = []
            self._prep.drop_all()  # the lists hold the agent: they go first
            self._drop_agent()
            self._old = None
            self.generation += 1
            self._regs, self._down = [], "reset"
            self._restarts.clear()
            self.restart()  # the fence holds whether or not it starts now; else it starts again on a later call

    def _drop_agent(self) -> None:
        """Destroy the agent, and confirm it: its destructor closes the UCX workers and their connections, so
        nothing it queued can land once it is gone. Raises when something still holds it."""
        if self.agent is not None:
            self._old = weakref.ref(self.agent)
        self.agent, self._regs = None, []
        gc.collect()
        if self._old is not None and self._old() is not None:
            raise TransportError(f"NIXL agent {self.agent_name!r} is still referenced after a reset; its queued "
                                 f"transfers could still land (a kvplane bug)")

    def _running(self) -> Any:
        with self.lock:
            return None if self._closed else self._live()  # closed under the lock since restart() looked

    def _live(self, wait_s: float = 0.0) -> Any:
        """The agent; after a reset whose restart failed (UCX finds no usable device while a link is down),
        start it again, at most once per back-off, on the same memory and peers; waiting up to ``wait_s`` for
        a due retry (``connect`` runs on a probe thread: a link just back up gets its device a moment later).
        Under ``self.lock``."""
        until = time.monotonic() + wait_s
        while True:
            try:
                return self._start_again()
            except TransportError:
                if self._restarts.retry_at > until:
                    raise
                time.sleep(max(0.0, self._restarts.retry_at - time.monotonic()))

    def _start_again(self) -> Any:
        if self.agent is not None:
            return self.agent
        self._restarts.check_due(f"the NIXL agent is down since a reset ({self._down})")
        try:
            agent = self._start_agent()
            self.agent = agent
            self._regs = [self._register(spans) for spans in self._registered]
        except TransportError as e:
            self.agent, self._down = None, str(e)
            self._restarts.failed()
            logger.warning("NIXL agent %s did not start again after a reset (%s); retried with back-off",
                           self.agent_name, e)
            raise
        self._unloaded = set(self._peer_metadata)
        for name in list(self._unloaded):
            try:
                self._reload(name)
            except PeerUnreachable:  # loaded again on its next transfer, or replaced by its next handshake
                pass
        self._down = ""
        self._restarts.clear()
        self.generation += 1
        logger.warning("NIXL agent %s started again after a reset; %d of %d peers loaded again (the others on "
                       "their next transfer or handshake)", self.agent_name,
                       len(self._peer_metadata) - len(self._unloaded), len(self._peer_metadata))
        return agent

    def _reload(self, peer: str) -> None:
        """Load a connected peer's metadata into an agent started after a reset. Under ``self.lock``."""
        try:
            self._live().add_remote_agent(self._peer_metadata[peer])
        except Exception as e:
            raise PeerUnreachable(
                f"NIXL peer {peer!r} could not be loaded again after a reset ({type(e).__name__}: {e}); it is "
                f"retried on the next transfer, and its next handshake replaces it"
            ) from e
        self._unloaded.discard(peer)

    def _forget(self, peer: str) -> None:
        self._prep.drop(peer)  # before the remote agent its list names is removed
        self._peer_spans.pop(peer, None)
        self._peer_metadata.pop(peer, None)
        if peer in self._unloaded:  # the restarted agent never loaded it: nothing to remove
            self._unloaded.discard(peer)
            return
        if self.agent is None:
            return
        try:
            self.agent.remove_remote_agent(peer)
        except Exception:  # already invalidated (the peer disconnected)
            pass
