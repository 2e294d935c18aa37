"""How kvplane starts a NIXL agent: NIXL's progress thread on, sleeping between events instead of spinning.

NIXL's Python API (``nixl_agent.__init__`` in ``nixl_cu12/_api.py``, 1.5.1) always sets the agent's
``pthrDelay`` to 0. The UCX backend's progress thread waits for its workers' event fds with ``poll()`` and that
delay as the timeout (rounded up to whole milliseconds; the timeout is NIXL's guard against an event UCX fails to
signal), so at 0 it never sleeps: each agent kept a core 60-100% busy while idle. ``nixl_agent_config`` offers
only ``enable_prog_thread`` for it. Without the thread a request moves only while someone progresses the worker:
``check_xfer_state`` does on the side that posted it, but a peer that only serves (a prefill rank a decode rank
READs from) calls nothing, and a READ from it never finished (UCX's connection set-up needs both sides).

So the agent is made as ``nixl_agent`` makes it, then its native agent is replaced by one whose config has the
progress thread on and ``pthrDelay`` set, and the backends are started on that one: the thread sleeps in
``poll()`` until UCX signals work or the delay passes. ``KVPLANE_NIXL_PROGRESS_DELAY_US`` sets the delay
(default 10,000 µs: under 1% of a core while idle); ``0`` keeps NIXL's own spinning thread. A NIXL package
whose bindings lack what this needs gets NIXL's own agent, with a warning.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

from kvplane.errors import TransportError

DELAY_ENV = "KVPLANE_NIXL_PROGRESS_DELAY_US"
DEFAULT_DELAY_US = 10_000
MAX_DELAY_US = 1_000_000  # NIXL's guard against a missed event: a longer one could stall a transfer that long
LISTEN_DELAY_US = 100_000  # what nixl_agent sets (the listener thread stays off)
logger = logging.getLogger("kvplane.transports")


def progress_delay_us(env: Mapping[str, str] | None = None) -> int:
    """The progress thread's delay from ``KVPLANE_NIXL_PROGRESS_DELAY_US`` (µs; 0: NIXL's spinning thread)."""
    raw = (os.environ if env is None else env).get(DELAY_ENV, "").strip()
    if not raw:
        return DEFAULT_DELAY_US
    if not raw.isdigit() or int(raw) > MAX_DELAY_US:
        raise TransportError(f"${DELAY_ENV}={raw!r} is not a delay in µs from 0 to {MAX_DELAY_US}; the default "
                             f"is {DEFAULT_DELAY_US} (0 keeps NIXL's own progress thread, which never sleeps)")
    return int(raw)


def agent_config(bindings: Any, delay_us: int) -> Any:
    """The native agent config kvplane starts agents with: progress thread on, sleeping up to ``delay_us``
    between events; no listener thread, and the thread sync mode ``nixl_agent`` picks without one."""
    config = bindings.nixlAgentConfig()
    config.useProgThread = True
    config.pthrDelay = delay_us
    config.useListenThread = False
    config.lthrDelay = LISTEN_DELAY_US
    config.syncMode = bindings.NIXL_THREAD_SYNC_NONE
    config.captureTelemetry = False
    return config


def _bindings(module: str) -> Any | None:
    """The package's native bindings, or None where they lack the agent config fields this module sets."""
    try:
        bindings = importlib.import_module(f"{module}._bindings")
        fields = dir(bindings.nixlAgentConfig)
        if all(hasattr(bindings, n) for n in ("nixlAgent", "NIXL_THREAD_SYNC_NONE")) and "pthrDelay" in fields:
            return bindings
    except Exception:  # ImportError, or a binding that changed shape
        pass
    return None


def start_agent(nixl: Any, module: str, name: str, backends: Sequence[str], delay_us: int) -> Any:
    """A ``nixl_agent`` named ``name`` with ``backends`` started (a missing plugin is skipped, as NIXL does),
    whose progress thread sleeps up to ``delay_us`` between events (0: NIXL's own agent)."""
    bindings = _bindings(module) if delay_us else None
    if bindings is None:
        if delay_us:
            logger.warning("%s lacks the agent config kvplane sets; NIXL's progress thread will spin (set $%s=0 "
                           "to silence this)", module, DELAY_ENV)
        return nixl.nixl_agent(name, nixl.nixl_agent_config(backends=list(backends)))
    agent = nixl.nixl_agent(name, nixl.nixl_agent_config(enable_prog_thread=False, backends=[]))
    agent.agent = None  # the backend-less native agent goes before the one that replaces it starts
    agent.agent = bindings.nixlAgent(name, agent_config(bindings, delay_us))
    for backend in backends:
        if backend in agent.get_plugin_list():
            agent.create_backend(backend, {})
    return agent
