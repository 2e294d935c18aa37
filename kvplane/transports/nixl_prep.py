"""Prepared NIXL descriptor lists: per peer, one local and one remote list made once (``prep_xfer_dlist``), so
that a request is two index arrays (``make_prepped_xfer``) instead of two descriptor lists NIXL builds and
checks against its registrations again on every request.

A list is a grid of equal entries over every registered span of its side: entry ``base[s] + i`` of span ``s``
is ``unit`` bytes at ``span_addr + origin[s] + i * unit`` (one strided ``(addr, len, dev, stride, count)`` row
per span, which NIXL expands). ``unit`` is the largest size that tiles every descriptor of the plans seen so
far on both sides (the gcd of their lengths and of their offsets from each other within a span): the KV block
of a per-layer cache (a region of N blocks is N entries), a whole block of every layer in a cross-layer cache.
A descriptor of ``k`` units becomes ``k`` consecutive entries, which NIXL merges back into one range.

The grid is worked out from the first plan sent to a peer and kept while later plans fit it. A plan that does
not fit makes a finer grid (the old entries are dropped once no transfer uses them); a plan whose grid would
exceed ``MAX_ENTRIES`` on a side (sub-block slices of heterogeneous TP, a span tiled only by a few bytes), or a
peer that published no spans, goes the unprepared way (``initialize_xfer``). ``PrepStats`` counts both paths.
Lists belong to one agent: the transport drops them on ``reset``, ``close`` and when a peer is replaced.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from kvplane.descriptors import Int64Array

MAX_ENTRIES = 1 << 21  # entries per prepared list (per side); a finer grid is not prepared
LOCAL = "NIXL_INIT_AGENT"  # prep_xfer_dlist's name for the initiator's own side
IndexArray = npt.NDArray[np.int32]


@dataclass
class PrepStats:
    """Which path each submitted plan took: ``prepped`` (index arrays into prepared lists) or ``unprepped``
    (descriptor lists built per request), why not (``reasons``), the lists made (``preps``, ``prep_ms``), and
    the time spent making NIXL requests on each path (``make_ms``: the index arrays and ``make_prepped_xfer``, or
    the descriptor tables, ``get_xfer_descs`` and ``initialize_xfer``; the ``transfer`` that follows is not in
    it)."""

    prepped: int = 0
    unprepped: int = 0
    preps: int = 0
    prep_ms: float = 0.0  # all prep_xfer_dlist calls so far
    reasons: dict[str, int] = field(default_factory=dict)
    make_ms: dict[str, float] = field(default_factory=lambda: {"prepped": 0.0, "unprepped": 0.0})

    def made(self, prepped: bool, seconds: float) -> None:
        self.make_ms["prepped" if prepped else "unprepped"] += seconds * 1e3

    def fell_back(self, reason: str) -> None:
        self.unprepped += 1
        self.reasons[reason] = self.reasons.get(reason, 0) + 1

    def as_dict(self) -> dict[str, Any]:
        return {"prepped": self.prepped, "unprepped": self.unprepped, "preps": self.preps,
                "prep_ms": round(self.prep_ms, 3), "reasons": dict(self.reasons),
                "make_ms": {k: round(v, 3) for k, v in self.make_ms.items()}}


@dataclass(frozen=True)
class Grid:
    """Equal entries of ``unit`` bytes over sorted ``(addr, length)`` spans, starting ``origins[s]`` into each."""

    unit: int
    starts: Int64Array
    lengths: Int64Array
    origins: Int64Array

    @property
    def counts(self) -> Int64Array:
        counts: Int64Array = np.maximum((self.lengths - self.origins) // self.unit, 0).astype(np.int64)
        return counts

    @property
    def bases(self) -> Int64Array:
        return np.concatenate(([0], np.cumsum(self.counts)[:-1])).astype(np.int64)

    @property
    def entries(self) -> int:
        return int(self.counts.sum())

    def rows(self, dev_id: int) -> npt.NDArray[np.uint64]:
        """The strided ``(addr, len, dev, stride, count)`` rows ``prep_xfer_dlist`` takes, one per span."""
        keep = self.counts > 0
        table = np.empty((int(keep.sum()), 5), dtype=np.uint64)
        table[:, 0] = (self.starts + self.origins)[keep]
        table[:, 1] = self.unit
        table[:, 2] = dev_id
        table[:, 3] = self.unit
        table[:, 4] = self.counts[keep]
        return table

    def first_entries(self, addrs: Int64Array, lengths: Int64Array) -> Int64Array | None:
        """The entry each descriptor starts at, or None when one does not lie on this grid."""
        found = locate(addrs, lengths, self.starts, self.lengths)
        if found is None:
            return None
        span, off = found
        rel = off - self.origins[span]
        first = rel // self.unit
        fits = (rel >= 0) & (rel % self.unit == 0) & (first + lengths // self.unit <= self.counts[span])
        if not bool(fits.all()):
            return None
        return np.asarray(self.bases[span] + first, dtype=np.int64)


def locate(addrs: Int64Array, lengths: Int64Array, starts: Int64Array,
           span_lengths: Int64Array) -> tuple[Int64Array, Int64Array] | None:
    """``(span index, offset in it)`` of each descriptor, or None when one leaves every span."""
    span = (np.searchsorted(starts, addrs, side="right") - 1).astype(np.int64)
    if span.size and int(span.min()) < 0:
        return None
    off = addrs - starts[span]
    if bool((off + lengths > span_lengths[span]).any()):
        return None
    return span, off


def sorted_spans(spans: Sequence[tuple[int, int]]) -> tuple[Int64Array, Int64Array]:
    ordered = sorted((int(a), int(n)) for a, n in spans)
    return (np.array([a for a, _ in ordered], dtype=np.int64), np.array([n for _, n in ordered], dtype=np.int64))


def fit_grids(
    sides: tuple[Int64Array, Int64Array],
    lengths: Int64Array,
    spans: tuple[Sequence[tuple[int, int]], Sequence[tuple[int, int]]],
    previous: tuple[Grid, Grid] | None,
) -> tuple[Grid, Grid] | None:
    """The coarsest ``(local, remote)`` grids, of one unit, that tile every descriptor of this plan and every
    entry of ``previous`` (the grids of the spans as they were); None when a descriptor leaves every span."""
    unit = int(np.gcd.reduce(lengths))
    if previous is not None:
        unit = int(np.gcd(unit, previous[0].unit))
    placed = []
    for i, addrs in enumerate(sides):
        starts, span_lengths = sorted_spans(spans[i])
        found = locate(addrs, lengths, starts, span_lengths)
        if found is None:
            return None
        span, off = found
        if previous is not None:
            ref = previous[i].origins.copy()
        else:  # each span's lowest offset in this plan; untouched spans start at 0
            ref = np.full(starts.size, np.iinfo(np.int64).max, dtype=np.int64)
            np.minimum.at(ref, span, off)
            ref[ref == np.iinfo(np.int64).max] = 0
        unit = int(np.gcd(unit, np.gcd.reduce(np.abs(off - ref[span])))) if off.size else unit
        placed.append((starts, span_lengths, ref))
    grids = [Grid(unit, starts, span_lengths, ref % unit) for starts, span_lengths, ref in placed]
    return grids[0], grids[1]


class PeerLists:
    """One peer's prepared local and remote lists, and the grids they were made over."""

    def __init__(self, agent: Any, peer: str, grids: tuple[Grid, Grid], memory: tuple[str, int],
                 key: tuple[object, ...]) -> None:
        mem_type, dev_id = memory
        self.grids, self.key = grids, key
        self.local = agent.prep_xfer_dlist(LOCAL, grids[0].rows(dev_id), mem_type)
        try:
            self.remote = agent.prep_xfer_dlist(peer, grids[1].rows(dev_id), mem_type)
        except Exception:
            self.local.release()
            raise

    def prepared(self, local: Int64Array, remote: Int64Array, lengths: Int64Array) -> Prepared | None:
        """The plan as index arrays into these lists, or None when a descriptor is off either grid."""
        unit = self.grids[0].unit
        if bool((lengths % unit).any()):
            return None
        first_l = self.grids[0].first_entries(local, lengths)
        first_r = self.grids[1].first_entries(remote, lengths)
        if first_l is None or first_r is None:
            return None
        per = lengths // unit
        if bool((per == 1).all()):  # one entry per descriptor (scattered blocks): no expansion
            bounds = np.arange(per.size + 1, dtype=np.int64)
            return Prepared(self, first_l.astype(np.int32), first_r.astype(np.int32), bounds)
        bounds = np.concatenate(([0], np.cumsum(per))).astype(np.int64)
        step = np.arange(int(bounds[-1]), dtype=np.int64) - np.repeat(bounds[:-1], per)  # 0..k-1 per descriptor
        lidx = (np.repeat(first_l, per) + step).astype(np.int32)
        ridx = (np.repeat(first_r, per) + step).astype(np.int32)
        return Prepared(self, lidx, ridx, bounds)


@dataclass(frozen=True)
class Prepared:
    """One plan mapped onto a peer's lists: ``bounds[i]:bounds[i+1]`` are descriptor ``i``'s entries. It keeps
    the lists alive while its transfer uses them."""

    lists: PeerLists
    local: IndexArray
    remote: IndexArray
    bounds: Int64Array

    def chunk(self, start: int, stop: int) -> tuple[IndexArray, IndexArray]:
        """Index arrays for plan descriptors ``[start, stop)``."""
        lo, hi = int(self.bounds[start]), int(self.bounds[stop])
        return self.local[lo:hi], self.remote[lo:hi]


class Prepper:
    """The transport's prepared lists, per peer, and the counters of which path each plan took.

    ``plan`` runs under the transport's lock; the caller drops a peer's lists (``drop``) when the peer is
    replaced and all of them (``drop_all``) before its agent goes.
    """

    def __init__(self) -> None:
        self.stats = PrepStats()
        self.enabled = True  # False: every plan goes the unprepared way (the bench's comparison)
        self._lists: dict[str, PeerLists] = {}

    def plan(
        self,
        agent: Any,
        peer: str,
        sides: tuple[Int64Array, Int64Array],
        lengths: Int64Array,
        spans: tuple[Sequence[tuple[int, int]], Sequence[tuple[int, int]] | None],
        memory: tuple[str, int],
    ) -> Prepared | None:
        """``sides`` are the plan's (local, remote) addresses; None means: post it unprepared."""
        local_spans, remote_spans = spans
        if not lengths.size:
            return None
        if not self.enabled:
            self.stats.fell_back("disabled")
            return None
        if remote_spans is None:
            self.stats.fell_back("peer published no spans")
            return None
        key = (tuple(local_spans), tuple(remote_spans))
        lists = self._lists.get(peer)
        if lists is not None and lists.key == key:
            began = time.perf_counter()
            prepared = lists.prepared(sides[0], sides[1], lengths)
            if prepared is not None:
                self.stats.made(True, time.perf_counter() - began)
                self.stats.prepped += 1
                return prepared
        previous = lists.grids if lists is not None and lists.key == key else None
        grids = fit_grids(sides, lengths, (local_spans, remote_spans), previous)
        if grids is None:
            self.stats.fell_back("descriptor outside the registered spans")
            return None
        if max(grids[0].entries, grids[1].entries) > MAX_ENTRIES:
            self.stats.fell_back(f"grid of {grids[0].unit} B units over MAX_ENTRIES")
            return None
        self._lists.pop(peer, None)  # released once no transfer holds it
        began = time.perf_counter()
        try:
            lists = PeerLists(agent, peer, grids, memory, key)
        except Exception as e:  # NIXL refused the lists: the plan still moves, unprepared
            self.stats.fell_back(f"prep_xfer_dlist raised {type(e).__name__}")
            return None
        self.stats.prep_ms += (time.perf_counter() - began) * 1e3
        self.stats.preps += 1
        self._lists[peer] = lists
        began = time.perf_counter()
        prepared = lists.prepared(sides[0], sides[1], lengths)
        self.stats.made(True, time.perf_counter() - began)
        if prepared is None:  # cannot happen: the grids were fitted to this plan
            self.stats.fell_back("plan off its own grid")
            return None
        self.stats.prepped += 1
        return prepared

    def peers(self) -> list[str]:
        return list(self._lists)

    def drop(self, peer: str) -> None:
        """Forget a peer's lists; NIXL releases them when the last transfer using them lets go."""
        self._lists.pop(peer, None)

    def drop_all(self) -> None:
        """Release every list now (the agent is about to go; its transfers were abandoned first)."""
        for lists in self._lists.values():
            for handle in (lists.local, lists.remote):
                try:
                    handle.release()
                except Exception:  # released with the agent anyway
                    pass
        self._lists = {}
