"""Configuration of one prefill or decode rank: identity, side channel, transport, mode, and every bound.

A frozen dataclass checked on construction; ``from_dict`` takes the JSON-ish dict an engine's config carries
(vLLM's ``kv_connector_extra_config``). Every wait in the flow is bounded by one of these fields.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from kvplane.flows.config_keys import check_keys
from kvplane.flows.disagg.errors import DisaggConfigError

Mode = Literal["pull", "push", "layerwise"]
MODES: tuple[Mode, ...] = ("pull", "push", "layerwise")
MiB = 1 << 20


@dataclass(frozen=True)
class DisaggConfig:
    """One rank of a prefill or decode instance.

    ``port`` is the instance's side-channel base port: rank r of a prefill instance listens on ``port + r``
    (0: any free port, read back from ``PrefillSide.port``). ``mode`` is ``pull`` (decode reads), ``push``
    (prefill writes once the request is finished) or ``layerwise`` (prefill writes each layer as it is saved).

    ``boot_id`` names this lifetime of the instance: every rank of one instance must share it (an engine passes
    the id its launch drew), so kv_transfer_params name one lifetime and a restarted instance is recognised.

    Bounds: a prefill rank holds a finished request's blocks for ``lease_s`` after the last heartbeat; decode
    sends heartbeats every ``heartbeat_s``. A decode request not done within ``transfer_timeout_s`` of the
    transfer starting (``push_timeout_s`` of registering, for push, which includes the prefill's compute)
    ends ``timed_out``; it is reported (its blocks released) only once no transfer can write them (the fence,
    docs/disagg.md): a push whose prefill does not confirm within ``drain_timeout_s`` has the engine reset. A handshake not answered in ``handshake_timeout_s`` fails its requests;
    a peer's transport that does not answer a probe within ``probe_timeout_s`` fails its handshake.
    """

    engine_id: str
    boot_id: str = ""  # one lifetime of the instance, the same on all its ranks; "" draws a fresh one
    rank: int = 0
    tp_size: int = 1
    host: str = "127.0.0.1"
    port: int = 0
    transport: str = "mooncake"
    mode: Mode = "pull"
    lease_s: float = 30.0
    heartbeat_s: float = 5.0
    transfer_timeout_s: float = 30.0
    push_timeout_s: float = 120.0
    drain_timeout_s: float = 10.0
    handshake_timeout_s: float = 10.0
    probe_timeout_s: float = 3.0  # connecting the transport to a peer that handshook (off the I/O loop)
    staging_bytes: int = 64 * MiB  # destination buffer for transfers that must be re-laid out (decode)
    max_inflight: int = 8  # transfers in flight per peer; more wait their turn
    max_message_bytes: int = 64 * MiB
    # side-channel authentication (auth.py): this rank's Z85 secret key (or $KVPLANE_CURVE_SECRET_KEY), the
    # prefill instances' public key (decode), the decode public keys admitted (prefill)
    curve_secret_key: str = ""
    curve_server_key: str = ""
    curve_allowed_clients: tuple[str, ...] = ()
    allow_unauthenticated: bool = False  # listen on a non-loopback host without keys: an explicit choice

    def __post_init__(self) -> None:
        if not self.engine_id or "/" in self.engine_id:
            raise DisaggConfigError(f"DisaggConfig.engine_id={self.engine_id!r} must be non-empty, without '/'")
        if not 0 <= self.rank < self.tp_size:
            raise DisaggConfigError(
                f"DisaggConfig.rank={self.rank} with tp_size={self.tp_size}: need 0 <= rank < tp_size"
            )
        if not 0 <= self.port < 65536 or (self.port and self.port + self.tp_size > 65536):
            raise DisaggConfigError(f"DisaggConfig.port={self.port} must be 0 (any) or a base port < 65536 - tp_size")
        if self.mode not in MODES:
            raise DisaggConfigError(f"DisaggConfig.mode={self.mode!r} is unknown; use one of {MODES}")
        for name in ("lease_s", "heartbeat_s", "transfer_timeout_s", "push_timeout_s", "drain_timeout_s",
                     "handshake_timeout_s", "probe_timeout_s"):
            if not getattr(self, name) > 0:
                raise DisaggConfigError(f"DisaggConfig.{name}={getattr(self, name)!r} must be > 0 seconds")
        if self.heartbeat_s >= self.lease_s:
            raise DisaggConfigError(
                f"DisaggConfig.heartbeat_s={self.heartbeat_s} must be below lease_s={self.lease_s}, or leases "
                f"expire between heartbeats (vLLM uses 5 s and 30 s)"
            )
        if self.staging_bytes < 0 or self.max_inflight < 1 or self.max_message_bytes < 4096:
            raise DisaggConfigError(
                f"DisaggConfig: staging_bytes={self.staging_bytes} must be >= 0, max_inflight={self.max_inflight} "
                f">= 1, max_message_bytes={self.max_message_bytes} >= 4096"
            )

        from kvplane.flows.disagg.auth import SECRET_ENV
        from kvplane.hosts import is_loopback

        if not (self.curve_secret_key or os.environ.get(SECRET_ENV)) and not is_loopback(self.host) \
                and not self.allow_unauthenticated:
            raise DisaggConfigError(
                f"DisaggConfig.host={self.host!r} is not a loopback address and no CURVE keys are set: anyone who "
                f"reaches it could hold or end requests. Set curve_secret_key (or {SECRET_ENV}) with "
                f"curve_server_key / curve_allowed_clients, or allow_unauthenticated=True to accept the risk"
            )

    def rank_port(self, rank: int | None = None) -> int:
        """The side-channel port of ``rank`` (this rank by default); 0 when the base port is 0."""
        return self.port + (self.rank if rank is None else rank) if self.port else 0

    def __repr__(self) -> str:  # never print the secret key
        shown = {k: v for k, v in self.__dict__.items() if k != "curve_secret_key"}
        return f"DisaggConfig({', '.join(f'{k}={v!r}' for k, v in shown.items())}, curve_secret_key=<hidden>)"

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> DisaggConfig:
        check_keys(cls, raw, "disaggregation config", DisaggConfigError)
        data = dict(raw)
        if isinstance(data.get("curve_allowed_clients"), list):  # JSON has no tuples
            data["curve_allowed_clients"] = tuple(data["curve_allowed_clients"])
        return cls(**data)
