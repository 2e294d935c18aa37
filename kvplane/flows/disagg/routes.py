"""Which prefill ranks a decode rank exchanges KV with, which layers each holds for it, and the plan for one.

Both sides compute the same routes from the same inputs (manifests, TP sizes, the prefill's request id), so a
prefill rank pushing to a decode rank writes exactly what that decode rank would have read, and both agree on
where staged layers land. GQA heads split over TP ranks; MLA and indexer caches are replicated, so they come
from one prefill rank, chosen per request (``plan.heads.replica_rank``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvplane.blocks.groups import Ids
from kvplane.kv.manifest import Manifest
from kvplane.plan.heads import source_ranks
from kvplane.plan.planner import REPLICATED_FAMILIES, TransferPlan, plan_transfer, staging_bytes_needed


def layers_by_source(dst: Manifest, src_tp: int, request_id: str) -> dict[int, list[str]]:
    """``{prefill rank: layer names}`` this decode rank needs from each prefill rank (ranks it needs nothing
    from are absent)."""
    out: dict[int, list[str]] = {}
    for layer in dst.spec.layers:
        replicated = layer.family in REPLICATED_FAMILIES
        heads = dst.regions_of(layer.name)[0].heads * (1 if replicated else dst.tp_size)
        for rank in source_ranks(dst.rank, dst.tp_size, src_tp, heads, replicated, request_id):
            out.setdefault(rank, []).append(layer.name)
    return out


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
