"""What the decode side keeps per peer and per request while KV moves: its connections to prefill ranks (``Conn``)
and the requests it receives (``Want``: what the ``Starter`` needs, and the request's machine), with the plans a
request waiting for staging room keeps. Plain records: ``decode_side.py``, ``decode_conns.py`` and ``decode_shell.py``
(with ``decode_request.py``) own their changes. The prefill side's record is ``held_record.Held``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import zmq

from kvplane.blocks.groups import HOLE, Ids
from kvplane.flows.disagg.decode.decode_link import Link
from kvplane.flows.disagg.decode.decode_request import DecodeRequest
from kvplane.flows.disagg.decode.staging_chunks import Chunk
from kvplane.flows.disagg.wire.messages import Handshake
from kvplane.flows.disagg.wire.params import TransferParams
from kvplane.flows.disagg.wire.peers import PeerRecord
from kvplane.kv.manifest import Manifest
from kvplane.kv.spec import KVSpec
from kvplane.plan.planner import TransferPlan
from kvplane.transports.base import PeerInfo


@dataclass
class Conn:
    """The side channel to one prefill rank: its link machine, and what its handshake told us."""

    host: str
    port: int
    rank: int
    socket: zmq.Socket[bytes]
    link: Link
    checked: tuple[Handshake, Manifest, PeerInfo] | None = None  # the latest answer that checked out
    record: PeerRecord | None = None  # from the latest handshake that made the link ready
    waiting: dict[str, None] = field(default_factory=dict)  # ids waiting on the handshake, sent in this order
    stages: dict[tuple[str, ...], bool] = field(default_factory=dict)

    @property
    def ready(self) -> bool:
        """Messages go out on it (and requests start on it)."""
        return self.link.usable and self.record is not None


@dataclass(frozen=True)
class Planned:
    """What ``decode_start.Starter`` worked out for a request, kept while it waits for staging room: reused as
    long as it was made from the peer records its connections hold now (a new handshake makes new ones)."""

    records: tuple[PeerRecord, ...]  # held, so compared by identity: none can be collected and its id reused

    def made_from(self, records: tuple[PeerRecord | None, ...]) -> bool:
        return len(records) == len(self.records) and all(a is b for a, b in zip(records, self.records))


@dataclass(frozen=True)
class PullPlan(Planned):
    direct: dict[int, TransferPlan | None]  # per prefill rank: the plan of its layers that land directly
    chunks: list[Chunk]  # the staged rest, in chunks
    slots: int  # chunks in flight at once


@dataclass(frozen=True)
class PushPlan(Planned):
    plans: dict[int, TransferPlan]  # per prefill rank that stages: its plan (made once: staged layers, their bytes)


@dataclass
class Want:
    """One request this rank is receiving KV for: what the ``Starter`` plans from and fills in (``staged``: a
    push's staging ranges and re-layout plans), and the request's ``machine``, which owns its phase."""

    request_id: str
    params: TransferParams
    block_ids: dict[int, Ids]
    remote_ids: dict[int, Ids]
    num_tokens: int
    mode: str  # "pull" or "push"
    machine: DecodeRequest
    conns: list[Conn] = field(default_factory=list)
    staged: list[tuple[int, int, TransferPlan]] = field(default_factory=list)  # (offset, bytes, plan)
    planned: PullPlan | PushPlan | None = None  # while it waits for staging room
    local_tokens: dict[int, int] = field(default_factory=dict)  # per group: the first tokens this rank holds
    first: dict[int, int] = field(default_factory=dict)  # per group: the first token moved (the Starter sets it)

    def split(self, spec: KVSpec) -> tuple[dict[int, tuple[int, ...]], int]:
        """The blocks from ``first`` on, which a failed transfer leaves without the request's KV, per group; and
        how many real blocks (not holes) before it the transfer left out, as this rank held their KV already."""
        failed, skipped = {}, 0
        for g, ids in self.block_ids.items():
            cut = self.first[g] // spec.group(g).tokens_per_block if self.first.get(g) else 0
            failed[g] = tuple(int(b) for b in ids[cut:])
            skipped += int((np.asarray(ids[:cut]) != HOLE).sum())
        return failed, skipped
