"""A decode rank's ``ReadDone`` and ``PushRegister`` carry its instance's TP size, and the prefill releases a pull
once that many decode ranks read: so the count must be the one the rank handshook with (its manifest's), not
whatever a message says. A TP-2 decode instance, rank 0 done reading, sends a second ``ReadDone`` claiming
``tp_size=1`` on its own connection: the prefill must keep the blocks for rank 1, which has not read yet (on main
it released the request ``done`` at once, under rank 1's coming READ). Real sides on 127.0.0.1."""

from __future__ import annotations

import uuid

from pair import LONG, make, small_spec

from kvplane.flows.disagg.wire.messages import ReadDone
from kvplane.kv.spec import KVSpec

TOKENS = 40


def test_a_read_done_claiming_another_tp_size_than_its_handshake_does_not_release_the_request() -> None:
    share = KVSpec.gqa(4, 2, 32, tokens_per_block=16, dtype="float32")  # one decode rank's 2 of the 4 heads
    eid = f"decode-{uuid.uuid4().hex[:6]}"
    prefill = make("prefill", small_spec(), seed=1, **LONG)
    ranks = [make("decode", share, engine_id=eid, rank=r, tp_size=2, **LONG) for r in range(2)]
    try:
        source = prefill.allocate(TOKENS)
        params = prefill.side.request_finished("r", source, TOKENS)
        ids = [d.allocate(TOKENS) for d in ranks]
        ranks[0].side.start_pull("d0", params, {0: ids[0]})
        assert ranks[0].wait("d0").state == "done"
        side = prefill.side

        def lie() -> bool:
            peer = side._admission.peers[(eid, 0)]
            side._dispatch(peer.identity, peer.key, ReadDone("r", eid, 0, 1, True, side.local.boot_id, params.kvplane_token))
            return "r" in side._held  # still held for rank 1

        assert side._loop.submit(lie).result(10.0), "the prefill released r on a ReadDone claiming tp_size=1"
        assert "r" not in prefill.collect()
        ranks[1].side.start_pull("d1", params, {0: ids[1]})
        assert ranks[1].wait("d1").state == "done"
        assert prefill.wait("r", within_s=20.0).state == "done"
        for d, i in zip(ranks, ids):
            d.pool.free(i)
            assert d.whole and d.side.pending_requests() == 0
        assert side.held_requests() == 0
    finally:
        for d in ranks:
            d.close()
        prefill.close()
