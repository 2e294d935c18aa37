"""The store tier: Mooncake Store (``MooncakeDistributedStore``) behind calls that are always bounded.

The offload engine puts whole host blocks under their prefix keys (``keys.py``) and gets them back into host
blocks; both go straight from and into the registered host pool (``batch_put_from`` / ``batch_get_into``).

A store that stops answering must never fail or hang a request. Every Mooncake call runs on one of three daemon
executors (``kvplane/runtime``: puts on one, gets on another, setup, existence checks and ``close`` on the third),
so a lookup never queues behind bulk I/O and a get, which a load waits for, never queues behind puts, which
nobody waits for (a get behind a burst of write-through puts used to run out its bound and turn a healthy store
off), and the caller waits at most ``timeout_s`` plus the call's bytes at ``min_gbps``. The client's health is a value, not a call: a monitor thread asks ``health_check`` every
``health_interval_s`` and keeps the answer (``StoreTier.healthy``; a thread of its own, a timer rather than a queue
of calls, so it keeps reporting while a call hangs on the query executor), so a lookup made under the connector's
worker lock reads it without waiting. A call past its bound, a client that reports itself unhealthy, a call
answered with ``RPC_FAIL`` or ``RPC_TIMEOUT`` (the real client keeps reporting healthy for about a second after its master dies), or a
setup that does not finish (against a dead master ``setup`` itself takes about 90 s, holding the GIL: so it is
called only once the master accepts a TCP connection and a probe client in a child process set up against it,
and tried again every ``retry_after_s`` until then) turns the
tier off with one warning; once ``retry_after_s`` has passed and the monitor reports the client healthy, the next call turns it back
on. A call that timed out may still be running: the caller keeps the host blocks it reads or writes pinned until
its future completes (``StoreWrite.done``), so a late transfer never sees a reused block. Puts the store refuses
(a full segment) are counted in ``refused`` and logged once per stretch, not once each.
"""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import numpy as np

from kvplane.flows.offload.config import StoreConfig
from kvplane.flows.offload.errors import OffloadConfigError, StoreError
from kvplane.logs import quiet_engine_logs
from kvplane.metrics import recorder
from kvplane.runtime import Executor

logger = logging.getLogger("kvplane.offload.store")

T = TypeVar("T")
# Mooncake's ErrorCode values the tier tells apart (mooncake-store types.h; seen from the 0.3.13 wheel here)
NO_AVAILABLE_HANDLE = -200  # put: no segment has room for the object; the block stays host-only
INVALID_PARAMS = -600  # get: the destination is smaller than the object
OBJECT_NOT_FOUND = -704  # get: a key the store does not hold; a miss, not a failure
RPC_FAIL = -900  # any call: the master did not answer (killed, restarting, network down)
RPC_TIMEOUT = -901  # any call: the master took the connection but did not answer in time (stopped, overloaded)
UNANSWERED = frozenset({RPC_FAIL, RPC_TIMEOUT})  # either turns the tier off: the master does not answer
MASTER_UNREACHABLE = -10_000  # kvplane's own: setup was not tried, the master accepts no connection
MIN_SEGMENT_BYTES = 16 << 20  # the real client refuses a smaller segment (setup -600, "Total size must be at least")
REFUSAL_LOG_EVERY_S = 60.0  # while puts keep being refused, one summary line per this many seconds
PROBE_FRESH_S = 30.0  # a master that answered a probe this recently is set up against without another probe
_answered: dict[str, float] = {}  # master address -> when it last answered a probe (time.monotonic())
# the probe: a real client in a child process sets up against the master (no segment of its own) and exits; a
# master that takes the connection and never answers freezes that child, not this process
_PROBE = (
    "import os, sys\n"
    "from mooncake.store import MooncakeDistributedStore\n"
    "c = MooncakeDistributedStore()\n"
    "rc = c.setup(sys.argv[1], 'P2PHANDSHAKE', 0, 1 << 20, 'tcp', '', sys.argv[2])\n"
    "os._exit(0 if rc == 0 else 3)  # no close: it lent nothing, and closing costs the wait a probe saves\n"
)
_PARKED = threading.Event()  # never set: abandoned clients wait on it with the daemon threads that hold them


def _hold(client: Any) -> None:
    _PARKED.wait()


def _abandon(client: Any) -> None:
    """Keep an unreachable client referenced without ever destroying it: its destructor retries the dead master
    for seconds (seen: about 5 s per client, at interpreter exit too). A daemon thread's frame is not freed at
    exit, so a process with an abandoned client still ends at once."""
    threading.Thread(target=_hold, args=(client,), name="kvplane-store-abandoned", daemon=True).start()


@dataclass
class StoreWrite:
    """A put in flight: the host blocks it reads stay pinned until ``future`` is done, even past ``deadline``."""

    future: Future[list[int]]
    deadline: float
    group: int
    host_ids: Any  # numpy int64 ids, released by the engine once done
    nbytes: int


def _load_client_class() -> Any:
    quiet_engine_logs()
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as e:
        raise StoreError(
            f"the store tier needs Mooncake Store, which does not import here ({e}); install "
            f"`mooncake-transfer-engine-non-cuda` (CPU) or `mooncake-transfer-engine` (CUDA), never both, or "
            f"run without OffloadConfig.store"
        ) from e
    return MooncakeDistributedStore


def check_segment(config: StoreConfig) -> None:
    """Raise when Mooncake would refuse ``segment_bytes`` at setup (it says so only in its own log, -600)."""
    if 0 < config.segment_bytes < MIN_SEGMENT_BYTES:
        raise OffloadConfigError(
            f"StoreConfig.segment_bytes={config.segment_bytes} is under the {MIN_SEGMENT_BYTES} B (16 MiB) Mooncake "
            f"Store takes for a segment (its setup fails with -600); give at least 16 MiB, or 0 to lend no memory "
            f"and use the segments other clients lend"
        )


class StoreTier:
    def __init__(self, config: StoreConfig, client: Any = None) -> None:
        check_segment(config)
        self.config = config
        self._client = client if client is not None else _load_client_class()()
        self._io = Executor("kvplane-store-io")  # puts, in order
        self._gets = Executor("kvplane-store-get")  # gets: a load waits for them, never behind a put
        self._query = Executor("kvplane-store-query")  # setup, existence checks: never queued behind bulk I/O
        self._buffers: list[tuple[int, int]] = []
        self._put_tail = 0.0  # the deadline of the last put queued (put_deadline)
        self._done: set[tuple[int, int]] = set()  # buffers the client took: the real one refuses a second time
        self._registered = False
        self._register_lock = threading.Lock()
        self._registering: dict[tuple[int, int], Future[int]] = {}  # each buffer's last register_buffer call
        self._down_reason: str | None = None
        self._retry_at = 0.0
        self._health: tuple[bool, str] = (True, "")  # (healthy, why not): written by the monitor thread only
        self._stop = threading.Event()
        self.degradations = 0  # how many times the tier turned itself off (reports and tests)
        # puts the store refused, by Mooncake return code (NO_AVAILABLE_HANDLE: no segment had room), since start
        self.refused: Counter[int] = Counter()
        self.refusal_log_every_s = REFUSAL_LOG_EVERY_S
        self._refusing_since: float | None = None  # the first refusal of the stretch now running
        self._refusal_logged_at = self._last_refusal = 0.0
        self._refused_unlogged: Counter[int] = Counter()  # refused since the stretch's last line
        self._refused_in_stretch = 0
        # the real binding's setup holds the GIL until it gives up on a master that does not answer (about 90 s):
        # no timeout can cut it short, the whole process stands still. So a master that does not accept a TCP
        # connection is never set up against; such a setup is tried again (on the query executor, waited on by
        # nobody) each time retry_after_s has passed. An injected client (tests) is set up as it is.
        self._probe = client is None
        self._setup_called = False  # setup was called on the client: never again on the same client
        self._setup_lock = threading.Lock()
        self._next_setup = 0.0  # when a setup that never reached the client may be tried again
        self._unreachable = ""  # why the last setup was not tried
        c = config
        self._setup: Future[int] = self._query.submit(self._run_setup, "setup")
        try:
            rc = self._setup.result(c.setup_timeout_s)
        except FutureTimeout:
            self._degrade(f"setup with master {c.master_address} did not finish in {c.setup_timeout_s} s")
        except Exception as e:  # a binding error is as good as unreachable: the host tier carries on
            self._degrade(f"setup with master {c.master_address} raised {e!r}")
        else:
            if rc == MASTER_UNREACHABLE:
                self._degrade(self._unreachable)
            elif rc != 0:
                self._degrade(f"setup with master {c.master_address} returned {rc}")
        threading.Thread(target=self._monitor, name="kvplane-store-health", daemon=True).start()

    @property
    def client(self) -> Any:
        """The ``MooncakeDistributedStore`` this tier drives (the bench calls it directly as its baseline)."""
        return self._client

    # -- health -------------------------------------------------------------------------------------------
    @property
    def healthy(self) -> bool:
        """The client's health as the monitor thread last saw it. Never blocks, never calls the client."""
        return self._health[0]

    def refresh_health(self) -> bool:
        """Ask the client now (blocking: the monitor thread runs it every ``health_interval_s``)."""
        if not self._setup_ok():
            self._health = (False, "setup has not succeeded")
        else:
            try:
                ok = int(self._client.health_check()) == 0
                self._health = (ok, "" if ok else "the client reports the master unreachable (health_check != 0)")
            except Exception as e:
                self._health = (False, f"health_check raised {e!r}")
        return self._health[0]

    def _monitor(self) -> None:
        while not self._stop.is_set():
            self.refresh_health()
            self._stop.wait(self.config.health_interval_s)

    def _run_setup(self) -> int:
        c = self.config
        if self._probe:
            host, _, port = c.master_address.rpartition(":")
            try:
                socket.create_connection((host, int(port)), timeout=c.setup_timeout_s).close()
            except OSError as e:
                self._unreachable = (
                    f"mooncake_master at StoreConfig.master_address={c.master_address!r} does not accept connections "
                    f"({e}); start it there or fix the address (setup is tried again every {c.retry_after_s:g} s)"
                )
                return MASTER_UNREACHABLE
            silent = self._probe_master()
            if silent:
                self._unreachable = silent
                return MASTER_UNREACHABLE
        self._setup_called = True
        return int(self._client.setup(c.local_hostname, c.metadata_server, c.segment_bytes, c.local_buffer_bytes,
                                      c.protocol, c.device_name, c.master_address))

    def _probe_master(self) -> str:
        """Why the master cannot be set up against, or "" when a real client's setup in a child process finished
        against it within ``setup_timeout_s`` (or one did less than ``PROBE_FRESH_S`` ago). The binding's setup
        holds the GIL until the master answers: against a master that takes the connection and never answers
        (stopped, wedged), it would freeze this whole process for about 90 s."""
        c = self.config
        if time.monotonic() - _answered.get(c.master_address, -PROBE_FRESH_S) < PROBE_FRESH_S:
            return ""
        try:
            child = subprocess.Popen([sys.executable, "-c", _PROBE, c.local_hostname, c.master_address],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        except OSError as e:  # no interpreter to run it (an embedded Python): set up unprobed, as before the probe
            logger.warning("cannot start the probe of mooncake_master at %s with sys.executable=%r (%s); setting up "
                           "without it (a master that never answers would freeze this process)", c.master_address,
                           sys.executable, e)
            return ""
        try:
            rc = child.wait(c.setup_timeout_s / 2)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
            return (f"mooncake_master at StoreConfig.master_address={c.master_address!r} accepts connections but a "
                    f"client's setup got no answer in {c.setup_timeout_s / 2:g} s (half of StoreConfig.setup_timeout_s="
                    f"{c.setup_timeout_s:g}); check that the process there is a live mooncake_master (setup is tried "
                    f"again every {c.retry_after_s:g} s)")
        if rc != 0:
            return (f"a probe client's setup against mooncake_master at StoreConfig.master_address="
                    f"{c.master_address!r} failed (exit code {rc}); check the master's log and that this host can "
                    f"reach it (setup is tried again every {c.retry_after_s:g} s)")
        _answered[c.master_address] = time.monotonic()
        return ""

    def _setup_ok(self) -> bool:
        return self._setup.done() and self._setup.exception() is None and self._setup.result() == 0

    def _retry_setup(self) -> None:
        """Try a setup that never reached the client again, in the background (``up`` turns the tier on once the
        monitor sees the client healthy)."""
        with self._setup_lock:
            now = time.monotonic()
            if (self._setup.done() and not self._setup_called and not self._setup_ok() and not self._stop.is_set()
                    and now >= self._next_setup):
                self._next_setup = now + self.config.retry_after_s
                self._setup = self._query.submit(self._run_setup, "setup")
                self._setup.add_done_callback(lambda _: self.refresh_health())  # on at the next call, not a tick later

    @property
    def up(self) -> bool:
        """Whether store calls are being made now: reads the monitored health (no call to the client) and
        turns the tier back on once ``retry_after_s`` has passed and the client is healthy again."""
        if self._down_reason is not None and (time.monotonic() < self._retry_at or not self._setup_ok()):
            if time.monotonic() >= self._retry_at:
                self._retry_setup()
            return False
        healthy, reason = self._health
        if not healthy:
            self._degrade(reason)
            return False
        if self._down_reason is not None:
            logger.warning("Mooncake store at %s is back; using the store tier again", self.config.master_address)
            self._down_reason = None
        if not self._registered:
            self._register()
        return self._down_reason is None

    def _degrade(self, reason: str) -> None:
        self._retry_at = time.monotonic() + self.config.retry_after_s
        if self._down_reason is None:
            self.degradations += 1
            logger.warning(
                "Mooncake store at %s is unavailable (%s); continuing with the host tier only, retrying in %.0f s",
                self.config.master_address, reason, self.config.retry_after_s,
            )
        self._down_reason = reason

    def bound(self, nbytes: int) -> float:
        """Seconds a call moving ``nbytes`` may run: ``timeout_s`` plus the bytes at ``min_gbps``."""
        return self.config.timeout_s + nbytes / (self.config.min_gbps * 1e9)

    def _wait(self, future: Future[T], what: str, nbytes: int = 0) -> T | None:
        """The call's result, or None after degrading when it failed or ran past its bound."""
        bound = self.bound(nbytes)
        try:
            return future.result(bound)
        except FutureTimeout:
            self._degrade(f"{what} did not finish in {bound:.1f} s")
        except Exception as e:
            self._degrade(f"{what} raised {e!r}")
        return None

    # -- memory -------------------------------------------------------------------------------------------
    def register(self, ptr: int, nbytes: int) -> None:
        """Register host memory that puts read and gets write (the host pool); done again after a late setup."""
        self._buffers.append((ptr, nbytes))
        self._registered = False
        if self._down_reason is None:
            self._register()

    def _register(self) -> None:
        with self._register_lock:  # the lookup thread (exists) and the worker's may both find it unregistered
            for ptr, nbytes in self._buffers:
                if (ptr, nbytes) in self._done:  # registering it again is refused (-600, overlapped memory region)
                    continue
                late = self._registering.get((ptr, nbytes))
                if late is not None and not late.done():
                    return  # an earlier call outlived its bound and still runs: registered once it returns
                if late is not None and late.exception() is None and late.result() == 0:
                    self._done.add((ptr, nbytes))  # it returned after its bound: registered, never again
                    continue
                call = self._query.submit(partial(self._client.register_buffer, ptr, nbytes), "register_buffer")
                self._registering[(ptr, nbytes)] = call
                rc = self._wait(call, "register_buffer")
                if rc != 0:
                    if rc is not None:
                        self._degrade(f"register_buffer of {nbytes} B returned {rc}")
                    return
                self._done.add((ptr, nbytes))
            self._registered = True

    # -- calls --------------------------------------------------------------------------------------------
    def count_prefix(self, keys: Sequence[str]) -> int:
        """How many leading ``keys`` the store holds; 0 when it is down or does not answer in time."""
        found = self.exists(keys)
        return 0 if found is None else leading(found)

    def exists(self, keys: Sequence[str]) -> list[bool] | None:
        """Which ``keys`` the store holds, in one call; None when it is down or does not answer in time. Safe to
        call from any thread (the engine's lookup thread calls it outside the worker's lock)."""
        if not keys or not self.up:
            return None
        exist = self._query.submit(lambda: list(self._client.batch_is_exist(list(keys))), "batch_is_exist")
        found = self._wait(exist, "batch_is_exist")
        if found is None:
            return None
        if found and all(int(f) < 0 for f in found):
            self._degrade(f"batch_is_exist returned errors {sorted(set(found))[:3]}")
            return None
        return [int(f) == 1 for f in found]

    def put(self, keys: Sequence[str], addrs: Sequence[int], sizes: Sequence[int]) -> Future[list[int]] | None:
        """Start putting host ranges under ``keys``; None when the store is down (nothing was started)."""
        if not keys or not self.up:
            return None
        k, a, s = list(keys), [int(x) for x in addrs], [int(x) for x in sizes]
        put = partial(self._client.batch_put_from, k, a, s)
        return self._io.submit(recorder().store_call("write", s, lambda: [int(rc) for rc in put()]), "batch_put_from")

    def put_deadline(self, nbytes: int) -> float:
        """When a put submitted now must be done: its own bound, after the bounds of the puts queued before it
        (they run one at a time), so a put is never reported late for the time it spent waiting its turn."""
        self._put_tail = max(time.monotonic(), self._put_tail) + self.bound(nbytes)
        return self._put_tail

    def check_put(self, write: StoreWrite) -> bool:
        """True once ``write`` is done (its pins may go); degrades when it runs past its deadline or failed."""
        if not write.future.done():
            if time.monotonic() > write.deadline:
                self._degrade(f"a put of {write.nbytes} B did not finish in time")
                write.deadline = float("inf")  # warn once per write
            return False
        error = write.future.exception()
        if error is not None:
            self._degrade(f"batch_put_from raised {error!r}")
        elif lost := sorted({rc for rc in write.future.result() if rc in UNANSWERED}):
            self._degrade(f"batch_put_from returned {lost} (RPC_FAIL {RPC_FAIL}, RPC_TIMEOUT {RPC_TIMEOUT}): the "
                          f"master does not answer")
        else:
            self._note_refusals(write.future.result())
        return True

    def _hint(self, refused: Counter[int]) -> str:
        if NO_AVAILABLE_HANDLE in refused:
            return (f"{NO_AVAILABLE_HANDLE} means no segment has room: raise StoreConfig.segment_bytes="
                    f"{self.config.segment_bytes} or start more clients that lend memory")
        return "see Mooncake's log for what the codes mean"

    def _note_refusals(self, codes: Sequence[int]) -> None:
        """Count refused puts and log them once per stretch: its first refusal, then one line per
        ``refusal_log_every_s`` while they go on, and one when a put is taken with none refused for that long.
        A full segment under write-through refuses nearly every put (the master's eviction frees a few objects
        now and then, so taken puts come in between: they do not end the stretch)."""
        refused = Counter(rc for rc in codes if rc < 0)
        now = time.monotonic()
        every = self.refusal_log_every_s
        if not refused:
            if self._refusing_since is not None and codes and now - self._last_refusal >= every:
                logger.warning("Mooncake store at %s takes puts again (none refused for %g s), after refusing %d in "
                               "%.1f s", self.config.master_address, every, self._refused_in_stretch,
                               self._last_refusal - self._refusing_since)
                self._refusing_since = None
            return
        self.refused.update(refused)
        self._last_refusal = now
        if self._refusing_since is None:
            self._refusing_since, self._refusal_logged_at = now, now
            self._refused_in_stretch, self._refused_unlogged = refused.total(), Counter()
            logger.warning(
                "Mooncake store at %s refused %d put(s) (codes %s); those blocks stay host-only. Further refusals "
                "are counted (StoreTier.refused) and logged every %g s until puts are taken again; %s",
                self.config.master_address, refused.total(), _codes(refused), every, self._hint(refused),
            )
            return
        self._refused_in_stretch += refused.total()
        self._refused_unlogged.update(refused)
        if now - self._refusal_logged_at >= every:
            logger.warning("Mooncake store at %s refused %d more put(s) in the last %.0f s (codes %s); %s",
                           self.config.master_address, self._refused_unlogged.total(), now - self._refusal_logged_at,
                           _codes(self._refused_unlogged), self._hint(self._refused_unlogged))
            self._refusal_logged_at, self._refused_unlogged = now, Counter()

    def get(
        self, keys: Sequence[str], addrs: Sequence[int], sizes: Sequence[int]
    ) -> tuple[list[bool], Future[list[int]] | None]:
        """Get ``keys`` into host ranges, waiting at most the bound: per-key success, and the call's future.

        When the call timed out its future is still running: the caller keeps the destination pinned until
        it is done.
        """
        if not keys or not self.up:
            return [False] * len(keys), None
        k, a, s = list(keys), [int(x) for x in addrs], [int(x) for x in sizes]
        get = partial(self._client.batch_get_into, k, a, s)
        future = self._gets.submit(recorder().store_call("read", s, lambda: [int(rc) for rc in get()]),
                                   "batch_get_into")
        got = self._wait(future, "batch_get_into", sum(s))
        if got is None:
            return [False] * len(keys), future
        ok = [rc == size for rc, size in zip(got, s)]
        if UNANSWERED.intersection(got) or (not any(ok) and got and all(rc < 0 and rc != OBJECT_NOT_FOUND for rc in got)):
            self._degrade(f"batch_get_into returned errors {sorted(set(got))[:3]}")
        return ok, future

    def close(self, timeout_s: float = 5.0) -> None:
        """Close the client when it is healthy (bounded); an unreachable one is abandoned, never waited on.
        Queued calls still run (a put's blocks stay pinned until its future is done); nothing waits for them."""
        self._stop.set()
        self._io.close(wait=False)
        self._gets.close(wait=False)
        if self._down_reason is None and self._setup.done():
            closing = self._query.submit(self._client.close, "close")  # after the queries queued before it
            self._query.close(wait=False)
            try:
                closing.result(timeout_s)
                return
            except FutureTimeout:
                pass  # still closing: abandoned below, never waited on again
            except Exception:  # the executor logged it; the client is closed as far as it goes
                return
        self._query.close(wait=False)
        _abandon(self._client)


def _codes(refused: Counter[int]) -> str:
    return ", ".join(f"{rc} x{n}" for rc, n in sorted(refused.items()))


def leading(found: Sequence[bool]) -> int:
    """How many of ``found`` are True before the first False."""
    held = np.asarray(found, dtype=bool)
    return int(held.size if held.all() else held.argmin())
