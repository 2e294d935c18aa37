"""The store tier: Mooncake Store (``MooncakeDistributedStore``) behind calls that are always bounded.

The offload engine (and vLLM's tiering manager through ``integrations/vllm_tier``) puts whole host blocks under
their keys and gets them back, straight from and into registered host memory (``batch_put_from`` /
``batch_get_into``). A store that stops answering must never fail or hang a request. Every Mooncake call runs on
one of three daemon executors (``kvplane/runtime``: puts, gets, and setup, existence checks and ``close``), so a
lookup never queues behind bulk I/O and a get, which a load waits for, never queues behind puts (a get behind a
burst of write-through puts used to run out its bound and turn a healthy store off); a caller waits at most
``timeout_s`` plus the call's bytes at ``min_gbps``, or not at all (``start_get``, ``put``: a future). The
client's health is a value, not a call: a monitor thread of its own asks ``health_check`` every
``health_interval_s`` and keeps the answer (``StoreTier.healthy``), so a lookup under the connector's worker
lock reads it without waiting. A call past its bound, an unhealthy client, a call answered with ``RPC_FAIL`` or
``RPC_TIMEOUT`` (the real client reports healthy for about a second after its master dies), or a setup that does
not finish (against a dead master ``setup`` takes about 90 s holding the GIL: so it is called only once the
master accepts a TCP connection and a probe client in a child process set up against it, and tried again every
``retry_after_s``) turns the tier off with one warning; once ``retry_after_s`` has passed and the monitor reports
the client healthy, the next call turns it back on. A call that timed out may still be running: the caller keeps
the host blocks it reads or writes pinned until its future completes (``StoreWrite``), so a late transfer never
sees a reused block. Puts the store refuses (a full segment) are counted in ``refused`` and logged once per
stretch. What the tier must know about the client apart from its calls (return codes, importing it, the probe,
abandoning it) is in ``store_client.py``; the refusal log in ``store_refusals.py``.
"""

from __future__ import annotations

import logging
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
from kvplane.flows.offload.store_client import (
    INVALID_PARAMS,
    MASTER_UNREACHABLE,
    MIN_SEGMENT_BYTES,
    NO_AVAILABLE_HANDLE,
    OBJECT_NOT_FOUND,
    PROBE_FRESH_S,
    RPC_FAIL,
    RPC_TIMEOUT,
    UNANSWERED,
    _abandon,
    _load_client_class,
    check_segment,
    master_unreachable,
)
from kvplane.flows.offload.store_refusals import REFUSAL_LOG_EVERY_S, RefusalLog
from kvplane.metrics import recorder
from kvplane.runtime import Executor

logger = logging.getLogger("kvplane.offload.store")

__all__ = ["INVALID_PARAMS", "MASTER_UNREACHABLE", "MIN_SEGMENT_BYTES", "NO_AVAILABLE_HANDLE", "OBJECT_NOT_FOUND",
           "PROBE_FRESH_S", "REFUSAL_LOG_EVERY_S", "RPC_FAIL", "RPC_TIMEOUT", "UNANSWERED", "StoreTier", "StoreWrite",
           "check_segment", "leading"]

T = TypeVar("T")
# master address -> when it last answered a probe (time.monotonic()); store_client.probe_master reads and writes it
_answered: dict[str, float] = {}


@dataclass
class StoreWrite:
    """A put or get in flight: the host blocks it reads or writes stay pinned until ``future`` is done."""

    future: Future[list[int]]
    deadline: float
    group: int
    host_ids: Any  # numpy int64 ids, released by the engine once done
    nbytes: int


class StoreTier:
    def __init__(self, config: StoreConfig, client: Any = None) -> None:
        check_segment(config)
        self.config = config
        self._client = client if client is not None else _load_client_class()()
        self._io = Executor("kvplane-store-io")  # puts, in order
        self._gets = Executor("kvplane-store-get")  # gets: a load waits for them, never behind a put
        self._query = Executor("kvplane-store-query")  # setup, existence checks: never queued behind bulk I/O
        self._buffers: list[tuple[int, int]] = []
        self._tails = {"put": 0.0, "get": 0.0}  # the deadline of the last put (get) queued (put_deadline)
        self._done: set[tuple[int, int]] = set()  # buffers the client took: the real one refuses a second time
        self._registered = False
        self._register_lock = threading.Lock()
        self._registering: dict[tuple[int, int], Future[int]] = {}  # each buffer's last register_buffer call
        self._down_reason: str | None = None
        self._retry_at = 0.0
        self._health: tuple[bool, str] = (True, "")  # (healthy, why not): written by the monitor thread only
        self._stop = threading.Event()
        self.degradations = 0  # how many times the tier turned itself off (reports and tests)
        self._refusals = RefusalLog(config)  # puts the store refused (a full segment): counted, logged per stretch
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

    @property
    def refused(self) -> Counter[int]:
        """Puts the store refused, by Mooncake return code (``NO_AVAILABLE_HANDLE``: no segment had room), since
        start."""
        return self._refusals.refused

    @property
    def refusal_log_every_s(self) -> float:
        """While puts keep being refused, one summary line per this many seconds (``REFUSAL_LOG_EVERY_S``)."""
        return self._refusals.every_s

    @refusal_log_every_s.setter
    def refusal_log_every_s(self, seconds: float) -> None:
        self._refusals.every_s = seconds

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
            why = master_unreachable(c, _answered, sys.executable)
            if why:
                self._unreachable = why
                return MASTER_UNREACHABLE
        self._setup_called = True
        return int(self._client.setup(c.local_hostname, c.metadata_server, c.segment_bytes, c.local_buffer_bytes,
                                      c.protocol, c.device_name, c.master_address))

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

    def put(
        self, keys: Sequence[str], addrs: Sequence[int], sizes: Sequence[int], *, missing_only: bool = False
    ) -> Future[list[int]] | None:
        """Start putting host ranges under ``keys``; None when the store is down (nothing was started). With
        ``missing_only`` the call first asks which keys the store holds and moves only the others (those it
        holds answer 0)."""
        if not keys or not self.up:
            return None
        k, a, s = list(keys), [int(x) for x in addrs], [int(x) for x in sizes]
        if missing_only:
            return self._io.submit(partial(self._put_missing, k, a, s), "batch_put_from")
        put = partial(self._client.batch_put_from, k, a, s)
        return self._io.submit(recorder().store_call("write", s, lambda: [int(rc) for rc in put()]), "batch_put_from")

    def _put_missing(self, keys: list[str], addrs: list[int], sizes: list[int]) -> list[int]:
        codes = [0] * len(keys)  # the keys the store holds answer 0
        if todo := [i for i, found in enumerate(self._client.batch_is_exist(keys)) if int(found) != 1]:
            sub = [sizes[i] for i in todo]
            put = partial(self._client.batch_put_from, [keys[i] for i in todo], [addrs[i] for i in todo], sub)
            for i, rc in zip(todo, recorder().store_call("write", sub, lambda: [int(rc) for rc in put()])()):
                codes[i] = rc
        return codes

    def put_deadline(self, nbytes: int, call: str = "put") -> float:
        """When a put (``call="get"``: a get) submitted now must be done: its bound after those of the calls of
        its kind queued before it (they run one at a time), so no call is late for the time it waited its turn."""
        self._tails[call] = max(time.monotonic(), self._tails[call]) + self.bound(nbytes)
        return self._tails[call]

    def check_put(self, write: StoreWrite) -> bool:
        """True once ``write`` is done (its pins may go); degrades when it runs past its deadline or failed."""
        if self._running(write, "put"):
            return False
        error = write.future.exception()
        if error is not None:
            self._degrade(f"batch_put_from raised {error!r}")
        elif lost := sorted({rc for rc in write.future.result() if rc in UNANSWERED}):
            self._degrade(f"batch_put_from returned {lost} (RPC_FAIL {RPC_FAIL}, RPC_TIMEOUT {RPC_TIMEOUT}): the "
                          f"master does not answer")
        else:
            self._refusals.note(write.future.result())
        return True

    def get(
        self, keys: Sequence[str], addrs: Sequence[int], sizes: Sequence[int]
    ) -> tuple[list[bool], Future[list[int]] | None]:
        """Get ``keys`` into host ranges, waiting at most the bound: per-key success, and the call's future (still
        running when the call timed out: the caller keeps the destination pinned until it is done)."""
        future = self.start_get(keys, addrs, sizes)
        if future is None:
            return [False] * len(keys), None
        got = self._wait(future, "batch_get_into", sum(int(x) for x in sizes))
        return ([False] * len(keys) if got is None else self._got(got, sizes)), future

    def start_get(self, keys: Sequence[str], addrs: Sequence[int], sizes: Sequence[int]) -> Future[list[int]] | None:
        """Start getting ``keys`` into host ranges without waiting; None when the store is down (nothing started).
        ``check_get`` reads the result once the future is done."""
        if not keys or not self.up:
            return None
        k, a, s = list(keys), [int(x) for x in addrs], [int(x) for x in sizes]
        get = partial(self._client.batch_get_into, k, a, s)
        return self._gets.submit(recorder().store_call("read", s, lambda: [int(rc) for rc in get()]), "batch_get_into")

    def check_get(self, read: StoreWrite, sizes: Sequence[int]) -> list[bool] | None:
        """Per-key success once the get ``read`` is done, None while it runs (its destination stays pinned);
        degrades when it runs past its deadline, raised, or the master did not answer."""
        if self._running(read, "get"):
            return None
        error = read.future.exception()
        if error is not None:
            self._degrade(f"batch_get_into raised {error!r}")
            return [False] * len(sizes)
        return self._got(read.future.result(), sizes)

    def _running(self, call: StoreWrite, what: str) -> bool:
        """Whether ``call`` still runs; past its deadline that turns the tier off (one warning per call)."""
        if call.future.done():
            return False
        if time.monotonic() > call.deadline:
            self._degrade(f"a {what} of {call.nbytes} B did not finish in time")
            call.deadline = float("inf")
        return True

    def _got(self, got: Sequence[int], sizes: Sequence[int]) -> list[bool]:
        ok = [rc == int(size) for rc, size in zip(got, sizes)]
        if UNANSWERED.intersection(got) or (not any(ok) and got and all(rc < 0 and rc != OBJECT_NOT_FOUND for rc in got)):
            self._degrade(f"batch_get_into returned errors {sorted(set(got))[:3]}")
        return ok

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


def leading(found: Sequence[bool]) -> int:
    """How many of ``found`` are True before the first False."""
    held = np.asarray(found, dtype=bool)
    return int(held.size if held.all() else held.argmin())
