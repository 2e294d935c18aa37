"""Stores to the host tier and layer-wise pushes overlap the forward under the installed vLLM's call order
(0.33 calls ``start_load_kv`` after the forward unless the step loads synchronously): layer i's copy must have
started before layer i+1's forward begins (see ``realsched.RealEngine.run_model``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from kvplane.flows.disagg.wire.tokens import new_token

pytest.importorskip("vllm", reason="the vLLM connector tests need vLLM: pip install --no-deps vllm==0.27.1 + .[vllm]")

from ports import free_port  # noqa: E402
from realsched import LAYERS, STARTS_LOADS_AFTER_FORWARD, RealEngine, reference_digest  # noqa: E402

TOKEN = new_token()  # what a push-mode proxy puts in both sides' kv_transfer_params

PROMPT = [(i * 17 + 3) % 997 for i in range(70)]
QUICK = {"lease_s": 10.0, "heartbeat_s": 0.5, "handshake_timeout_s": 1.0, "transfer_timeout_s": 5.0,
         "drain_timeout_s": 1.0}


def record(engine: RealEngine, side: Any, open_name: str) -> None:
    """Log into the engine's timeline when ``side`` opens a request's copies and when it is handed a layer."""
    def wrap(fn: Callable[..., Any], event: str, key: Callable[..., str]) -> Callable[..., Any]:
        def recorded(*args: Any, **kwargs: Any) -> Any:
            engine.timeline.append((event, key(*args)))
            return fn(*args, **kwargs)
        return recorded

    setattr(side, open_name, wrap(getattr(side, open_name), "open", lambda rid, *_: rid))
    side.save_layer = wrap(side.save_layer, "save", lambda name: name)


def share_started_before_next_layer(timeline: list[tuple[str, str]]) -> tuple[int, int]:
    """(layers whose copy had started before the next layer's forward, layers) over the steps that copied."""
    started = total = 0
    steps: list[list[tuple[str, str]]] = []
    for event in timeline:
        if event[0] == "step":
            steps.append([])
        elif steps:
            steps[-1].append(event)
    for events in steps:
        if not any(e == "open" for e, _ in events) or not any(e == "forward" for e, _ in events):
            continue
        for i, layer in enumerate(LAYERS):
            end = events.index(("forward", LAYERS[i + 1])) if i + 1 < len(LAYERS) else len(events)
            first_open = next((k for k, (e, _) in enumerate(events) if e == "open"), len(events))
            total += 1
            started += any(events[k] == ("save", layer) and k > first_open for k in range(end))
    return started, total


def test_stores_to_the_host_tier_start_layer_by_layer_during_the_forward(
    model_dir: str, engines: list[RealEngine]
) -> None:
    engine = RealEngine(model_dir, {"offload": {"host_bytes": 4 << 20, "pinned": False}})
    engines.append(engine)
    record(engine, engine.worker.worker.offload, "start_store")
    engine.add("a", PROMPT)
    engine.finish("a")
    engine.drain()
    started, total = share_started_before_next_layer(engine.timeline)
    print(f"offload stores, vLLM starts loads after the forward: {STARTS_LOADS_AFTER_FORWARD}: "
          f"{started}/{total} layers started before the next layer's forward")
    assert total and started == total
    engine.add("b", PROMPT)  # and the bytes are right
    engine.finish("b")
    assert engine.first_computed["b"] == 64 and engine.digests["b"] == reference_digest(PROMPT, len(PROMPT))
    engine.drain()
    engine.assert_nothing_held()


def test_layerwise_pushes_start_layer_by_layer_during_the_forward(model_dir: str, engines: list[RealEngine]) -> None:
    port = free_port()
    prefill = RealEngine(model_dir, {"disagg": {"mode": "layerwise", "port": port, **QUICK}}, "kv_producer")
    decode = RealEngine(model_dir, {"disagg": {"mode": "layerwise", "port": free_port(), **QUICK}}, "kv_consumer")
    engines.extend([prefill, decode])
    record(prefill, prefill.worker.worker.prefill, "start_request")
    decode.add("d-1-9f8e7d6c", PROMPT, {
        "do_remote_prefill": True, "remote_engine_id": prefill.config.kv_transfer_config.engine_id,
        "remote_request_id": "req-1", "remote_host": "127.0.0.1", "remote_port": port, "tp_size": 1,
        "kvplane_mode": "layerwise", "kvplane_token": TOKEN,  # a proxy gives both sides the request's token
    })
    decode.step()
    prefill.add("req-1-0a1b2c3d", PROMPT, {"do_remote_decode": True, "kvplane_token": TOKEN})
    prefill.finish("req-1-0a1b2c3d")

    def prefill_steps_too() -> bool:
        prefill.step()
        return "d-1-9f8e7d6c" in decode.outputs

    decode.run_until(prefill_steps_too)
    assert decode.digests["d-1-9f8e7d6c"] == reference_digest(PROMPT, len(PROMPT)) and not decode.invalid
    started, total = share_started_before_next_layer(prefill.timeline)
    print(f"layer-wise pushes, vLLM starts loads after the forward: {STARTS_LOADS_AFTER_FORWARD}: "
          f"{started}/{total} layers started before the next layer's forward")
    assert total and started == total
    prefill.drain()
    decode.drain()
    prefill.assert_nothing_held()
    decode.assert_nothing_held()
