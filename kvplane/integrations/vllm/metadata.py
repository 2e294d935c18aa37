"""What the scheduler-side connector tells the worker-side connectors for one step.

Plain data (ints, strings, dicts of lists, and ``kv_transfer_params`` as the ``TransferParams`` the scheduler
half parsed them into once: a msgspec struct, which pickles) so vLLM can ship it to worker processes (and back:
``KVPlaneWorkerMeta``). Block ids and hashes are
``{group_id: [...]}`` over the kvplane spec's groups (vLLM's KV-cache group indices). ``real_blocks`` and
``null_as_hole`` build jobs and tables without vLLM's null block.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvplane.blocks.groups import HOLE
from kvplane.flows.disagg.wire.params import TransferParams
from kvplane.integrations.vllm.compat import KVConnectorMetadata, KVConnectorWorkerMetadata

Groups = dict[int, list[int]]
NULL_BLOCK = 0  # vLLM's placeholder block (BlockPool.null_block): sliding-window groups hold it out of the window


@dataclass
class BlockJob:
    """An offload load or store: ``hashes[g][i]`` names the prefix ending in device block ``block_ids[g][i]``."""

    request_id: str
    hashes: Groups
    block_ids: Groups
    num_tokens: int = 0  # a load: the tokens vLLM counts on
    wait_in_vllm: bool = False  # a load vLLM waits for (WAITING_FOR_REMOTE_KVS), reported like a receive
    # with vLLM's KV events on: the hash vLLM's events carry for each block (``events.event_hash``), else None
    tags: dict[int, list[Any]] | None = None


@dataclass
class Receive:
    """Decode: pull (or register for a push of) the KV the prefill named in ``params`` into ``block_ids`` (every
    block of the prompt's ``num_tokens``), but for the first ``local_tokens[g]`` tokens of each group (whole
    blocks), which vLLM's prefix cache on this instance holds already."""

    request_id: str
    params: TransferParams | None  # parsed once, by the scheduler half (its mode settled there); None: unparsable
    block_ids: Groups
    num_tokens: int
    refused: str = ""  # why the receive cannot run: the worker fails it (and declines parsed params: not this request's)
    local_tokens: dict[int, int] = field(default_factory=dict)


@dataclass
class Send:
    """Prefill: the request's KV is in ``block_ids`` (``num_tokens`` tokens): hold it for decode, or push it.

    ``transfer_id`` names the request to the decode side (``remote_request_id``): in push modes the id without
    vLLM's random ``-xxxxxxxx`` suffix, which is what a proxy could tell the decode before the prefill ran.
    """

    request_id: str
    block_ids: Groups
    num_tokens: int
    transfer_id: str = ""
    token: str = ""  # the request's kvplane_token: every prefill rank must hold it under the same one


@dataclass
class KVPlaneMetadata(KVConnectorMetadata):
    loads: list[BlockJob] = field(default_factory=list)
    stores: list[BlockJob] = field(default_factory=list)
    receives: list[Receive] = field(default_factory=list)
    layerwise: list[Send] = field(default_factory=list)  # before this step's forward: pushed layer by layer
    sends: list[Send] = field(default_factory=list)  # finished: the blocks are the connector's until reported
    aborts: list[str] = field(default_factory=list)
    declines: list[TransferParams] = field(default_factory=list)  # receives vLLM dropped unstarted: their params
    released: list[str] = field(default_factory=list)  # lookups whose promised blocks will not be loaded


@dataclass
class KVPlaneWorkerMeta(KVConnectorWorkerMetadata):
    """What the workers tell the scheduler-side connector beside vLLM's own fields: receives that failed, by
    request id, where vLLM has no per-request failure field (``compat.REPORTS_FAILED_RECEIVES_BY_REQUEST``)."""

    failed_receives: set[str] = field(default_factory=set)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVPlaneWorkerMeta:
        if isinstance(other, KVPlaneWorkerMeta):
            self.failed_receives |= other.failed_receives
        return self


def null_as_hole(ids: list[int]) -> list[int]:
    table = np.asarray(ids, dtype=np.int64)
    return np.where(table == NULL_BLOCK, HOLE, table).tolist()  # type: ignore[no-any-return]


def real_blocks(
    request_id: str, hashes: Groups, block_ids: Groups, tags: dict[int, list[Any]] | None = None
) -> BlockJob:
    """The job without vLLM's null block: nothing to load into it, and storing it would key garbage by a real
    prefix hash (a sliding-window group's out-of-window positions)."""
    keep = {g: [i for i, b in enumerate(ids) if b != NULL_BLOCK] for g, ids in block_ids.items()}
    return BlockJob(
        request_id,
        {g: [hashes[g][i] for i in idx] for g, idx in keep.items()},
        {g: [block_ids[g][i] for i in idx] for g, idx in keep.items()},
        tags={g: [tags[g][i] for i in idx] for g, idx in keep.items() if g in tags} if tags is not None else None,
    )
