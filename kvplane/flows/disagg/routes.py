"""Which prefill ranks a decode rank exchanges KV with, which layers each holds for it, and the plan for one.

Both sides compute the same routes from the same inputs (manifests, TP sizes, the prefill's request id), so a
prefill rank pushing to a decode rank writes exactly what that decode rank would have read, and both agree on
where staged layers land. GQA heads split over TP ranks; MLA and indexer caches are replicated, so they come
from one prefill rank, chosen per request (``plan.heads.replica_rank``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence

from kvplane.blocks.groups import Ids
from kvplane.kv.manifest import Manifest
from kvplane.plan.heads import replica_rank, source_ranks
from kvplane.plan.planner import REPLICATED_FAMILIES, TransferPlan, plan_transfer, staging_bytes_needed

# per layer of a destination, in order: the source ranks holding its heads, or None where every rank holds them
# all (replicated: one rank per request). Keyed by (id of the manifest, source TP), the manifest held with it.
LayerSources = list[tuple[str, tuple[int, ...] | None]]
_SOURCES: OrderedDict[tuple[int, int], tuple[Manifest, LayerSources]] = OrderedDict()
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
    _SOURCES[key] = (dst, sources)
    while len(_SOURCES) > _SOURCES_KEPT:
        _SOURCES.popitem(last=False)
    return sources


def tokens_by_group(manifest: Manifest, num_tokens: int) -> dict[int, int]:
    return {g.group_id: num_tokens for g in manifest.spec.groups}


def staging_needed(
    src: Manifest,
    dst: Manifest,
    src_ids: Mapping[int, Ids],
    dst_ids: Mapping[int, Ids],
    num_tokens: int,
    layers: Sequence[str],
) -> int:
    return staging_bytes_needed(src, dst, src_ids, dst_ids, tokens_by_group(dst, num_tokens), layers=layers)


def route_plan(
    src: Manifest,
    dst: Manifest,
    src_ids: Mapping[int, Ids],
    dst_ids: Mapping[int, Ids],
    num_tokens: int,
    layers: Sequence[str],
    staging: tuple[int, int] | None,
) -> TransferPlan:
    """The plan moving ``layers`` of one request from ``src``'s rank into ``dst``'s rank (or its staging)."""
    return plan_transfer(
        src, dst, src_ids, dst_ids, tokens_by_group(dst, num_tokens), layers=layers, staging=staging
    )
