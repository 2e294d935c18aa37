"""Starting one decode request's transfer: staging room, the plans per prefill rank, READs or the push
registration, and the re-layout of staged blocks once the bytes landed.

``DecodeSide`` (on its I/O loop) calls ``start`` once every prefill rank the request needs handshook, and
``relayout`` once nothing moves into the request's blocks any more; READs go to the side's transfer thread.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

import numpy as np

from kvplane.blocks.groups import Ids
from kvplane.errors import KvplaneError
from kvplane.flows.disagg import channel
from kvplane.flows.disagg.messages import PushRegister
from kvplane.flows.disagg.records import Conn, Want
from kvplane.flows.disagg.routes import layers_by_source, route_plan, staging_needed
from kvplane.plan.relayout import apply_relayout

if TYPE_CHECKING:
    from kvplane.flows.disagg.decode import DecodeSide


class Starter:
    def __init__(self, side: DecodeSide) -> None:
        self.side = side

    def start(self, want: Want) -> None:
        try:
            sources = layers_by_source(self.side.local.manifest, want.params.tp_size, want.params.remote_request_id)
            staging = self._take_staging(want, sources)
        except KvplaneError as e:
            self._cannot_plan(want, e)
            return
        if staging is None:
            want.waiting_staging = True  # retried on each tick until room frees or the deadline passes
            return
        want.waiting_staging = False
        try:
            if want.mode == "pull":
                self._start_reads(want, sources, staging)
            else:
                self._start_push(want, sources, staging)
        except KvplaneError as e:
            self._cannot_plan(want, e)

    def _cannot_plan(self, want: Want, error: KvplaneError) -> None:
        """Fail the request and tell the prefill ranks (a pull's ``ReadDone``, a push's ``Cancel``), so they free
        its blocks now instead of at the end of their lease. No push registration was sent yet."""
        self.side._cannot_plan(want, str(error))

    def _take_staging(self, want: Want, sources: dict[int, list[str]]) -> dict[int, tuple[int, int]] | None:
        """Staging ``(offset, bytes)`` per prefill rank that needs it; None when the arena is full for now."""
        out: dict[int, tuple[int, int]] = {}
        for rank, layers in sources.items():
            conn = want.conns[rank]
            assert conn.record is not None
            key = tuple(layers)
            if conn.stages.get(key, True):
                src_ids = want.remote_ids if want.mode == "pull" else _stand_in_ids(conn, want.num_tokens)
                need = staging_needed(conn.record.manifest, self.side.local.manifest, src_ids, want.block_ids,
                                      want.num_tokens, layers)
                conn.stages[key] = need > 0
                if need:
                    offset = self.side.local.arena.take(need)
                    if offset is None:
                        for o, _ in out.values():
                            self.side.local.arena.give(o)
                        return None
                    out[rank] = (offset, need)
        return out

    def _start_reads(self, want: Want, sources: dict[int, list[str]], staging: dict[int, tuple[int, int]]) -> None:
        plans = []
        for rank, layers in sources.items():
            conn = want.conns[rank]
            assert conn.record is not None
            area = staging.get(rank)
            tp = route_plan(conn.record.manifest, self.side.local.manifest, want.remote_ids, want.block_ids,
                            want.num_tokens, layers,
                            (self.side.local.staging_addr + area[0], area[1]) if area else None)
            if area:
                want.staged.append((area[0], area[1], tp))
            plans.append((rank, conn, tp))
        want.pending = {rank for rank, _, _ in plans}
        for rank, conn, tp in plans:
            assert conn.record is not None
            self.side._mover.put(conn.record.handle, tp.plan, partial(self.side._moved, want, rank))

    def _start_push(self, want: Want, sources: dict[int, list[str]], staging: dict[int, tuple[int, int]]) -> None:
        for rank, layers in sources.items():
            area = staging.get(rank)
            if area:  # plan here too, for the staged layers this rank re-lays out once the push lands
                conn = want.conns[rank]
                assert conn.record is not None
                tp = route_plan(conn.record.manifest, self.side.local.manifest, _stand_in_ids(conn, want.num_tokens),
                                want.block_ids, want.num_tokens, layers, (self.side.local.staging_addr + area[0], area[1]))
                want.staged.append((area[0], area[1], tp))
        want.pending = set(range(want.params.tp_size))
        for conn in want.conns:
            assert conn.record is not None
            area = staging.get(conn.rank)
            channel.send(conn.socket, PushRegister(
                request_id=want.params.remote_request_id,
                engine_id=self.side.config.engine_id,
                rank=self.side.config.rank,
                tp_size=self.side.config.tp_size,
                block_ids={g: ids.tolist() for g, ids in want.block_ids.items()},
                num_tokens=want.num_tokens,
                staging_addr=self.side.local.staging_addr + area[0] if area else 0,
                staging_bytes=area[1] if area else 0,
                expect_boot=conn.record.boot_id,
                token=want.params.kvplane_token,
            ), self.side.counters)

    def relayout(self, want: Want) -> None:
        staging = self.side.local.staging
        if not want.staged or staging is None:
            return
        for offset, nbytes, tp in want.staged:
            area = staging[offset : offset + nbytes]
            for staged in tp.staged:
                layer = self.side.spec.layer(staged.layer_name)
                apply_relayout(staged, area, layer, self.side.local.layouts[layer.family],
                               self.side.kv_caches[staged.layer_name])
        self.side.backend.synchronize()


def _stand_in_ids(conn: Conn, num_tokens: int) -> dict[int, Ids]:
    """Source block ids for sizing and planning a push here: the prefill's ids are not known on this side,
    and where staged layers land depends only on how many source blocks the tokens take."""
    assert conn.record is not None
    spec = conn.record.manifest.spec
    return {g.group_id: np.zeros(-(-num_tokens // g.tokens_per_block), dtype=np.int64) for g in spec.groups}
