"""Pushing a held request's KV to the decode ranks registered for it: per-layer or whole-request WRITE plans.

``PrefillSide`` owns the requests; a ``Pusher`` (on the I/O loop) plans the writes for one ``Target`` and hands
them to the transfer thread (``Mover``), calling ``settle`` once each write ended. Planning only ever writes
into the blocks and staging area the decode rank registered, and the transport checks every remote address
against the memory that rank registered before anything moves.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kvplane.blocks.groups import Ids
from kvplane.descriptors import CopyPlan
from kvplane.errors import KvplaneError
from kvplane.flows.disagg.local import LocalKV
from kvplane.flows.disagg.messages import PushRegister
from kvplane.flows.disagg.mover import Mover
from kvplane.flows.disagg.peers import PeerRecord
from kvplane.flows.disagg.records import Held, Target
from kvplane.flows.disagg.routes import route_plan
from kvplane.plan.planner import TransferPlan


class Pusher:
    def __init__(self, local: LocalKV, mover: Mover, settle: Callable[[Held], None]) -> None:
        self.local, self.mover, self.settle = local, mover, settle

    def source_ids(self, held: Held, target: Target) -> dict[int, Ids] | None:
        """The request's block ids when a push to ``target`` can be planned (its registration was checked and
        expects no more tokens than this prefill computed), else None."""
        if target.error or held.block_ids is None or not target.checked:
            return None
        if target.register.num_tokens > held.num_tokens:
            target.error = (f"decode expects {target.register.num_tokens} tokens, this prefill computed "
                            f"{held.num_tokens}; both must count the same prompt")
            return None
        return held.block_ids

    def _route(self, src_ids: dict[int, Ids], target: Target, layers: list[str], offset: int) -> TransferPlan:
        reg = target.register
        dst_ids = {int(g): np.asarray(v, dtype=np.int64) for g, v in reg.block_ids.items()}
        staging = (reg.staging_addr + offset, reg.staging_bytes - offset) if reg.staging_addr else None
        return route_plan(self.local.manifest, target.peer.manifest, src_ids, dst_ids, reg.num_tokens, layers,
                          staging)

    def build_plans(self, held: Held, target: Target) -> None:
        """Per-layer WRITE plans for one decode rank, each sent as its layer is saved; staged layers land at
        consecutive staging offsets, in layer order, where the decode rank re-lays them out."""
        src_ids = self.source_ids(held, target) if target.plans is None else None
        if src_ids is None:
            return
        plans: dict[str, CopyPlan] = {}
        offset = 0
        try:
            for layer in target.layers:
                tp = self._route(src_ids, target, [layer], offset)
                offset += tp.staging_bytes
                plans[layer] = tp.plan
        except KvplaneError as e:
            target.error = f"cannot plan the push: {e}"
            return
        target.plans = plans

    def push_rest(self, held: Held, target: Target) -> None:
        """The request is finished: write every layer not yet sent. When none was (a whole-request push) and
        nothing is staged, one plan over all layers is built in one planner call instead of one per layer."""
        if not target.sent and target.plans is None and not target.register.staging_addr:
            src_ids = self.source_ids(held, target)
            if src_ids is None or target.cancelled or held.aborted or held.declined:
                return
            try:
                plan = self._route(src_ids, target, target.layers, 0).plan
            except KvplaneError as e:
                target.error = f"cannot plan the push: {e}"
                return
            self._send(held, target, target.layers, plan)
            return
        self.build_plans(held, target)
        self.push(held, target, target.layers)

    def push(self, held: Held, target: Target, layers: list[str]) -> None:
        if target.plans is None or target.error or target.cancelled or held.aborted or held.declined:
            return
        todo = [x for x in layers if x not in target.sent]
        if todo:
            plans = [target.plans[x] for x in todo]
            self._send(held, target, todo, CopyPlan.concat(plans) if len(plans) > 1 else plans[0])

    def _send(self, held: Held, target: Target, layers: list[str], plan: CopyPlan) -> None:
        target.sent.update(layers)
        target.inflight += 1

        def landed(error: KvplaneError | None) -> None:
            target.inflight -= 1
            if error is not None and not target.error:
                target.error = f"WRITE failed: {error}"
            self.settle(held)

        self.mover.put(target.peer.handle, plan.coalesced(), landed)


def check_destination(peer: PeerRecord, reg: PushRegister) -> str:
    """Why a registration's destination blocks cannot be right for the rank that sent it; "" when they can."""
    groups = [g.group_id for g in peer.manifest.spec.groups]
    if sorted(reg.block_ids) != sorted(groups):
        return f"block_ids name groups {sorted(reg.block_ids)}, the decode's model has {groups}"
    for g, ids in reg.block_ids.items():
        pool = min((r.num_blocks for layer in peer.manifest.spec.layers if layer.group_id == g
                    for r in peer.manifest.regions_of(layer.name)), default=0)
        if len(ids) > pool or any(b >= pool for b in ids):
            return f"group {g}: block ids beyond the decode's {pool} blocks"
        if len(set(ids)) != len(ids):
            return f"group {g}: a destination block id appears twice"
    return ""
