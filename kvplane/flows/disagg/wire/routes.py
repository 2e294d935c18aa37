"""Which prefill ranks a decode rank exchanges KV with, which layers each holds for it, and the plan for one.

Both sides compute the same routes from the same inputs (manifests, TP sizes, the prefill's request id), so a
prefill rank pushing to a decode rank writes exactly what that decode rank would have read, and both agree on
where staged layers land. GQA heads split over TP ranks; MLA and indexer caches are replicated, so they come
from one prefill rank, chosen per request (``plan.heads.replica_rank``).

A decode rank that holds a request's first tokens already (its engine's prefix cache) receives only the rest:
``first_tokens`` rounds what it holds down to a block boundary of both sides, and the plan moves the remote blocks
from there into the matching local blocks, as if the request began there (so staged layers land alike on both).
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence

import numpy as np

from kvplane.blocks.groups import Ids
from kvplane.errors import PlanError
from kvplane.kv.manifest import Manifest
from kvplane.plan.heads import replica_rank, source_ranks
from kvplane.plan.planner import REPLICATED_FAMILIES, TransferPlan, plan_transfer

# per layer of a destination, in order: the source ranks holding its heads, or None where every rank holds them
# all (replicated: one rank per request). Keyed by (id of the manifest, source TP), the manifest held with it.
LayerSources = list[tuple[str, tuple[int, ...] | None]]
_SOURCES: OrderedDict[tuple[int, int], tuple[Manifest, LayerSources]] = OrderedDict()
_SOURCES_LOCK = threading.Lock()  # both sides' threads reach it in a kv_both instance
_SOURCES_KEPT = 64


def layers_by_source(dst: Manifest, src_tp: int, request_id: str) -> dict[int, list[str]]:
    """``{prefill rank: layer names}`` this decode rank needs from each prefill rank (ranks it needs nothing
    from are absent). The head arithmetic is done once per manifest and source TP; per request only the
    replicated layers' rank is chosen."""
    replica = replica_rank(request_id, src_tp)
    out: dict[int, list[str]] = {}
    for name, ranks in _layer_sources(dst, src_tp):
        for rank in ranks if ranks is not None else (replica,):
            out.setdefault(rank, []).append(name)
    return out


def _layer_sources(dst: Manifest, src_tp: int) -> LayerSources:
    key = (id(dst), src_tp)
    with _SOURCES_LOCK:
        hit = _SOURCES.get(key)
        if hit is not None and hit[0] is dst:
            _SOURCES.move_to_end(key)
            return hit[1]
    sources: LayerSources = []
    for layer in dst.spec.layers:
        if layer.family in REPLICATED_FAMILIES:
            sources.append((layer.name, None))
            continue
        heads = dst.regions_of(layer.name)[0].heads * dst.tp_size
        sources.append((layer.name, tuple(source_ranks(dst.rank, dst.tp_size, src_tp, heads, False, ""))))
    with _SOURCES_LOCK:
        _SOURCES[key] = (dst, sources)
        while len(_SOURCES) > _SOURCES_KEPT:
            _SOURCES.popitem(last=False)
    return sources


def first_tokens(srcs: Sequence[Manifest], dst: Manifest, local_tokens: Mapping[int, int], num_tokens: int
                 ) -> dict[int, int]:
    """Per KV-cache group of ``dst`` the first token a transfer moves: the ``local_tokens`` the destination holds
    already (none where a group is not named), rounded down to a block boundary of every side in ``srcs`` and of
    ``dst`` (whole blocks pair up from there on both), at most ``num_tokens``."""
    out = {}
    for g in dst.spec.groups:
        held = min(max(int(local_tokens.get(g.group_id, 0)), 0), num_tokens)
        unit = math.lcm(g.tokens_per_block, *(s.spec.group(g.group_id).tokens_per_block for s in srcs))
        out[g.group_id] = held // unit * unit
    return out


def after_first(src: Manifest, dst: Manifest, src_ids: Mapping[int, Ids], dst_ids: Mapping[int, Ids],
                num_tokens: int, first: Mapping[int, int] | None) -> tuple[dict[int, Ids], dict[int, Ids], dict[int, int]]:
    """The request from token ``first[g]`` of each group on: both block tables without the blocks before it, and
    the tokens left. ``PlanError`` where ``first`` is not a block boundary of both sides (a peer's word)."""
    srcs, dsts, tokens = dict(src_ids), dict(dst_ids), tokens_by_group(dst, num_tokens)
    for g, start in (first or {}).items():
        if not start or g not in tokens or g not in src_ids or g not in dst_ids:
            continue  # a group missing on a side: the planner names it
        src_block, dst_block = src.spec.group(g).tokens_per_block, dst.spec.group(g).tokens_per_block
        if start % src_block or start % dst_block or not 0 < start <= num_tokens:
            raise PlanError(f"group {g}: a transfer of {num_tokens} tokens cannot start at token {start}: it must "
                            f"be a multiple of both block sizes ({src_block}, {dst_block}) and at most the tokens")
        srcs[g] = np.asarray(src_ids[g], dtype=np.int64)[start // src_block :]
        dsts[g] = np.asarray(dst_ids[g], dtype=np.int64)[start // dst_block :]
        tokens[g] = num_tokens - start
    return srcs, dsts, tokens


def tokens_by_group(manifest: Manifest, num_tokens: int) -> dict[int, int]:
    return {g.group_id: num_tokens for g in manifest.spec.groups}


def route_plan(
    src: Manifest,
    dst: Manifest,
    src_ids: Mapping[int, Ids],
    dst_ids: Mapping[int, Ids],
    num_tokens: int,
    layers: Sequence[str],
    staging: tuple[int, int] | None,
    first: Mapping[int, int] | None = None,
) -> TransferPlan:
    """The plan moving ``layers`` of one request from ``src``'s rank into ``dst``'s rank (or its staging), from
    token ``first[g]`` of each group on (``first_tokens``; from the start where None)."""
    srcs, dsts, tokens = after_first(src, dst, src_ids, dst_ids, num_tokens, first)
    return plan_transfer(src, dst, srcs, dsts, tokens, layers=layers, staging=staging)
