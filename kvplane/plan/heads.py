"""Which heads a rank holds under tensor parallelism, and which source ranks a destination rank needs.

GQA/MHA KV heads are split evenly over TP ranks: rank r holds heads ``[r * h, (r + 1) * h)``. MLA (and an
indexer) keeps one latent head replicated on every rank, so a destination reads it from exactly one source
rank, chosen from the request id so that requests spread over the source ranks deterministically.
"""

from __future__ import annotations

import zlib

from kvplane.errors import PlanError


def head_range(rank: int, heads_per_rank: int, replicated: bool) -> tuple[int, int]:
    """Global head ids ``[start, stop)`` that ``rank`` holds."""
    return (0, heads_per_rank) if replicated else (rank * heads_per_rank, (rank + 1) * heads_per_rank)


def overlap(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    return max(a[0], b[0]), min(a[1], b[1])


def replica_rank(request_id: str, src_tp: int) -> int:
    """The source rank a replicated cache is read from for this request (same answer on every rank)."""
    return zlib.crc32(request_id.encode()) % src_tp


def source_ranks(
    dst_rank: int, dst_tp: int, src_tp: int, total_heads: int, replicated: bool, request_id: str
) -> list[int]:
    """Source ranks whose heads a destination rank needs (one rank when the cache is replicated)."""
    if replicated:
        return [replica_rank(request_id, src_tp)]
    if total_heads % src_tp or total_heads % dst_tp:
        raise PlanError(
            f"{total_heads} KV heads do not split evenly over TP {src_tp} and {dst_tp}; "
            f"heterogeneous TP needs both TP sizes to divide the KV head count"
        )
    want = head_range(dst_rank, total_heads // dst_tp, False)
    per_src = total_heads // src_tp
    return [r for r in range(src_tp) if overlap(want, head_range(r, per_src, False))[0] < want[1]
            and overlap(want, head_range(r, per_src, False))[1] > want[0]]
