"""A ``PrefillSide`` whose side-channel port is taken fails to start and gives back what it built first: the
local KV (its registered memory and transport engine) and the I/O loop's ZMQ context."""

from __future__ import annotations

from typing import Any

import pytest
import zmq
from pair import cpu, small_spec, watched_local_kv

from kvplane.flows.disagg import DisaggConfig, PrefillSide
from kvplane.flows.disagg.prefill import prefill_side as prefill_module
from kvplane.kv.binding import allocate_cache
from kvplane.kv.bound import bind


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
            PrefillSide(bind(cpu, spec, allocate_cache(spec, "packed_kv", 8), "packed_kv"), config)
    finally:
        taken.close(linger=0)
        context.term()
    assert len(built) == 1 and built[0].closes == 1, "the LocalKV built before the bind failed was not closed"


@pytest.mark.parametrize("failing", ["Mover", "Pusher", "Admission"])
def test_a_prefill_side_whose_parts_fail_to_build_gives_back_what_it_built(
    monkeypatch: pytest.MonkeyPatch, failing: str,
) -> None:
    """As a decode side does (``test_decode_start_failure.py``): on main at cbeed0c only the bind and the keys
    were undone, and a part built after them that raised left the LocalKV, the socket and the threads behind."""
    Watched, built = watched_local_kv()
    monkeypatch.setattr(prefill_module, "LocalKV", Watched)
    real_loop, loops = prefill_module.IOLoop, []
    real_mover, movers = prefill_module.Mover, []

    def loop(*args: Any, **kwargs: Any) -> Any:
        loops.append(real_loop(*args, **kwargs))
        return loops[-1]

    def mover(*args: Any, **kwargs: Any) -> Any:
        movers.append(real_mover(*args, **kwargs))
        return movers[-1]

    def planted(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"planted failure building the {failing}")

    monkeypatch.setattr(prefill_module, "IOLoop", loop)
    monkeypatch.setattr(prefill_module, "Mover", mover)
    monkeypatch.setattr(prefill_module, failing, planted)
    spec = small_spec()
    config = DisaggConfig(engine_id=f"prefill-no-{failing.lower()}", transport="mooncake")
    with pytest.raises(RuntimeError, match="planted failure"):
        PrefillSide(bind(cpu, spec, allocate_cache(spec, "packed_kv", 8), "packed_kv"), config)
    assert len(built) == 1 and built[0].closes == 1, "the LocalKV was not closed"
    assert len(loops) == 1 and loops[0].context.closed, "the I/O loop's ZMQ context was left open"
    assert all(not m._thread.is_alive() for m in movers), "the transfer thread was left running"
