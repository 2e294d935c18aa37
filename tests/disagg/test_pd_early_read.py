"""vLLM hands ``kv_transfer_params`` to the proxy one step before its worker hands the request to ``PrefillSide``
(the scheduler returns them from ``request_finished``; the worker hears of it in the next step's metadata), so a
fast decode can finish its READ and send ``ReadDone`` before ``PrefillSide.request_finished`` runs."""

from __future__ import annotations

import time

import pytest
from kvfill import digest
from pair import make, small_spec

from kvplane.flows.disagg import TransferParams
from kvplane.flows.disagg.tokens import new_token

pytestmark = pytest.mark.integration


def test_a_read_done_that_beats_request_finished_still_releases_the_blocks_at_once() -> None:
    spec = small_spec()
    prefill = make("prefill", spec, seed=3, lease_s=20.0)
    decode = make("decode", spec, lease_s=20.0)
    try:
        src = prefill.allocate(40)
        params = TransferParams(  # exactly what request_finished will return, known before it runs
            remote_engine_id=prefill.side.config.engine_id, remote_request_id="early", remote_block_ids=[src],
            remote_host="127.0.0.1", remote_port=prefill.side.base_port, tp_size=1, remote_block_size=16,
            remote_num_tokens=40, remote_boot_id=prefill.side.local.boot_id, kvplane_token=new_token(),
        )
        dst = decode.allocate(40)
        decode.side.start_pull("d-early", params, dst)
        assert decode.wait("d-early").state == "done"
        time.sleep(0.2)  # the ReadDone is at the prefill now, for a request it has not been handed
        assert prefill.side.request_finished("early", src, 40, token=params.kvplane_token) == params
        done = prefill.wait("early", within_s=5.0)  # not the 20 s lease
        assert done.state == "done", done
        assert digest(spec, decode.cache, decode.layout, {0: dst}, 40) == \
            digest(spec, prefill.cache, prefill.layout, {0: src}, 40)
    finally:
        prefill.close()
        decode.close()
