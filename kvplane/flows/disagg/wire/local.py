"""One rank's KV cache as the disaggregation flow sees it: regions, manifest, transport, staging buffer.

Built by ``PrefillSide`` and ``DecodeSide`` from the engine's tensors (borrowed, as vLLM's
``register_kv_caches`` hands them over). The transport registers the cache's spans (merged and aligned by the
backend) plus the staging buffer, and its ``PeerInfo`` travels in the handshake with the manifest.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING

import msgspec

from kvplane.blocks.groups import Ids, PerGroup, per_group, table_problem
from kvplane.descriptors import Region, SlotPart
from kvplane.errors import KvplaneError
from kvplane.flows.disagg.wire.config import DisaggConfig
from kvplane.flows.disagg.wire.errors import DisaggError
from kvplane.flows.disagg.wire.messages import Handshake
from kvplane.flows.disagg.wire.staging import StagingArena
from kvplane.kv.bound import BoundKV
from kvplane.kv.manifest import Manifest
from kvplane.transports.base import Transport, TransportConfig
from kvplane.transports.registry import get_transport_class

if TYPE_CHECKING:
    import torch


def _staging_region(addr: int, nbytes: int) -> Region:
    """The staging buffer as one pseudo-region, so the backend merges and aligns it with the cache's spans."""
    return Region(0, -1, "<staging>", addr, 1, nbytes, nbytes, 1, 1, nbytes, (SlotPart("staging", 0, nbytes),))


class LocalKV:
    def __init__(self, kv: BoundKV, config: DisaggConfig, role: str, staging_bytes: int = 0) -> None:
        backend, spec = kv.backend, kv.spec
        self.backend, self.spec, self.config, self.role = backend, spec, config, role
        self.kv_caches, self.layouts = kv.caches, kv.layouts
        self.manifest = Manifest(
            config.engine_id, config.rank, config.tp_size, backend.label, spec,
            {family: layout.name for family, layout in self.layouts.items()}, kv.regions,
        )
        self.boot_id = config.boot_id or uuid.uuid4().hex
        self.group_ids = [g.group_id for g in spec.groups]
        self.staging: torch.Tensor | None = None
        to_register = list(kv.regions)
        if staging_bytes:
            align = max(backend.registration_alignment, 64)
            padded = -(-staging_bytes // align) * align
            raw = backend.alloc_device(padded + align)  # room to align the start and register whole units
            start = -raw.data_ptr() % align
            self.staging = raw[start : start + staging_bytes]
            to_register.append(_staging_region(raw.data_ptr() + start, padded))
        self.arena = StagingArena(staging_bytes)
        transport_cls = get_transport_class(config.transport)
        self.transport: Transport = transport_cls(
            backend,
            TransportConfig(host=config.host, timeout_s=config.transfer_timeout_s, protocol=config.protocol,
                            device_name=config.device_name, nixl_backends=config.nixl_backends),
            agent_name=f"{config.engine_id}-{role}-{config.rank}-{self.boot_id[:8]}",
        )
        self.transport.register(backend.registration_spans(to_register))  # merged with the cache's spans
        self._handshake = self._make_handshake()  # once: NIXL's metadata call waits for the agent lock
        self.generation = self.transport.generation  # of the transport's engine the handshake describes

    def block_ids(self, request_id: str, block_ids: PerGroup, num_tokens: int, *, distinct: bool = False
                  ) -> dict[int, Ids]:
        """The engine's block ids per group, checked to cover every KV-cache group, to lie in the cache, and to
        hold ``num_tokens`` tokens in every group; ``distinct``: no id twice in a group (destinations)."""
        ids = per_group("block_ids", block_ids, self.group_ids, DisaggError)
        missing = sorted(set(self.group_ids) - set(ids))
        if missing:
            raise DisaggError(
                f"request {request_id!r}: block_ids name groups {sorted(ids)} but the model has KV-cache groups "
                f"{self.group_ids} (missing {missing}); pass {{group_id: block ids}} for every group"
            )
        if num_tokens < 1:
            raise DisaggError(f"request {request_id!r}: num_tokens={num_tokens} must be >= 1")
        for g, group_ids in ids.items():
            problem = table_problem(group_ids, self.pool_size(g), distinct=distinct)
            if problem:
                raise DisaggError(f"request {request_id!r} group {g}: {problem}")
            per_block = self.spec.group(g).tokens_per_block
            need = -(-num_tokens // per_block)
            if len(group_ids) < need:
                raise DisaggError(
                    f"request {request_id!r} group {g}: {len(group_ids)} block ids cannot hold num_tokens="
                    f"{num_tokens}; pass {need} blocks of {per_block} tokens"
                )
        return ids

    def held_tokens(self, request_id: str, local_tokens: Mapping[int, int], num_tokens: int) -> dict[int, int]:
        """``local_tokens`` (the first tokens of each group this rank holds already) checked to name this model's
        groups, in whole local blocks (rounded down) and at most ``num_tokens``; 0 for a group not named."""
        unknown = sorted(set(local_tokens) - set(self.group_ids))
        if unknown or any(not isinstance(n, int) or n < 0 for n in local_tokens.values()):
            raise DisaggError(
                f"request {request_id!r}: local_tokens={dict(local_tokens)} names groups {unknown} the model lacks (it "
                f"has {self.group_ids}) or not a count; pass {{group_id: tokens >= 0}} this rank holds already"
            )
        out = {}
        for g in self.group_ids:
            per_block = self.spec.group(g).tokens_per_block
            out[g] = min(local_tokens.get(g, 0), num_tokens) // per_block * per_block
        return out

    def pool_size(self, group_id: int) -> int:
        """Blocks of group ``group_id`` in this rank's cache (the fewest of its layers)."""
        sizes = [r.num_blocks for layer in self.spec.layers if layer.group_id == group_id
                 for r in self.manifest.regions_of(layer.name)]
        return min(sizes) if sizes else 0

    @property
    def staging_addr(self) -> int:
        return int(self.staging.data_ptr()) if self.staging is not None else 0

    def handshake(self) -> Handshake:
        """This rank's handshake; made again once the transport was reset (its descriptor changed)."""
        if self.generation != self.transport.generation:
            try:
                self._handshake, self.generation = self._make_handshake(), self.transport.generation
            except KvplaneError:  # the engine is down since a reset: transfers fail until it is back
                pass
        return self._handshake

    def _make_handshake(self) -> Handshake:
        return Handshake(
            engine_id=self.config.engine_id,
            boot_id=self.boot_id,
            role=self.role,
            rank=self.config.rank,
            tp_size=self.config.tp_size,
            manifest=self.manifest.encode(),
            peer=msgspec.msgpack.encode(self.transport.peer_info()),
            fingerprint=self.manifest.fingerprint,
        )

    def close(self) -> None:
        self.transport.close()
