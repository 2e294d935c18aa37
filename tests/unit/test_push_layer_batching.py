"""Layer-wise push that falls behind the prefill: layers saved while writes to a decode rank are in flight wait,
and leave together as one write when one ends; over cross-layer caches that write is one descriptor per block
for all its layers. Before, every saved layer became a write of its own (one descriptor per block and layer),
so a push over Mooncake TCP ended later after prefill than a whole-request push (bench row
``pd-flow-mooncake-qwen3-0.6b-layerwise-xl``: 782 ms against 611 ms).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import cast

import numpy as np

from kvplane.descriptors import CopyPlan
from kvplane.errors import KvplaneError
from kvplane.flows.disagg.prefill.held_request import (
    WRITES_PER_TARGET,
    HeldRequest,
    Prepare,
    Release,
    Send,
    Terms,
    Write,
)
from kvplane.flows.disagg.prefill.push_target import Target, TargetPhase
from kvplane.flows.disagg.prefill.pusher import Pusher
from kvplane.flows.disagg.wire.local import LocalKV
from kvplane.flows.disagg.wire.messages import PushRegister, PushResult
from kvplane.flows.disagg.wire.mover import Mover
from kvplane.flows.disagg.wire.peers import PeerRecord
from kvplane.kv.binding import allocate_cross_layer, regions_from_tensors
from kvplane.kv.manifest import Manifest
from kvplane.kv.spec import KVSpec

TERMS = Terms(rank=0, lease_s=10.0, push_timeout_s=5.0)
DECODE = b"decode/0"
LAYERS = [f"l{i}" for i in range(6)]
QWEN3 = KVSpec.gqa(28, 8, 128, tokens_per_block=16)


def _peer(manifest: Manifest | None = None) -> PeerRecord:
    return PeerRecord("decode", 0, 1, "boot", cast(Manifest, manifest), "decode/0", DECODE)


def _register(blocks: list[int], tokens: int) -> PushRegister:
    return PushRegister("r", "decode", 0, 1, {0: blocks}, tokens, 0, 0, "boot", "tok")


def _writes(actions: Sequence[object]) -> list[tuple[str, ...]]:
    return [a.layers for a in actions if isinstance(a, Write)]


def test_layers_saved_while_writes_run_leave_together_when_one_ends() -> None:
    assert WRITES_PER_TARGET == 2  # the figures below follow from it
    m = HeldRequest("r", TERMS)
    m.start({0: np.arange(1, dtype=np.int64)}, 16, "tok")
    out = m.register(DECODE, _peer(), _register([7], 16), LAYERS)
    assert [a for a in out if isinstance(a, Prepare)] and not _writes(out)
    first, second = (m.layer_saved(x) for x in LAYERS[:2])
    assert _writes(first) == [("l0",)] and _writes(second) == [("l1",)]
    target = next(a for a in first if isinstance(a, Write)).target
    assert _writes(m.layer_saved("l2")) == [] and _writes(m.layer_saved("l3")) == []  # two in flight: they wait
    assert _writes(m.write_ended(target, "")) == [("l2", "l3")]  # one ended: the waiting layers go as one write
    assert _writes(m.layer_saved("l4")) == []
    out = m.finish({0: np.arange(1, dtype=np.int64)}, 16, "tok", 0.0)
    assert _writes(out) == []  # finished, so every layer is ready, but two writes still run
    assert _writes(m.write_ended(target, "")) == [("l4", "l5")]
    assert not [a for a in m.write_ended(target, "") if isinstance(a, Release)]  # one write still runs
    out = m.write_ended(target, "")
    assert [a.message.ok for a in out if isinstance(a, Send) and isinstance(a.message, PushResult)] == [True]
    assert [a.completion.state for a in out if isinstance(a, Release)] == ["done"]


def test_a_failed_write_sends_nothing_more_and_fails_the_push_once_the_other_ended() -> None:
    m = HeldRequest("r", TERMS)
    m.start({0: np.arange(1, dtype=np.int64)}, 16, "tok")
    m.register(DECODE, _peer(), _register([7], 16), LAYERS)
    target = next(a for a in m.layer_saved("l0") if isinstance(a, Write)).target
    m.layer_saved("l1")
    m.layer_saved("l2")
    assert _writes(m.write_ended(target, "engine said no")) == []
    m.finish({0: np.arange(1, dtype=np.int64)}, 16, "tok", 0.0)
    out = m.write_ended(target, "")
    results = [a.message for a in out if isinstance(a, Send) and isinstance(a.message, PushResult)]
    assert [r.ok for r in results] == [False] and "engine said no" in results[0].reason
    assert [a.completion.state for a in out if isinstance(a, Release)] == ["failed"]


class _Recorder:
    """Stands in for the transfer thread: keeps the plan the pusher hands it."""

    def __init__(self) -> None:
        self.plans: list[CopyPlan] = []

    def put(self, peer: str, plan: CopyPlan, done: Callable[[KvplaneError | None], None]) -> None:
        self.plans.append(plan)


def test_several_layers_of_a_cross_layer_cache_go_as_one_descriptor_per_block() -> None:
    blocks, tokens = 40, 40 * 16
    (_, src), (_, dst) = (allocate_cross_layer(QWEN3, "packed_kv", 2 * blocks, zero=False) for _ in range(2))
    src_man, dst_man = (Manifest(name, 0, 1, "cpu", QWEN3, {QWEN3.layers[0].family: "packed_kv"},
                                 tuple(regions_from_tensors(QWEN3, cache, "packed_kv")))
                        for name, cache in (("prefill", src), ("decode", dst)))
    rng = np.random.default_rng(3)
    src_ids, dst_ids = rng.choice(2 * blocks, blocks, replace=False), rng.choice(2 * blocks, blocks, replace=False)
    recorder = _Recorder()
    pusher = Pusher(cast(LocalKV, SimpleNamespace(manifest=src_man)), cast(Mover, recorder))
    peer = _peer(dst_man)
    target = Target(peer, _register([int(x) for x in dst_ids], tokens), list(QWEN3.layer_names), TargetPhase.CHECKED)
    assert pusher.prepare({0: src_ids}, target) == ""
    assert target.plans is not None and all(len(p) == blocks for p in target.plans.values())  # per layer

    layers = QWEN3.layer_names[3:10]
    pusher.write({0: src_ids}, target, layers, whole=False, ended=lambda why: None)
    plan = recorder.plans[-1]
    assert len(plan) == blocks  # was blocks * len(layers): one descriptor per block and layer
    assert plan.total_bytes == sum(target.plans[x].total_bytes for x in layers)
    one_layer = target.plans[layers[0]]
    starts = np.sort(plan.src)
    assert np.array_equal(starts, np.sort(one_layer.src))  # each block's run starts at the first layer written
