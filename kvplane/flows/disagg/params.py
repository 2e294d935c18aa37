"""``kv_transfer_params``: what a prefill instance returns for a finished request and a proxy forwards to decode.

The keys follow vLLM's NixlConnector conventions (``do_remote_prefill``, ``remote_engine_id``,
``remote_block_ids``, ``remote_host``, ``remote_port``, ``tp_size``, ``remote_block_size``...), so vLLM's example
proxy forwards them unchanged. kvplane adds ``remote_num_tokens`` (tokens whose KV the prefill holds),
``remote_boot_id`` (which lifetime of the prefill holds them) and ``kvplane_mode``. ``remote_block_ids`` is one
list per KV-cache group, in the spec's group order, so the dict survives JSON.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from kvplane.flows.disagg.config import MODES, Mode
from kvplane.flows.disagg.errors import TransferParamsError


class TransferParams(msgspec.Struct, frozen=True, kw_only=True):
    remote_engine_id: str
    remote_request_id: str
    remote_host: str
    remote_port: int  # the prefill instance's side-channel base port (rank r: + r)
    tp_size: int  # the prefill instance's TP size
    # known once the prefill finished (pull); a push is registered before, with these left empty
    remote_block_ids: list[list[int]] = msgspec.field(default_factory=list)  # one list per KV-cache group
    remote_block_size: int = 0
    remote_num_tokens: int = 0
    remote_boot_id: str = ""
    kvplane_mode: Mode = "pull"
    do_remote_prefill: bool = True
    do_remote_decode: bool = False

    def to_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)  # type: ignore[no-any-return]

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> TransferParams:
        """Parse what a proxy forwarded; a missing or wrong field is a ``TransferParamsError`` naming it."""
        if not isinstance(raw, Mapping):
            raise TransferParamsError(f"kv_transfer_params must be a dict, got {type(raw).__name__}")
        known = set(cls.__struct_fields__)
        data = {k: v for k, v in raw.items() if k in known}  # proxies may add their own keys
        try:
            params = msgspec.convert(data, cls)
        except msgspec.ValidationError as e:
            raise TransferParamsError(
                f"kv_transfer_params: {e}; forward the dict the prefill instance returned, unchanged"
            ) from None
        if params.kvplane_mode not in MODES:
            raise TransferParamsError(f"kv_transfer_params.kvplane_mode={params.kvplane_mode!r}; use one of {MODES}")
        if params.tp_size < 1 or not 0 < params.remote_port < 65536 or params.remote_num_tokens < 0:
            raise TransferParamsError(
                f"kv_transfer_params: tp_size={params.tp_size}, remote_port={params.remote_port}, "
                f"remote_num_tokens={params.remote_num_tokens} are out of range"
            )
        return params

    def block_ids(self, group_ids: Sequence[int]) -> dict[int, list[int]]:
        """``{group: ids}`` for this model's groups; ``TransferParamsError`` when the counts differ."""
        if len(self.remote_block_ids) != len(group_ids):
            raise TransferParamsError(
                f"kv_transfer_params.remote_block_ids has {len(self.remote_block_ids)} group(s), this model has "
                f"{len(group_ids)} ({list(group_ids)}); both instances must serve the same model"
            )
        return dict(zip(group_ids, self.remote_block_ids))
