"""Starting one decode request's transfer: staging room, the plans per prefill rank, READs or the push
registration, and the re-layout of staged blocks once the bytes landed.

``DecodeSide`` (on its I/O loop) calls ``start`` once every prefill rank the request needs handshook, and
``relayout`` once nothing moves into the request's blocks any more; READs go to the side's transfer thread.
A pull stages in bounded chunks (``staged_pull``: READ a chunk, re-lay it out off the loop, reuse the range),
so it needs ``staging_bytes`` to hold one source block, not the request; its ``relayout`` has nothing left to
do. A push stages the whole request in one range, re-laid out by ``relayout`` on the loop: the prefill writes
the request into the range the registration names, and the protocol has no per-chunk flow control.

Tokens this rank holds already (``Want.local_tokens``) are left out: ``start`` fixes the first token moved per
group against the prefill's block sizes (``routes.first_tokens``), every plan here starts there, and a push's
registration names it (``PushRegister.first_tokens``), so the prefill plans the same writes.
"""

from __future__ import annotations

import logging
from functools import partial

import numpy as np

from kvplane.blocks.groups import Ids
from kvplane.flows.disagg.decode.decode_kit import DecodeKit
from kvplane.flows.disagg.decode.rank_manifests import check_alike
from kvplane.flows.disagg.decode.records import Conn, PullPlan, PushPlan, Want
from kvplane.flows.disagg.decode.staged_pull import StagedPull
from kvplane.flows.disagg.decode.staging_chunks import Chunk, chunk_bound, split_staged
from kvplane.flows.disagg.wire import channel
from kvplane.flows.disagg.wire.errors import DisaggError
from kvplane.flows.disagg.wire.messages import PushRegister
from kvplane.flows.disagg.wire.routes import (
    after_first,
    first_tokens,
    layers_by_source,
    route_plan,
)
from kvplane.flows.disagg.wire.staging import ALIGN
from kvplane.kv.manifest import Manifest
from kvplane.plan.planner import StagedLayer, TransferPlan
from kvplane.plan.relayout import apply_relayout
from kvplane.runtime.executor import Executor

logger = logging.getLogger("kvplane.disagg")
Direct = dict[int, TransferPlan | None]  # per prefill rank: the plan of its layers that land directly
WHOLE = (0, 1 << 62)  # plan as if the whole request had one range: only the sizes and offsets are read


def _stride(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class Starter:
    def __init__(self, kit: DecodeKit) -> None:
        self.kit = kit
        self.relayouts = Executor(f"kvplane-decode-{kit.local.config.rank}-relayout")

    def close(self) -> None:
        """Drop re-layouts not begun (their chunks end failed), and wait for a running one to end; a device that
        hangs it is logged after ``transfer_timeout_s``, and the side closes anyway."""
        timeout_s = self.kit.local.config.transfer_timeout_s
        if not self.relayouts.close(discard_pending=True, timeout_s=timeout_s):
            logger.error("decode rank %d: a re-layout of staged blocks did not end within transfer_timeout_s=%s; "
                         "closing the side with it still running", self.kit.local.config.rank, timeout_s)

    def start(self, want: Want) -> set[int] | None:
        """Plan the request, take its staging room and submit its READs (pull) or send its registration (push):
        the prefill ranks it went to, or None while no staging room is free (retried on each tick until its
        deadline). Raises ``KvplaneError`` when it cannot be planned; nothing was submitted then."""
        sources = layers_by_source(self.kit.local.manifest, want.params.tp_size, want.params.remote_request_id)
        srcs = [conn.record.manifest for conn in want.conns if conn.record is not None]
        want.first = first_tokens(srcs, self.kit.local.manifest, want.local_tokens, want.num_tokens)
        if want.mode == "pull":
            pull = self._plan_pull(want, sources)
            return None if pull is None else self._start_reads(want, *pull)
        staging = self._take_staging(want, sources)
        return None if staging is None else self._start_push(want, staging)

    def _take_staging(self, want: Want, sources: dict[int, list[str]]
                      ) -> dict[int, tuple[int, int, TransferPlan]] | None:
        """A push's staging ``(offset, bytes, plan)`` per prefill rank that needs it, for the whole request; None
        when the arena is full for now. All ranks' ranges are taken or none: their summed need is checked against
        the buffer before anything is taken. Planned once while it waits for room (see ``_plan_pull``)."""
        arena = self.kit.local.arena
        records = tuple(conn.record for conn in want.conns)
        if not isinstance(want.planned, PushPlan) or not want.planned.made_from(records):
            want.planned = PushPlan(tuple(r for r in records if r is not None), self._plan_push(want, sources))
        plans = want.planned.plans
        needs = {rank: tp.staging_bytes for rank, tp in plans.items()}
        sizes = list(needs.values())  # taken in this order; only the last may end in the buffer's unaligned tail
        total = sum(_stride(n) for n in sizes[:-1]) + (sizes[-1] if sizes else 0)
        if total > arena.size:
            per_rank = ", ".join(f"rank {r}: {n} B" for r, n in needs.items())
            raise DisaggError(
                f"a push stages the whole request at once (the prefill writes into one range; a pull stages "
                f"in bounded chunks): request {want.request_id!r} needs {total} B ({per_rank}) but "
                f"DisaggConfig.staging_bytes={arena.size}; raise it to at least {total}, or pull requests this large"
            )
        out: dict[int, tuple[int, int, TransferPlan]] = {}
        for rank, need in needs.items():
            offset = arena.take(need)
            if offset is None:
                for o, _, _ in out.values():
                    arena.give(o)
                return None
            out[rank] = (offset, need, plans[rank])
        want.planned = None
        return out

    def _plan_push(self, want: Want, sources: dict[int, list[str]]) -> dict[int, TransferPlan]:
        """The plan of each prefill rank whose layers a push stages, made once: the layers this rank re-lays out
        once the push landed, and the staging bytes they take. Planned as if the range started at 0: the staged
        layers' offsets are relative to the range, so the plan holds wherever the range is taken."""
        plans: dict[int, TransferPlan] = {}
        for rank, layers in sources.items():
            conn = want.conns[rank]
            assert conn.record is not None
            key = tuple(layers)
            if conn.stages.get(key, True):
                tp = route_plan(conn.record.manifest, self.kit.local.manifest, _stand_in_ids(conn, want.num_tokens),
                                want.block_ids, want.num_tokens, layers, WHOLE, want.first)
                conn.stages[key] = tp.staging_bytes > 0
                if tp.staging_bytes:
                    plans[rank] = tp
        return plans

    def _plan_pull(self, want: Want, sources: dict[int, list[str]]) -> tuple[Direct, list[Chunk], int, int] | None:
        """Per prefill rank the plan of its layers that land directly, the chunks staging the rest, and the
        range taken for them (offset, slot count); None when the arena has no room for now. A request waiting
        for room retries on every tick: it plans once and reuses the plan while its connections' peer records
        (the manifests it was planned against) stay the same."""
        records = tuple(conn.record for conn in want.conns)
        if not isinstance(want.planned, PullPlan) or not want.planned.made_from(records):
            direct, chunks, slots = self._plan_chunks(want, sources)
            want.planned = PullPlan(tuple(r for r in records if r is not None), direct, chunks, slots)
        planned = want.planned
        direct, chunks, slots = planned.direct, planned.chunks, planned.slots
        if not chunks:
            want.planned = None
            return direct, [], -1, 0
        slot_bytes = max(c.nbytes for c in chunks)
        offset = self.kit.local.arena.take(_stride(slot_bytes) * (slots - 1) + slot_bytes)
        if offset is None and slots > 1:  # other requests hold part of the buffer: one chunk at a time
            slots, offset = 1, self.kit.local.arena.take(slot_bytes)
        if offset is None:
            return None
        want.planned = None
        return direct, chunks, offset, slots

    def _plan_chunks(self, want: Want, sources: dict[int, list[str]]) -> tuple[Direct, list[Chunk], int]:
        """Per prefill rank the plan of its layers that land directly, and the chunks staging the rest, with
        how many may be in flight at once. The ranks must store their KV alike (``rank_manifests``): what is
        staged is decided per layer for all of them."""
        manifests = {}
        for rank in sources:
            record = want.conns[rank].record
            assert record is not None  # every rank handshook before the request started
            manifests[rank] = record.manifest
        check_alike(want.params.remote_engine_id, manifests)
        direct: Direct = {}
        staged: list[tuple[int, tuple[StagedLayer, ...]]] = []
        for rank, layers in sources.items():
            conn = want.conns[rank]
            assert conn.record is not None
            src, key = conn.record.manifest, tuple(layers)
            whole = self._route(want, src, layers, WHOLE if conn.stages.get(key, True) else None)
            conn.stages[key] = bool(whole.staged)
            if not whole.staged:
                direct[rank] = whole
                continue
            names = {layer.layer_name for layer in whole.staged}
            rest = [name for name in layers if name not in names]
            direct[rank] = self._route(want, src, rest, None) if rest else None
            staged.append((rank, whole.staged))
        if not staged:
            return direct, [], 0
        bound, slots = chunk_bound(self.kit.local.arena.size, [x for _, of_rank in staged for x in of_rank])
        chunks: list[Chunk] = []
        for rank, of_rank in staged:
            remote = after_first(manifests[rank], self.kit.local.manifest, want.remote_ids, want.block_ids,
                                 want.num_tokens, want.first)[0]  # the plan's source blocks start at want.first
            ids = {x.layer_name: remote[self.kit.local.spec.layer(x.layer_name).group_id] for x in of_rank}
            chunks += split_staged(rank, of_rank, ids, bound)
        return direct, chunks, min(slots, len(chunks))

    def _route(self, want: Want, src: Manifest, layers: list[str], staging: tuple[int, int] | None) -> TransferPlan:
        return route_plan(src, self.kit.local.manifest, want.remote_ids, want.block_ids, want.num_tokens, layers,
                          staging, want.first)

    def _start_reads(self, want: Want, direct: Direct, chunks: list[Chunk], offset: int, slots: int) -> set[int]:
        pull = None
        if chunks:
            slot_bytes = max(c.nbytes for c in chunks)
            pull = StagedPull(self.kit, want, chunks, offset, [offset + i * _stride(slot_bytes) for i in range(slots)],
                              slot_bytes, {rank for rank, tp in direct.items() if tp is not None}, self.relayouts)
        for rank, tp in direct.items():
            conn = want.conns[rank]
            assert conn.record is not None
            if tp is None:
                continue
            ended = partial(pull.direct_ended, rank) if pull is not None and rank in pull.ranks \
                else partial(self.kit.moved, want, rank)
            self.kit.mover.put(conn.record.handle, tp.plan, ended)
        if pull is not None:
            pull.pump()
        return set(direct)

    def _start_push(self, want: Want, staging: dict[int, tuple[int, int, TransferPlan]]) -> set[int]:
        want.staged.extend(staging.values())  # the staged layers each rank re-lays out once the push lands
        for conn in want.conns:
            assert conn.record is not None
            area = staging.get(conn.rank)
            channel.send(conn.socket, PushRegister(
                request_id=want.params.remote_request_id,
                engine_id=self.kit.local.config.engine_id,
                rank=self.kit.local.config.rank,
                tp_size=self.kit.local.config.tp_size,
                block_ids={g: ids.tolist() for g, ids in want.block_ids.items()},
                num_tokens=want.num_tokens,
                staging_addr=self.kit.local.staging_addr + area[0] if area else 0,
                staging_bytes=area[1] if area else 0,
                expect_boot=conn.record.boot_id,
                token=want.params.kvplane_token,
                first_tokens={g: t for g, t in want.first.items() if t},
            ), self.kit.counters)
        return set(range(want.params.tp_size))

    def relayout(self, want: Want) -> None:
        staging = self.kit.local.staging
        if not want.staged or staging is None:
            return
        for offset, nbytes, tp in want.staged:
            area = staging[offset : offset + nbytes]
            for staged in tp.staged:
                layer = self.kit.local.spec.layer(staged.layer_name)
                apply_relayout(staged, area, layer, self.kit.local.layouts[layer.family],
                               self.kit.local.kv_caches[staged.layer_name])
        self.kit.local.backend.synchronize()


def _stand_in_ids(conn: Conn, num_tokens: int) -> dict[int, Ids]:
    """Source block ids for sizing and planning a push here: the prefill's ids are not known on this side,
    and where staged layers land depends only on how many source blocks the tokens take."""
    assert conn.record is not None
    spec = conn.record.manifest.spec
    return {g.group_id: np.zeros(-(-num_tokens // g.tokens_per_block), dtype=np.int64) for g in spec.groups}
