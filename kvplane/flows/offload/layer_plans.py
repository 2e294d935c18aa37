"""Copy plans for many layers at once: one set of array operations, then a cheap slice per layer.

``block_copy_plan`` builds one layer's plan; called once per layer it costs tens of microseconds each (61
layers of DeepSeek-V3 = a few ms per request of Python on the engine's thread, which on the cpu backend also
holds up the copy worker). ``LayerPlanner`` stacks every (layer, slot) region pair of one KV-cache group into
arrays of bases and strides, computes all addresses with one broadcast, coalesces them in one pass that never
merges across a layer boundary (one C pass, ``plan_blocks`` in ``kvplane/_native/memcpy.c``, where the extension
is built; numpy otherwise), and hands out the whole plan with each layer's bounds in it (``parts``; the
engine enqueues it as one batch) or each layer's plan as views (``plans``). The plans equal what
``block_copy_plan`` gives for the same ids (tests compare them). Where both sides are cross-layer (block ``i`` of
every layer is one range on each side: vLLM's one tensor for all layers against the host pool), the planner is
``merged``: one descriptor per block for every layer, all in the first layer's part.

The native pass writes into a ``PlanBuffers`` array when the planner has one (the engine's copier shares one
among its planners and gives a plan's array back once its copies completed): a request's plan is hundreds of
KiB (38,125 descriptors for DeepSeek-V3's 10k tokens), and a fresh array each time cost about 0.2 ms per
request with cold caches (page faults and misses on new memory), against 0.05 ms reusing one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

from kvplane._native import optional
from kvplane.blocks.groups import INT64, Ids, is_ids
from kvplane.descriptors import CopyPlan, Region
from kvplane.errors import PlanError

SPARE_PLANS = 4  # plan arrays a PlanBuffers keeps for reuse: one per request in flight covers a step
SPARE_BYTES = 64 << 20  # ... and never more bytes than this (a 1M-token plan is not kept)
SLICES = 8  # a merged (cross-layer) load is cut into this many runs of layers: see LayerPlanner.sliced_parts

# the cpu backend's memcpy extension (an extension built before it had plan_blocks, or none: the numpy passes
# below do the work) and the host index's (min, max) of an id array in one C loop
_native, _ = optional("_memcpy")
_plan_blocks: Callable[..., int] | None = getattr(_native, "plan_blocks", None)
_span: Callable[[Ids], tuple[int, int]] | None = getattr(optional("_keytable")[0], "span", None)


def planned(src: Ids, dst: Ids, length: Ids) -> CopyPlan:
    """A ``CopyPlan`` over rows the native pass wrote: 1-D contiguous int64 views of one array, every length a
    sum of regions' ``block_bytes`` (at least 1, checked when each ``Region`` was made). ``CopyPlan``'s checks
    of arbitrary input are skipped: over 38,125 descriptors (DeepSeek-V3, 10k tokens) its ``min()`` pass and
    attribute checks cost about 50 us per request with cold caches."""
    plan: CopyPlan = object.__new__(CopyPlan)
    object.__setattr__(plan, "src", src)
    object.__setattr__(plan, "dst", dst)
    object.__setattr__(plan, "length", length)
    return plan


class PlanBuffers:
    """Spare ``(3, n)`` int64 arrays (src, dst, length rows) that native plans are written into.

    ``take`` hands out a spare at least ``n`` wide, or a new one; ``give_back(plan)`` returns the array under a
    plan from ``take`` once nothing reads the plan any more (its copies completed); a plan over any other
    memory is ignored, and a plan given back twice is kept once. Engine thread only: no lock.
    """

    def __init__(self, keep: int = SPARE_PLANS, max_bytes: int = SPARE_BYTES) -> None:
        self._spare: list[np.ndarray] = []
        self._keep, self._max_bytes = keep, max_bytes

    def take(self, n: int) -> np.ndarray:
        spare = self._spare
        for i in range(len(spare)):
            if spare[i].shape[1] >= n:
                return spare.pop(i)
        return np.empty((3, n), dtype=np.int64)

    def give_back(self, plan: CopyPlan) -> None:
        base = plan.src.base
        spare = self._spare
        if (
            type(base) is np.ndarray and base.ndim == 2 and base.shape[0] == 3 and base.dtype is INT64
            and plan.dst.base is base and plan.length.base is base and len(spare) < self._keep
            and base.nbytes + sum([b.nbytes for b in spare]) <= self._max_bytes
            and all([b is not base for b in spare])
        ):
            spare.append(base)


class LayerPlanner:
    """Plans from ``src`` regions to ``dst`` regions for the layers of one group, in the order given."""

    def __init__(
        self,
        layers: Sequence[str],
        src: Mapping[str, Sequence[Region]],
        dst: Mapping[str, Sequence[Region]],
        buffers: PlanBuffers | None = None,
    ):
        self.layers = list(layers)
        self._buffers = buffers
        pairs = [(s, d) for name in self.layers for s, d in zip(src[name], dst[name], strict=True)]
        for s, d in pairs:
            if s.block_bytes != d.block_bytes:
                raise PlanError(
                    f"layer {s.layer_name!r} slot {s.slot!r}: block bytes differ ({s.block_bytes} vs "
                    f"{d.block_bytes}); a local block copy needs the same layout on both sides"
                )
        self._src_base = np.array([s.addr for s, _ in pairs], dtype=np.int64)[:, None]
        self._src_stride = np.array([s.block_stride for s, _ in pairs], dtype=np.int64)[:, None]
        self._dst_base = np.array([d.addr for _, d in pairs], dtype=np.int64)[:, None]
        self._dst_stride = np.array([d.block_stride for _, d in pairs], dtype=np.int64)[:, None]
        self._bytes = np.array([s.block_bytes for s, _ in pairs], dtype=np.int64)[:, None]
        self._src_blocks = min((s.num_blocks for s, _ in pairs), default=0)
        self._dst_blocks = min((d.num_blocks for _, d in pairs), default=0)
        self._rows = np.cumsum([0] + [len(src[name]) for name in self.layers]).astype(np.int64)  # rows per layer
        # the same per-row values as flat contiguous arrays, for the native pass
        self._flat = np.ascontiguousarray(
            np.stack([self._src_base[:, 0], self._src_stride[:, 0], self._dst_base[:, 0], self._dst_stride[:, 0],
                      self._bytes[:, 0]]) if pairs else np.zeros((5, 0), dtype=np.int64)
        )
        sb, ss, db, ds, nb = self._flat
        # cross-layer on both sides (vLLM's one tensor for all layers, against the host pool's blocks): block i
        # of every layer is one range, so one row plans them all: one descriptor per block for the whole group
        self.merged = len(pairs) > 1 and bool(
            (ss == ss[0]).all() and (ds == ds[0]).all()
            and (sb[1:] == sb[:-1] + nb[:-1]).all() and (db[1:] == db[:-1] + nb[:-1]).all()
        )
        self._sliced: tuple[np.ndarray, np.ndarray, list[int]] | None = None  # (flat rows, row bounds, firsts)
        if self.merged:
            self._slice_rows(sb, ss, db, ds, nb)
            self._src_base, self._src_stride = self._src_base[:1], self._src_stride[:1]
            self._dst_base, self._dst_stride = self._dst_base[:1], self._dst_stride[:1]
            self._bytes = np.array([[int(nb.sum())]], dtype=np.int64)
            self._flat = np.ascontiguousarray(np.array([[sb[0]], [ss[0]], [db[0]], [ds[0]], [int(nb.sum())]]))
            self._rows = np.array([0, 1], dtype=np.int64)

    def _slice_rows(self, sb: np.ndarray, ss: np.ndarray, db: np.ndarray, ds: np.ndarray, nb: np.ndarray) -> None:
        """For ``sliced_parts``: each block's one range cut into ``SLICES`` runs of consecutive layers, one row
        per run (its byte offset into the block, its length), so a merged load can complete layers in order."""
        per_layer = np.add.reduceat(nb, self._rows[:-1]) if len(self.layers) else np.zeros(0, dtype=np.int64)
        size = -(-len(self.layers) // SLICES)
        firsts = list(range(0, len(self.layers), size))  # the first layer of each run
        offsets = np.concatenate(([0], np.cumsum(per_layer)))[firsts]
        lengths = np.add.reduceat(per_layer, firsts)
        k = len(firsts)
        flat = np.ascontiguousarray(np.stack([
            sb[0] + offsets, np.full(k, ss[0]), db[0] + offsets, np.full(k, ds[0]), lengths,
        ]).astype(np.int64))
        self._sliced = (flat, np.arange(k + 1, dtype=np.int64), firsts)

    def sliced_parts(self, src_ids: Ids, dst_ids: Ids) -> tuple[CopyPlan, list[int]]:
        """``parts`` for a load: where the planner is ``merged``, each block's range is cut into up to
        ``SLICES`` runs of consecutive layers, and a run's descriptors (every block's piece of it) are the part
        of its first layer (the run's other layers have empty parts after it), so layer ``i``'s event completes
        once the runs up to its own did, not after every layer: a layer-wise load keeps its overlap at about
        ``SLICES`` times the descriptors of one range per block (8 x 625 = 5,000 of 144 KiB for DeepSeek-V3's
        10k tokens, where per-layer blocks are 38,125 of 18 KiB). Otherwise it is ``parts``."""
        if self._sliced is None:
            return self.parts(src_ids, dst_ids)
        flat, rows, firsts = self._sliced
        plan, run_bounds = self._parts(src_ids, dst_ids, flat, rows)
        bounds = [0] * (len(self.layers) + 1)
        for r, first in enumerate(firsts):
            last = firsts[r + 1] if r + 1 < len(firsts) else len(self.layers)
            bounds[first + 1 : last + 1] = [run_bounds[r + 1]] * (last - first)
        return plan, bounds

    def plans(self, src_ids: Ids, dst_ids: Ids) -> dict[str, CopyPlan]:
        """Every layer's plan copying block ``src_ids[i]`` into ``dst_ids[i]``, coalesced."""
        plan, bounds = self.parts(src_ids, dst_ids)
        return {
            name: CopyPlan(plan.src[a:b], plan.dst[a:b], plan.length[a:b])
            for name, a, b in zip(self.layers, bounds[:-1], bounds[1:])
        }

    def parts(self, src_ids: Ids, dst_ids: Ids) -> tuple[CopyPlan, list[int]]:
        """All layers' descriptors as one coalesced plan, and ``bounds``: layer ``i`` (in ``self.layers``
        order) is descriptors ``[bounds[i], bounds[i + 1])``. A ``merged`` planner's plan covers every layer at
        once: it is all in the first layer's part (the others are empty), so an event after that part is an
        event after every layer; callers must not start it before every layer's KV is written."""
        plan, bounds = self._parts(src_ids, dst_ids, self._flat, self._rows)
        if self.merged:
            return plan, [0] + [len(plan)] * len(self.layers)
        return plan, bounds

    def _parts(self, src_ids: Ids, dst_ids: Ids, flat: np.ndarray, rows: np.ndarray) -> tuple[CopyPlan, list[int]]:
        """The plan over ``flat`` (rows of src base, src stride, dst base, dst stride, bytes) with ``rows[i]``
        the first row of part ``i``; a descriptor never merges across a part's start."""
        if src_ids.shape != dst_ids.shape:
            raise PlanError(f"{src_ids.size} source block ids but {dst_ids.size} destination ids; pass equal counts")
        n = src_ids.size
        if n == 0:
            return CopyPlan.empty(), [0] * (len(self.layers) + 1)
        self._check("source", src_ids, self._src_blocks)
        self._check("destination", dst_ids, self._dst_blocks)
        if _native is not None and _plan_blocks is not None:  # tests set _native to None for the numpy passes
            out = self._buffers.take(flat.shape[1] * n) if self._buffers is not None else None
            return self._parts_native(_plan_blocks, _contiguous(src_ids), _contiguous(dst_ids), flat, rows, out)
        src_base, src_stride, dst_base, dst_stride, nbytes = (row[:, None] for row in flat)
        src = (src_base + src_ids[None, :] * src_stride).ravel()
        dst = (dst_base + dst_ids[None, :] * dst_stride).ravel()
        length = np.broadcast_to(nbytes, (nbytes.shape[0], n)).ravel()
        follows = (src[1:] == src[:-1] + length[:-1]) & (dst[1:] == dst[:-1] + length[:-1])
        layer_starts = rows[:-1] * n  # descriptor index where each layer begins: never merged into
        keep = np.ones(src.size, dtype=np.bool_)
        keep[1:] = ~follows
        keep[layer_starts] = True
        starts = np.flatnonzero(keep)
        ends = np.append(starts[1:], src.size)
        csum = np.concatenate(([0], np.cumsum(length)))
        c_src, c_dst = src[starts], dst[starts]
        c_len = (csum[ends] - csum[starts]).astype(np.int64)
        bounds = np.searchsorted(starts, rows * n)
        return CopyPlan(c_src, c_dst, c_len), bounds.tolist()

    @staticmethod
    def _parts_native(
        plan_blocks: Callable[..., int], src_ids: Ids, dst_ids: Ids, flat: np.ndarray, rows: np.ndarray,
        out: np.ndarray | None = None,
    ) -> tuple[CopyPlan, list[int]]:
        if out is None:
            out = np.empty((3, flat.shape[1] * src_ids.size), dtype=np.int64)
        bounds = np.empty(len(rows), dtype=np.int64)
        count = plan_blocks(flat[0], flat[1], flat[2], flat[3], flat[4],
                            rows, src_ids, dst_ids, out[0], out[1], out[2], bounds)
        return planned(out[0, :count], out[1, :count], out[2, :count]), bounds.tolist()

    @staticmethod
    def _check(side: str, ids: Ids, num_blocks: int) -> None:
        if _span is not None and is_ids(ids):
            low, high = _span(ids)  # numpy's reductions cost tens of us of cold code per request
        else:
            low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= num_blocks:
            raise PlanError(
                f"{side} block id {low if low < 0 else high} is out of range: the regions have blocks "
                f"0..{num_blocks - 1}; pass ids allocated from this cache"
            )


def _contiguous(ids: Ids) -> Ids:
    return ids if is_ids(ids) else np.ascontiguousarray(ids, np.int64)
