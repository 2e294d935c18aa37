"""Splitting one source rank's staged layers into chunks that each fit a bounded staging range.

A pull whose bytes cannot land directly (``plan.planner``: heterogeneous TP with token-major blocks, fused
against split MLA) stages whole source blocks and re-lays them out. ``split_staged`` cuts that work into
chunks of at most ``bound`` bytes: each chunk is a run of whole source blocks of one or more layers (every
source region of a layer for those blocks, so the re-layout finds all the slots it fills), with the READ
descriptors relative to the chunk's range and one ``StagedLayer`` per piece, whose tokens start where its
first block does (``dst_token_start``). Every source block of the plan is staged by exactly one chunk. Pure:
no I/O, no torch; ``staged_pull`` runs the chunks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from kvplane.blocks.groups import Ids
from kvplane.descriptors import CopyPlan
from kvplane.descriptors import Int64Array as I64
from kvplane.flows.disagg.wire.errors import DisaggError
from kvplane.flows.disagg.wire.staging import ALIGN
from kvplane.plan.planner import StagedLayer, StagedRegion


@dataclass(frozen=True)
class Chunk:
    """Whole source blocks of one source rank, staged at offsets ``0 .. nbytes`` of one range."""

    rank: int
    src: I64  # addresses on the source rank
    offset: I64  # where each descriptor lands, relative to the range
    length: I64
    staged: tuple[StagedLayer, ...]  # what to re-lay out once it landed, offsets relative to the range

    @property
    def nbytes(self) -> int:
        return int(self.length.sum())

    def plan_at(self, addr: int) -> CopyPlan:
        """The READ descriptors with the range at ``addr`` (coalesced: consecutive source blocks merge)."""
        return CopyPlan(self.src, self.offset + addr, self.length).coalesced()


def block_unit(staged: StagedLayer) -> int:
    """Bytes one source block of ``staged`` takes (all its source regions): the least a chunk can hold."""
    return sum(s.region.block_bytes for s in staged.sources)


def chunk_bound(staging_bytes: int, staged: Sequence[StagedLayer]) -> tuple[int, int]:
    """``(bound, slots)``: chunks of at most ``bound`` bytes, ``slots`` of them in flight at once (two when
    half of ``staging_bytes`` holds a source block of every layer: READ one chunk while the other is re-laid
    out; else one, in turn). Raises ``DisaggError`` when ``staging_bytes`` cannot hold one source block."""
    unit = max((block_unit(layer) for layer in staged), default=0)
    if unit > staging_bytes:
        name = next(layer.layer_name for layer in staged if block_unit(layer) == unit)
        raise DisaggError(
            f"DisaggConfig.staging_bytes={staging_bytes} cannot hold one source block of layer {name!r} ({unit} B; "
            f"whole source blocks are staged, then re-laid out); raise it to at least {unit}"
        )
    half = staging_bytes // 2 // ALIGN * ALIGN
    return (half, 2) if half >= unit else (staging_bytes, 1)


def split_staged(rank: int, staged: Sequence[StagedLayer], src_ids: Mapping[str, Ids], bound: int) -> list[Chunk]:
    """Chunks of at most ``bound`` bytes staging ``staged`` (one source rank's layers, as planned with the
    whole request in one range); ``src_ids`` are the source block ids of each layer's group, by layer name.
    Raises ``DisaggError`` naming ``DisaggConfig.staging_bytes`` when one source block does not fit."""
    builder = _Builder(rank)
    for layer in staged:
        unit = block_unit(layer)
        if unit > bound:
            raise DisaggError(f"a chunk of {bound} B cannot hold one source block of layer {layer.layer_name!r} "
                              f"({unit} B); pass a bound from chunk_bound")
        tokens_per_block = layer.sources[0].region.tokens_per_block
        count = layer.sources[0].num_blocks
        ids = np.asarray(src_ids[layer.layer_name], dtype=np.int64)[:count]
        first = 0
        while first < count:
            room = (bound - builder.used) // unit
            if room == 0:
                builder.flush()
                continue
            last = min(count, first + room)
            builder.add(layer, ids, first, last, tokens_per_block)
            first = last
    builder.flush()
    return builder.chunks


class _Builder:
    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.chunks: list[Chunk] = []
        self.used = 0
        self._src: list[I64] = []
        self._offset: list[I64] = []
        self._length: list[I64] = []
        self._staged: list[StagedLayer] = []

    def add(self, layer: StagedLayer, ids: I64, first: int, last: int, tokens_per_block: int) -> None:
        """Source blocks ``first .. last`` of ``layer`` (every region), and their piece of the re-layout."""
        n = last - first
        sources = []
        for part in layer.sources:
            r = part.region
            self._src.append(r.block_addrs(ids[first:last]))
            self._offset.append(self.used + np.arange(n, dtype=np.int64) * r.block_bytes)
            self._length.append(np.full(n, r.block_bytes, dtype=np.int64))
            sources.append(StagedRegion(r, self.used, n, part.head_start))
            self.used += n * r.block_bytes
        t0 = layer.dst_token_start + first * tokens_per_block  # in the request's first destination block
        end = layer.dst_token_start + min(last * tokens_per_block, layer.num_tokens)
        per_dst = layer.dst_tokens_per_block
        self._staged.append(replace(
            layer, sources=tuple(sources), dst_block_ids=layer.dst_block_ids[t0 // per_dst :],
            num_tokens=end - t0, dst_token_start=t0 % per_dst,
        ))

    def flush(self) -> None:
        if not self._staged:
            return
        self.chunks.append(Chunk(self.rank, np.concatenate(self._src), np.concatenate(self._offset),
                                 np.concatenate(self._length), tuple(self._staged)))
        self.used = 0
        self._src, self._offset, self._length, self._staged = [], [], [], []
