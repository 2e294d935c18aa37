"""Pushing a held request's KV to the decode ranks registered for it: per-layer or whole-request WRITE plans.

Each request's ``HeldRequest`` machine decides what to write where (its ``Prepare`` and ``Write`` actions);
``PrefillSide`` carries them out through a ``Pusher`` (on the I/O loop), which plans the writes for one
``Target`` and hands them to the transfer thread (``Mover``), calling back once each write ended. Planning
only ever writes into the blocks and staging area the decode rank registered, and the transport checks every
remote address against the memory that rank registered before anything moves. A registration whose
``first_tokens`` skip the blocks the decode holds already is written from there on (``routes.after_first``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from kvplane.blocks.groups import Ids, table_problem
from kvplane.descriptors import CopyPlan
from kvplane.errors import KvplaneError
from kvplane.flows.disagg.prefill.push_target import Target
from kvplane.flows.disagg.wire.local import LocalKV
from kvplane.flows.disagg.wire.messages import PushRegister
from kvplane.flows.disagg.wire.mover import Mover
from kvplane.flows.disagg.wire.peers import PeerRecord
from kvplane.flows.disagg.wire.routes import route_plan
from kvplane.plan.planner import TransferPlan


class Pusher:
    def __init__(self, local: LocalKV, mover: Mover) -> None:
        self.local, self.mover = local, mover

    def _route(self, src_ids: dict[int, Ids], target: Target, layers: Sequence[str], offset: int) -> TransferPlan:
        reg = target.register
        dst_ids = {int(g): np.asarray(v, dtype=np.int64) for g, v in reg.block_ids.items()}
        staging = (reg.staging_addr + offset, reg.staging_bytes - offset) if reg.staging_addr else None
        return route_plan(self.local.manifest, target.peer.manifest, src_ids, dst_ids, reg.num_tokens, list(layers),
                          staging, reg.first_tokens)

    def prepare(self, src_ids: dict[int, Ids], target: Target) -> str:
        """Per-layer WRITE plans for one decode rank, each sent as its layer is saved; staged layers land at
        consecutive staging offsets, in layer order, where the decode rank re-lays them out. Returns why they
        cannot be planned ("" when they were)."""
        plans: dict[str, CopyPlan] = {}
        offset = 0
        try:
            for layer in target.layers:
                tp = self._route(src_ids, target, [layer], offset)
                offset += tp.staging_bytes
                plans[layer] = tp.plan
        except KvplaneError as e:
            return f"cannot plan the push: {e}"
        target.plans = plans
        return ""

    def write(self, src_ids: dict[int, Ids], target: Target, layers: Sequence[str], whole: bool,
              ended: Callable[[str], None]) -> None:
        """Write ``layers`` to ``target``: one plan over all of them when ``whole`` (built here, in one planner
        call), else the prepared per-layer plans, merged so that a block's layers that lie side by side go as one
        descriptor. ``ended(why it failed, or "")`` runs exactly once, on the loop."""
        if whole:
            try:
                plan = self._route(src_ids, target, layers, 0).plan
            except KvplaneError as e:
                ended(f"cannot plan the push: {e}")
                return
        elif target.plans is None:
            ended("cannot plan the push: its per-layer plans were not built")
            return
        else:  # several layers: interleaved block by block where they lie side by side (a cross-layer cache)
            plan = CopyPlan.merge_parallel([target.plans[x] for x in layers])

        def landed(error: KvplaneError | None) -> None:
            ended("" if error is None else f"WRITE failed: {error}")

        self.mover.put(target.peer.handle, plan.coalesced(), landed)


def check_destination(peer: PeerRecord, reg: PushRegister) -> str:
    """Why a registration's destination blocks cannot be right for the rank that sent it; "" when they can."""
    groups = [g.group_id for g in peer.manifest.spec.groups]
    if sorted(reg.block_ids) != sorted(groups):
        return f"block_ids name groups {sorted(reg.block_ids)}, the decode's model has {groups}"
    for g, ids in reg.block_ids.items():
        pool = min((r.num_blocks for layer in peer.manifest.spec.layers if layer.group_id == g
                    for r in peer.manifest.regions_of(layer.name)), default=0)
        problem = table_problem(np.asarray(ids, dtype=np.int64), pool, distinct=True)
        if problem:
            return f"group {g} of the decode's {pool} blocks: {problem}"
    return ""
