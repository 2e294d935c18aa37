"""Word from a prefill rank reaches only the decode request it is about, and only for the rank it came from.

``DecodeSide`` routes a ``PushResult`` or ``Problem`` by (prefill engine, prefill request id). Two faults the
review of the request machines found, each seen failing before its fix:
- a second decode request naming the same prefill request (a proxy retry, params forwarded twice) took the
  routing entry over, so the first request's ``PushResult`` completed the second, whose blocks were never
  written;
- the rank a message names was believed whatever connection it came on, so prefill rank 0 could end rank 1's
  write while rank 1's WRITE still landed.
The sides here are built without sockets (``DecodeSide.__new__``): only the routing is under test.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np

from kvplane.flows.disagg.decode.declines import PendingDeclines
from kvplane.flows.disagg.decode.decode_link import Link, LinkPhase
from kvplane.flows.disagg.decode.decode_request import DecodeRequest, Ident, Phase
from kvplane.flows.disagg.decode.decode_side import DecodeSide
from kvplane.flows.disagg.decode.records import Conn, Want
from kvplane.flows.disagg.wire.messages import PushResult
from kvplane.flows.disagg.wire.published import Published


def _side(conns: list[Conn]) -> Any:
    side: Any = DecodeSide.__new__(DecodeSide)
    side.config = SimpleNamespace(rank=0, mode="push")
    side.spec = None  # read only for requests that hold tokens already (Want.split)
    side.counters = SimpleNamespace(rejected=0)
    side._out = Published()
    side.local = SimpleNamespace(arena=None, handshake=lambda: None, generation=0,
                                 transport=SimpleNamespace(generation=0))

    def start(want: Want) -> set[int]:
        return set(range(want.params.tp_size))  # the ranks a push registered with, as Starter.start returns

    side._starter = SimpleNamespace(start=start, relayout=lambda want: None)
    side._conns = {(c.host, c.port): c for c in conns}
    side._wants, side._by_remote = {}, {}
    side._declines = PendingDeclines(60.0)  # dfix3: _add takes back a kept Cancel for the request it receives
    return side


def _conn(rank: int) -> Conn:
    link = Link(5.0)
    link.phase, link.generation = LinkPhase.READY, 0  # handshaken with the engine as it is: the test starts there
    return Conn("127.0.0.1", 5600 + rank, rank, SimpleNamespace(), link,  # type: ignore[arg-type]
                record=SimpleNamespace(engine_id="prefill-E", boot_id="b"))  # type: ignore[arg-type]


def _reported(side: Any) -> list[tuple[str, str]]:
    side._out.publish(0)  # as the loop does after each pass
    return [(c.request_id, c.state) for c in side._out.drain()]


def _want(rid: str, tp: int) -> Want:
    params: Any = SimpleNamespace(remote_engine_id="prefill-E", remote_request_id="p1", remote_host="127.0.0.1",
                                  remote_port=5600, tp_size=tp, remote_boot_id="b")
    ident = Ident(rid, "push", "p1", "prefill-E", "b", "tok", tp, "decode-D", 0, 1, 5.0)
    return Want(rid, params, {0: np.arange(4)}, {}, 64, "push", DecodeRequest(ident, 1e18))


def test_a_second_request_naming_the_same_prefill_request_fails_at_once_and_leaves_the_first_alone() -> None:
    conn = _conn(0)
    side = _side([conn])
    x, y = _want("x", 1), _want("y", 1)
    side._add(x)
    side._add(y)
    assert x.machine.phase is Phase.MOVE
    side._out.publish(0)
    out = side._out.drain()
    assert [(c.request_id, c.state) for c in out] == [("y", "failed")]
    assert "already being received by request 'x'" in out[0].reason
    side._dispatch(conn, PushResult("p1", 0, True))  # x's WRITE ended
    assert _reported(side) == [("x", "done")]


def test_a_push_result_naming_another_rank_than_its_connections_does_not_end_that_ranks_write() -> None:
    conns = [_conn(0), _conn(1)]
    side = _side(conns)
    want = _want("x", 2)
    side._add(want)
    assert want.machine.phase is Phase.MOVE
    side._dispatch(conns[0], PushResult("p1", 1, True))  # rank 0 speaking for rank 1
    side._dispatch(conns[0], PushResult("p1", 0, True))
    assert want.machine.phase is Phase.MOVE and not _reported(side)
    side._dispatch(conns[1], PushResult("p1", 1, True))
    assert _reported(side) == [("x", "done")]
