"""``kv_transfer_params``: what a prefill instance returns for a finished request and a proxy forwards to decode.

The keys follow vLLM's NixlConnector conventions (``do_remote_prefill``, ``remote_engine_id``,
``remote_block_ids``, ``remote_host``, ``remote_port``, ``tp_size``, ``remote_block_size``...), so vLLM's example
proxy forwards them unchanged. kvplane adds ``remote_num_tokens`` (tokens whose KV the prefill holds),
``remote_boot_id`` (which lifetime of the prefill holds them), ``kvplane_mode`` and ``kvplane_token`` (the
request's token, ``tokens.py``: messages about the request count only with it). ``remote_block_ids`` is one
list per KV-cache group, in the spec's group order, so the dict survives JSON.

The constructor checks every field, as ``from_dict`` does. Two builders make them: ``from_prefill`` what a
prefill rank (``PrefillSide.request_finished``) or the vLLM scheduler returns for a finished request, from the
rank's ``DisaggConfig``; ``for_push`` what a proxy hands a decode instance (and, with the same token, the prefill
instance) before the prefill has run.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from kvplane.blocks.groups import HOLE
from kvplane.flows.disagg.wire.config import MODES, DisaggConfig, Mode
from kvplane.flows.disagg.wire.errors import TransferParamsError
from kvplane.flows.disagg.wire.limits import MAX_PREFILL_TP
from kvplane.flows.disagg.wire.tokens import is_token, new_token

# known once the prefill finished the request (pull); push params are made before, without them
NOT_KNOWN_BEFORE_PREFILL = ("remote_block_ids", "remote_block_size", "remote_num_tokens", "remote_boot_id")


class TransferParams(msgspec.Struct, frozen=True, kw_only=True):
    remote_engine_id: str
    remote_request_id: str
    remote_host: str
    remote_port: int  # the base side-channel port of the DP rank holding the request (TP rank r: + r)
    tp_size: int  # the prefill instance's TP size
    # known once the prefill finished (pull); a push is registered before, with these left empty
    remote_block_ids: list[list[int]] = msgspec.field(default_factory=list)  # one list per KV-cache group
    remote_block_size: int = 0
    remote_num_tokens: int = 0
    remote_boot_id: str = ""
    kvplane_mode: Mode = "pull"
    kvplane_token: str = ""
    do_remote_prefill: bool = True
    do_remote_decode: bool = False

    def __post_init__(self) -> None:
        if self.kvplane_mode not in MODES:
            raise TransferParamsError(f"kv_transfer_params.kvplane_mode={self.kvplane_mode!r}; use one of {MODES}")
        if self.tp_size < 1 or not 0 < self.remote_port < 65536 or self.remote_num_tokens < 0:
            raise TransferParamsError(
                f"kv_transfer_params: tp_size={self.tp_size}, remote_port={self.remote_port}, "
                f"remote_num_tokens={self.remote_num_tokens} are out of range"
            )
        if self.tp_size > MAX_PREFILL_TP or self.remote_port + self.tp_size - 1 > 65535:
            raise TransferParamsError(
                f"kv_transfer_params: tp_size={self.tp_size} with remote_port={self.remote_port} names prefill ranks "
                f"on ports {self.remote_port}..{self.remote_port + self.tp_size - 1}; a decode rank opens a socket to "
                f"each, so at most {MAX_PREFILL_TP} ranks, all below port 65536; forward what the prefill returned"
            )
        if not self.remote_engine_id or not self.remote_request_id:
            raise TransferParamsError(
                f"kv_transfer_params: remote_engine_id={self.remote_engine_id!r} and remote_request_id="
                f"{self.remote_request_id!r} must be non-empty; forward what the prefill instance returned"
            )
        if self.kvplane_token and not is_token(self.kvplane_token):
            raise TransferParamsError(
                f"kv_transfer_params.kvplane_token={self.kvplane_token!r} is not 32 lowercase hex digits; draw it "
                f"with kvplane.flows.disagg.wire.tokens.new_token() (or TransferParams.for_push)"
            )
        for g, ids in enumerate(self.remote_block_ids):
            if ids and min(ids) < HOLE:
                raise TransferParamsError(
                    f"kv_transfer_params.remote_block_ids[{g}] holds block id {min(ids)}; ids are >= 0, or {HOLE} "
                    f"for a position without a block; forward what the prefill instance returned")

    @classmethod
    def from_prefill(cls, config: DisaggConfig, request_id: str, block_ids: Sequence[Sequence[int]], *,
                     block_size: int, num_tokens: int, token: str, port: int | None = None,
                     boot_id: str | None = None) -> TransferParams:
        """What a prefill rank returns for a finished request: its advertised ``host``, the base port of its DP
        rank (``port``: the one bound, where the config's is 0), ``boot_id`` (the instance's, where the config
        drew none), and ``block_ids`` one list per KV-cache group in the spec's order."""
        return cls(
            remote_engine_id=config.engine_id,
            remote_request_id=request_id,
            remote_block_ids=[[int(b) for b in ids] for ids in block_ids],
            remote_host=config.host,
            remote_port=config.base_port() if port is None else port,
            tp_size=config.tp_size,
            remote_block_size=block_size,
            remote_num_tokens=num_tokens,
            remote_boot_id=config.boot_id if boot_id is None else boot_id,
            kvplane_mode=config.mode,
            kvplane_token=token,
        )

    @classmethod
    def for_push(cls, engine_id: str, request_id: str, host: str, port: int, *, tp_size: int = 1,
                 mode: Mode = "push", token: str | None = None) -> TransferParams:
        """What a proxy gives a decode instance before the prefill instance ran the request (push modes).

        Give the prefill the same ``kvplane_token``: ``PrefillSide.request_finished(..., token=p.kvplane_token)``
        (vLLM: in the prefill request's ``kv_transfer_params``); a fresh one is drawn when ``token`` is None.
        """
        return cls(remote_engine_id=engine_id, remote_request_id=request_id, remote_host=host, remote_port=port,
                   tp_size=tp_size, kvplane_mode=mode, kvplane_token=new_token() if token is None else token)

    def to_dict(self) -> dict[str, Any]:
        """The JSON-able dict; the fields only a finished prefill knows are left out while unset (push params),
        so a decode reads "not known yet", never "the prefill holds 0 tokens"."""
        out: dict[str, Any] = msgspec.to_builtins(self)
        if not self.remote_num_tokens and not self.remote_block_ids:
            for key in NOT_KNOWN_BEFORE_PREFILL:
                del out[key]
        return out

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> TransferParams:
        """Parse what a proxy forwarded; a missing or wrong field is a ``TransferParamsError`` naming it."""
        if not isinstance(raw, Mapping):
            raise TransferParamsError(f"kv_transfer_params must be a dict, got {type(raw).__name__}")
        known = set(cls.__struct_fields__)
        data = {k: v for k, v in raw.items() if k in known}  # proxies may add their own keys
        try:
            return msgspec.convert(data, cls)
        except msgspec.ValidationError as e:
            field = re.search(r"at `\$\.(\w+)", str(e))  # msgspec names the path; the value is added here
            value = f" ({field[1]}={repr(data[field[1]])[:80]})" if field and field[1] in data else ""
            raise TransferParamsError(
                f"kv_transfer_params: {e}{value}; forward the dict the prefill instance returned, unchanged"
            ) from None

    def block_ids(self, group_ids: Sequence[int]) -> dict[int, list[int]]:
        """``{group: ids}`` for this model's groups; ``TransferParamsError`` when the counts differ."""
        if len(self.remote_block_ids) != len(group_ids):
            raise TransferParamsError(
                f"kv_transfer_params.remote_block_ids has {len(self.remote_block_ids)} group(s), this model has "
                f"{len(group_ids)} ({list(group_ids)}); both instances must serve the same model"
            )
        return dict(zip(group_ids, self.remote_block_ids))
