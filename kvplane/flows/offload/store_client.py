"""The Mooncake client beneath the store tier: its return codes, importing it, and the care its setup and close take.

``StoreTier`` (``store.py``) drives one ``MooncakeDistributedStore``; this module holds what it must know about
that client apart from the calls themselves. The codes are the ones the tier tells apart. ``check_segment``
refuses at once the segment Mooncake would refuse only in its own log. The binding's ``setup`` holds the GIL
until a master answers (about 90 s against one that does not), so ``master_unreachable`` first checks that the
master accepts a TCP connection and that a probe client in a child process sets up against it. A client that
cannot be closed is abandoned (``_abandon``), never destroyed: its destructor retries the dead master.
"""

from __future__ import annotations

import logging
import socket
import subprocess
import threading
import time
from typing import Any

from kvplane.flows.offload.config import StoreConfig
from kvplane.flows.offload.errors import OffloadConfigError, StoreError
from kvplane.logs import quiet_engine_logs

logger = logging.getLogger("kvplane.offload.store")

# Mooncake's ErrorCode values the tier tells apart (mooncake-store types.h; seen from the 0.3.13 wheel here)
NO_AVAILABLE_HANDLE = -200  # put: no segment has room for the object; the block stays host-only
INVALID_PARAMS = -600  # get: the destination is smaller than the object
OBJECT_NOT_FOUND = -704  # get: a key the store does not hold; a miss, not a failure
RPC_FAIL = -900  # any call: the master did not answer (killed, restarting, network down)
RPC_TIMEOUT = -901  # any call: the master took the connection but did not answer in time (stopped, overloaded)
UNANSWERED = frozenset({RPC_FAIL, RPC_TIMEOUT})  # either turns the tier off: the master does not answer
MASTER_UNREACHABLE = -10_000  # kvplane's own: setup was not tried, the master accepts no connection
MIN_SEGMENT_BYTES = 16 << 20  # the real client refuses a smaller segment (setup -600, "Total size must be at least")
PROBE_FRESH_S = 30.0  # a master that answered a probe this recently is set up against without another probe
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


def master_unreachable(c: StoreConfig, answered: dict[str, float], python: str) -> str:
    """Why setup must not be tried against the master now, or "" when it may: the master must accept a TCP
    connection, then answer a probe (``probe_master``; ``answered`` and ``python`` go to it)."""
    host, _, port = c.master_address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=c.setup_timeout_s).close()
    except OSError as e:
        return (
            f"mooncake_master at StoreConfig.master_address={c.master_address!r} does not accept connections "
            f"({e}); start it there or fix the address (setup is tried again every {c.retry_after_s:g} s)"
        )
    return probe_master(c, answered, python)


def probe_master(c: StoreConfig, answered: dict[str, float], python: str) -> str:
    """Why the master cannot be set up against, or "" when a real client's setup in a child process (run by the
    interpreter ``python``) finished against it within ``setup_timeout_s`` (or one did less than
    ``PROBE_FRESH_S`` ago: ``answered`` maps a master address to when it last answered, and is updated here).
    The binding's setup holds the GIL until the master answers: against a master that takes the connection and
    never answers (stopped, wedged), it would freeze this whole process for about 90 s."""
    if time.monotonic() - answered.get(c.master_address, -PROBE_FRESH_S) < PROBE_FRESH_S:
        return ""
    try:
        child = subprocess.Popen([python, "-c", _PROBE, c.local_hostname, c.master_address],
                                 stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except OSError as e:  # no interpreter to run it (an embedded Python): set up unprobed, as before the probe
        logger.warning("cannot start the probe of mooncake_master at %s with sys.executable=%r (%s); setting up "
                       "without it (a master that never answers would freeze this process)", c.master_address,
                       python, e)
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
    answered[c.master_address] = time.monotonic()
    return ""
