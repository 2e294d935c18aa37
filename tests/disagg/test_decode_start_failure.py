"""A ``DecodeSide`` that fails at start-up gives back what it built before: the local KV (its registered memory
and transport engine), the I/O loop's ZMQ context, the transfer thread (``Mover``) and the re-layout thread
(``Starter``), as a ``PrefillSide`` does (``test_prefill_bind.py``). It fails when it refuses its keys
(``KVPLANE_CURVE_SECRET_KEY`` holding no Z85 key), or when a part built after them raises."""

from __future__ import annotations

from typing import Any

import pytest
from pair import cpu, small_spec, watched_local_kv

from kvplane.flows.disagg import DecodeSide, DisaggConfig
from kvplane.flows.disagg.decode import decode_side as decode_module
from kvplane.flows.disagg.wire.errors import DisaggConfigError
from kvplane.kv.binding import allocate_cache
from kvplane.kv.bound import bind


def recorded(monkeypatch: pytest.MonkeyPatch, name: str, fails: bool = False) -> list[Any]:
    """Replace ``decode.<name>`` by a wrapper that keeps each one built (or raises, when ``fails``)."""
    real, built = getattr(decode_module, name), []

    def build(*args: Any, **kwargs: Any) -> Any:
        if fails:
            raise RuntimeError(f"planted failure building the {name}")
        built.append(real(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(decode_module, name, build)
    return built


def test_a_decode_side_refusing_its_curve_keys_closes_its_local_kv_and_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    Watched, built = watched_local_kv()
    monkeypatch.setattr(decode_module, "LocalKV", Watched)
    loops = recorded(monkeypatch, "IOLoop")
    spec = small_spec()
    config = DisaggConfig(engine_id="decode-bad-key", transport="mooncake")
    monkeypatch.setenv("KVPLANE_CURVE_SECRET_KEY", "not-a-key")  # set after the config checked it; read again at start
    with pytest.raises(DisaggConfigError, match="CURVE"):
        DecodeSide(bind(cpu, spec, allocate_cache(spec, "packed_kv", 8), "packed_kv"), config)
    assert len(built) == 1 and built[0].closes == 1, "the LocalKV built before the keys were refused was not closed"
    assert len(loops) == 1 and loops[0].context.closed, "the I/O loop's ZMQ context was left open"


@pytest.mark.parametrize("failing", ["Mover", "Starter", "Prober"])
def test_a_decode_side_whose_parts_fail_to_build_gives_back_what_it_built(
    monkeypatch: pytest.MonkeyPatch, failing: str,
) -> None:
    """On main at cbeed0c only the loop and the key check were undone: a Mover, Starter or Prober that raised
    left the LocalKV, the loop's context and the threads already started behind."""
    Watched, built = watched_local_kv()
    monkeypatch.setattr(decode_module, "LocalKV", Watched)
    loops = recorded(monkeypatch, "IOLoop")
    movers = recorded(monkeypatch, "Mover", failing == "Mover")
    starters = recorded(monkeypatch, "Starter", failing == "Starter")
    recorded(monkeypatch, "Prober", failing == "Prober")
    spec = small_spec()
    config = DisaggConfig(engine_id=f"decode-no-{failing.lower()}", transport="mooncake")
    with pytest.raises(RuntimeError, match=f"planted failure building the {failing}"):
        DecodeSide(bind(cpu, spec, allocate_cache(spec, "packed_kv", 8), "packed_kv"), config)
    assert len(built) == 1 and built[0].closes == 1, "the LocalKV was not closed"
    assert len(loops) == 1 and loops[0].context.closed, "the I/O loop's ZMQ context was left open"
    assert all(not m._thread.is_alive() for m in movers), "the transfer thread was left running"
    assert all(s.relayouts.closed and not s.relayouts.alive for s in starters), "the re-layout thread was left running"
