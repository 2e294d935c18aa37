"""A ``DecodeSide`` that refuses its keys at start-up (``KVPLANE_CURVE_SECRET_KEY`` holding no Z85 key) gives
back what it built before: the local KV (its registered memory and transport engine) and the I/O loop's ZMQ
context, as a ``PrefillSide`` does (``test_prefill_bind.py``)."""

from __future__ import annotations

from typing import Any

import pytest
from pair import cpu, small_spec, watched_local_kv

from kvplane.flows.disagg import DecodeSide, DisaggConfig
from kvplane.flows.disagg import decode as decode_module
from kvplane.flows.disagg.errors import DisaggConfigError
from kvplane.flows.disagg.loop import IOLoop
from kvplane.kv.binding import allocate_cache


def test_a_decode_side_refusing_its_curve_keys_closes_its_local_kv_and_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    Watched, built = watched_local_kv()
    loops: list[Any] = []

    real_loop = IOLoop

    def loop(*args: Any, **kwargs: Any) -> Any:
        loops.append(real_loop(*args, **kwargs))
        return loops[-1]

    monkeypatch.setattr(decode_module, "LocalKV", Watched)
    monkeypatch.setattr(decode_module, "IOLoop", loop)
    spec = small_spec()
    config = DisaggConfig(engine_id="decode-bad-key", transport="mooncake")
    monkeypatch.setenv("KVPLANE_CURVE_SECRET_KEY", "not-a-key")  # set after the config checked it; read again at start
    with pytest.raises(DisaggConfigError, match="CURVE"):
        DecodeSide(cpu, spec, allocate_cache(spec, "packed_kv", 8), config, layouts="packed_kv")
    assert len(built) == 1 and built[0].closes == 1, "the LocalKV built before the keys were refused was not closed"
    assert len(loops) == 1 and loops[0].context.closed, "the I/O loop's ZMQ context was left open"
