"""A ``PrefillSide`` whose side-channel port is taken fails to start and gives back what it built first: the
local KV (its registered memory and transport engine) and the I/O loop's ZMQ context."""

from __future__ import annotations

import pytest
import zmq
from pair import cpu, small_spec, watched_local_kv

from kvplane.flows.disagg import DisaggConfig, PrefillSide
from kvplane.flows.disagg import prefill as prefill_module
from kvplane.kv.binding import allocate_cache


def test_a_prefill_side_whose_port_is_taken_closes_its_local_kv(monkeypatch: pytest.MonkeyPatch) -> None:
    Watched, built = watched_local_kv()

    monkeypatch.setattr(prefill_module, "LocalKV", Watched)
    context = zmq.Context()
    taken = context.socket(zmq.ROUTER)
    port = taken.bind_to_random_port("tcp://127.0.0.1")
    spec = small_spec()
    try:
        config = DisaggConfig(engine_id="prefill-taken", transport="mooncake", port=port)
        with pytest.raises(zmq.ZMQError):
            PrefillSide(cpu, spec, allocate_cache(spec, "packed_kv", 8), config, layouts="packed_kv")
    finally:
        taken.close(linger=0)
        context.term()
    assert len(built) == 1 and built[0].closes == 1, "the LocalKV built before the bind failed was not closed"
