"""``layers_by_source``: which prefill rank each of a decode rank's layers comes from, worked out once per
manifest and TP size and reused per request.

The reference is the head arithmetic itself (``plan.heads.source_ranks`` per layer, as both sides compute it);
requests with many ids go through the same manifest in any order, so a cached answer that leaked one request's
replica rank into another's would show.
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import given, settings

from kvplane.backend import get_backend
from kvplane.bench.peer import KVBuffer
from kvplane.flows.disagg.wire.routes import layers_by_source
from kvplane.kv.manifest import Manifest
from kvplane.kv.spec import KVSpec
from kvplane.plan.heads import source_ranks
from kvplane.plan.planner import REPLICATED_FAMILIES

HEADS = 8
cpu = get_backend("cpu")


def manifest(family: str, rank: int, tp: int) -> Manifest:
    spec = KVSpec.mla(3) if family == "mla" else KVSpec.gqa(3, HEADS // tp, 16)
    layout = cpu.layouts[family]
    return KVBuffer(spec, layout, 2, cpu.alloc_host).manifest("decode", rank, tp, "cpu")


def reference(dst: Manifest, src_tp: int, request_id: str) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for layer in dst.spec.layers:
        replicated = layer.family in REPLICATED_FAMILIES
        heads = dst.regions_of(layer.name)[0].heads * (1 if replicated else dst.tp_size)
        for rank in source_ranks(dst.rank, dst.tp_size, src_tp, heads, replicated, request_id):
            out.setdefault(rank, []).append(layer.name)
    return out


MANIFESTS = {(f, r, tp): manifest(f, r, tp) for f in ("gqa", "mla") for tp in (1, 2, 4) for r in range(tp)}


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(sorted(MANIFESTS)), st.sampled_from([1, 2, 4, 8]),
       st.lists(st.text(min_size=1, max_size=12), min_size=1, max_size=6))
def test_every_request_gets_what_the_head_arithmetic_gives(key: tuple[str, int, int], src_tp: int,
                                                           request_ids: list[str]) -> None:
    dst = MANIFESTS[key]
    for request_id in request_ids:
        assert layers_by_source(dst, src_tp, request_id) == reference(dst, src_tp, request_id)
