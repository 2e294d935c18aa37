"""NIXL handles are freed under the transport's lock, whoever drops the last reference to them.

The agent is shared by the caller's threads and the transport's own, and NIXL's Python handles release
themselves in ``__del__`` (``releasedDlistH``, ``releaseXferReq``). A transfer the caller gave up on
(``cancel``) and then let go of must not be where that happens: garbage collection runs on whatever thread
allocates next, outside the lock. Two real agents in this process; every release NIXL's handle classes make is
recorded with whether the transport's lock was held.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvplane.bench.peer import KVBuffer
from kvplane.transports.base import TransportConfig
from tests.integration.test_nixl_prepped import NUM_BLOCKS, Pair, cpu, halves, ids, make_pair, plan_for, spec

pytestmark = pytest.mark.integration


@pytest.fixture
def pair() -> Iterator[Pair]:
    a_kv = KVBuffer(spec(), "packed_kv", NUM_BLOCKS, cpu.alloc_host)
    b_kv = KVBuffer(spec(), "packed_kv", NUM_BLOCKS, cpu.alloc_host)
    p = make_pair(a_kv, b_kv)
    yield p
    p.close()


@pytest.fixture
def releases(pair: Pair, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, bool]]:
    """``(what, lock held)`` for every handle NIXL's Python wrappers free on ``pair.a``'s agent."""
    api = __import__(type(pair.a.agent).__module__, fromlist=["_"])
    seen: list[tuple[str, bool]] = []
    lock = pair.a.lock

    def recorded(original: Callable[[Any], None], what: str) -> Callable[[Any], None]:
        def wrapped(handle: Any) -> None:
            if not handle._released:
                seen.append((what, lock._is_owned()))  # type: ignore[attr-defined]
            original(handle)

        return wrapped

    def recording(cls: type, what: str) -> None:
        for name in ("release", "__del__"):
            monkeypatch.setattr(cls, name, recorded(getattr(cls, name), what))

    recording(api.nixl_prepped_dlist_handle, "dlist")
    recording(api.nixl_xfer_handle, "xfer")
    return seen


def finishing(agent: Any) -> Callable[[Any], str]:
    """NIXL's ``transfer`` as it behaves when UCX completes the request in the calling thread."""
    post = agent.transfer

    def transfer(handle: Any) -> str:
        state = str(post(handle))
        while state == "PROC":
            state = str(agent.check_xfer_state(handle))
        return state

    return transfer


def still_running(agent: Any) -> Callable[[Any], str]:
    """NIXL's ``transfer`` as it behaves when the request is still in flight when the call returns. UCX may finish
    a same-host request inside the call: in one CI run it did so 50 posts in a row, and no request was in flight."""
    post = agent.transfer

    def transfer(handle: Any) -> str:
        state = str(post(handle))
        return "PROC" if state == "DONE" else state

    return transfer


@pytest.mark.parametrize("in_flight", [False, True], ids=["between-requests", "request-in-flight"])
def test_a_cancelled_transfer_the_caller_lets_go_of_frees_its_handles_under_the_lock(
    pair: Pair, releases: list[tuple[str, bool]], in_flight: bool
) -> None:
    transport = pair.a
    transport.config = TransportConfig(timeout_s=30.0, max_batch=4)  # several requests, the first posted in submit
    plan = plan_for(pair, "READ", ids(1), ids(2))
    # the first request ends inside NIXL's transfer call (as same-host UCX copies may), or is still running after it
    transport.agent.transfer = (still_running if in_flight else finishing)(transport.agent)
    transfer = transport.submit(pair.handle, "READ", plan)
    assert (transfer._handle is not None) is in_flight and not transfer.finished  # type: ignore[attr-defined]
    vars(transport.agent).pop("transfer", None)
    transfer.cancel()  # type: ignore[attr-defined]
    assert transfer.settled is not in_flight
    # a plan off the grid replaces the lists: the cancelled transfer holds the only reference to the old ones
    transport.transfer(pair.handle, "READ", halves(plan_for(pair, "READ", ids(3), ids(4))))
    assert transport.prep_stats.preps == 2
    del transfer
    gc.collect()
    transport.close()  # the fence for a request left in flight
    gc.collect()
    assert [what for what, _ in releases].count("dlist") == 4  # both sides of both grids
    assert [r for r in releases if not r[1]] == [], f"freed outside the transport lock: {releases}"
