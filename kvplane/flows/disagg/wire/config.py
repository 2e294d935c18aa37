"""Configuration of one prefill or decode rank: identity, addresses, transport options, mode, and every bound.

A frozen dataclass checked on construction (range checks raise ``invalid(...)`` naming the field). ``from_dict``
takes the JSON-ish dict an engine's config carries (vLLM's ``kv_connector_extra_config``), applies the
environment overrides (``addresses.py``) and builds it with ``kvplane.config.build`` (msgspec): a wrong type or a
misspelt transport, mode, protocol or NIXL backend is a ``DisaggConfigError`` naming its path (``$.port``),
the value and the valid choices. Every wait in the flow is bounded by one of these fields.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from kvplane.config import build, invalid
from kvplane.flows.disagg.wire import addresses
from kvplane.flows.disagg.wire.auth import check, key_files
from kvplane.flows.disagg.wire.errors import DisaggConfigError
from kvplane.transports import options

Mode = Literal["pull", "push", "layerwise"]
MODES: tuple[Mode, ...] = ("pull", "push", "layerwise")
MiB = 1 << 20
WHAT = "disaggregation config"
PEER_TIMEOUT_RANGE = (0.2, 6553.0)  # seconds: ZMQ_HEARTBEAT_TTL is sent in deciseconds, at most 65535


def _bad(name: str, value: Any, problem: str) -> DisaggConfigError:
    return invalid(DisaggConfigError, "DisaggConfig", name, value, problem)


@dataclass(frozen=True)
class DisaggConfig:
    """One rank of a prefill or decode instance.

    Addresses (``addresses.py``): ``host`` is the address peers reach this rank at (advertised in
    ``kv_transfer_params.remote_host``); ``bind_host`` the address the side channel binds ("" = ``host``; e.g.
    ``0.0.0.0``). ``port`` is the instance's side-channel base port: TP rank r of DP rank d listens on
    ``port + d*tp_size + r`` (0: any free port, read back from ``PrefillSide.port``). ``mode`` is ``pull``
    (decode reads), ``push`` (prefill writes once the request is finished) or ``layerwise`` (prefill writes each
    layer as it is saved).

    Transport options (``transports/options.py``): ``protocol`` is Mooncake's (``tcp``, ``rdma``, ``ascend``...;
    "" = the backend's), ``device_name`` its comma-separated RDMA NICs ("" = discover), ``nixl_backends`` the
    NIXL backends to start (``UCX``...), checked against the plugins the installed NIXL ships.

    ``boot_id`` names this lifetime of the instance: every rank of one instance must share it (an engine passes
    the id its launch drew), so kv_transfer_params name one lifetime and a restarted instance is recognised.

    Bounds: a prefill rank holds a finished request's blocks for ``lease_s`` after the last heartbeat; decode
    sends heartbeats every ``heartbeat_s``. A decode request not done within ``transfer_timeout_s`` of the
    transfer starting (``push_timeout_s`` of registering, for push, which includes the prefill's compute)
    ends ``timed_out``; it is reported (its blocks released) only once no transfer can write them (the fence,
    docs/disagg.md): a push whose prefill does not confirm within ``drain_timeout_s`` has the engine reset. A handshake not answered in ``handshake_timeout_s`` fails its requests;
    a peer's transport that does not answer a probe within ``probe_timeout_s`` fails its handshake. A side-channel
    connection whose peer answers no ZMQ heartbeat for ``peer_timeout_s`` (a stopped process, a dropped network) is
    closed (``channel.py``), so a prefill rank frees the decode's name for its next connection in bounded time.
    """

    engine_id: str
    boot_id: str = ""  # one lifetime of the instance, the same on all its ranks; "" draws a fresh one
    rank: int = 0  # the TP rank
    tp_size: int = 1
    dp_rank: int = 0  # the data-parallel rank (vLLM: parallel_config.data_parallel_index)
    host: str = "127.0.0.1"  # advertised: what peers connect to
    bind_host: str = ""  # what the side channel binds; "" = host
    port: int = 0
    transport: str = "mooncake"
    mode: Mode = "pull"
    protocol: str = ""  # Mooncake's; "" = the backend's default (Backend.mooncake_protocol)
    device_name: str = ""  # Mooncake's RDMA NICs, comma-separated; "" = discover
    nixl_backends: tuple[str, ...] = options.NIXL_DEFAULT_BACKENDS
    lease_s: float = 30.0
    heartbeat_s: float = 5.0
    transfer_timeout_s: float = 30.0
    push_timeout_s: float = 120.0
    drain_timeout_s: float = 10.0
    handshake_timeout_s: float = 10.0
    probe_timeout_s: float = 3.0  # connecting the transport to a peer that handshook (off the I/O loop)
    peer_timeout_s: float = 10.0  # a side-channel connection silent this long (ZMQ heartbeats) is closed
    staging_bytes: int = 64 * MiB  # destination buffer for transfers that must be re-laid out (decode)
    max_inflight: int = 8  # transfers in flight per peer; more wait their turn
    max_message_bytes: int = 64 * MiB
    # side-channel authentication (auth.py): this rank's Z85 secret key ($KVPLANE_CURVE_SECRET_KEY wins), the
    # prefill instances' public key (decode), the decode public keys admitted (prefill)
    curve_secret_key: str = ""
    curve_server_key: str = ""
    curve_allowed_clients: tuple[str, ...] = ()
    # the same from files (``kvplane keys NAME`` writes NAME.key / NAME.pub), read when the config is built
    curve_secret_key_file: str = ""
    curve_server_key_file: str = ""
    curve_allowed_clients_file: str = ""  # decode public keys, one per line; added to curve_allowed_clients
    allow_unauthenticated: bool = False  # listen on a non-loopback address without keys: an explicit choice

    def __post_init__(self) -> None:
        if not self.engine_id or "/" in self.engine_id:
            raise _bad("engine_id", self.engine_id, "must be non-empty, without '/'")
        if not 0 <= self.rank < self.tp_size:
            raise _bad("rank", self.rank, f"with tp_size={self.tp_size}: need 0 <= rank < tp_size")
        if self.dp_rank < 0:
            raise _bad("dp_rank", self.dp_rank, "must be >= 0")
        last = addresses.rank_port(self.port, self.dp_rank, self.tp_size, self.tp_size - 1)
        if not 0 <= self.port < 65536 or last >= 65536:
            raise _bad("port", self.port, f"must be 0 (any) or a base port with port + dp_rank*tp_size + tp_size "
                                          f"<= 65536 (dp_rank={self.dp_rank}, tp_size={self.tp_size})")
        for name in ("host", "bind_host"):
            if " " in getattr(self, name) or "/" in getattr(self, name):
                raise _bad(name, getattr(self, name), "must be an address or host name")
        if not self.host:
            raise _bad("host", self.host, "must be the address peers reach this rank at")
        if addresses.is_wildcard(self.host):
            raise _bad("host", self.host, "is a wildcard, but host is the address peers are told to connect to; "
                                          "put it in bind_host and set host to this machine's address")
        if self.mode not in MODES:
            raise _bad("mode", self.mode, f"is unknown; choose one of {list(MODES)}")
        self._check_transport()
        for name in ("lease_s", "heartbeat_s", "transfer_timeout_s", "push_timeout_s", "drain_timeout_s",
                     "handshake_timeout_s", "probe_timeout_s"):
            if not getattr(self, name) > 0:
                raise _bad(name, getattr(self, name), "must be > 0 seconds")
        if not PEER_TIMEOUT_RANGE[0] <= self.peer_timeout_s <= PEER_TIMEOUT_RANGE[1]:
            raise _bad("peer_timeout_s", self.peer_timeout_s,
                       f"must be within {list(PEER_TIMEOUT_RANGE)} seconds (ZMQ heartbeats count in 0.1 s steps, "
                       f"up to 6553 s); 10 s is the default")
        if self.heartbeat_s >= self.lease_s:
            raise _bad("heartbeat_s", self.heartbeat_s, f"must be below lease_s={self.lease_s}, or leases "
                                                        f"expire between heartbeats (vLLM uses 5 s and 30 s)")
        if self.staging_bytes < 0:
            raise _bad("staging_bytes", self.staging_bytes, "must be >= 0")
        if self.max_inflight < 1:
            raise _bad("max_inflight", self.max_inflight, "must be >= 1")
        if self.max_message_bytes < 4096:
            raise _bad("max_message_bytes", self.max_message_bytes, "must be >= 4096")
        self._check_auth()

    def _check_transport(self) -> None:
        from kvplane.transports.registry import default_registry

        names = default_registry().names()
        if self.transport not in names:
            raise _bad("transport", self.transport, f"is not an installed transport; choose one of {sorted(names)}")
        if self.protocol and self.protocol not in options.MOONCAKE_PROTOCOLS:
            raise _bad("protocol", self.protocol,
                       f"is not a Mooncake protocol; choose one of {list(options.MOONCAKE_PROTOCOLS)} (or '' for "
                       f"the backend's)")
        # no protocol: the backend's, known later (rdma on CUDA/MLU): the names are checked as RDMA NICs
        problem = options.nic_problem(self.device_name, self.protocol or "rdma", options.rdma_devices())
        if problem:
            raise _bad("device_name", self.device_name, problem)
        if not self.nixl_backends:
            raise _bad("nixl_backends", list(self.nixl_backends), "is empty; choose from ['UCX', ...]")
        installed = options.installed_nixl_backends()
        unknown = [b for b in self.nixl_backends if b not in installed]
        if installed and unknown:
            raise _bad("nixl_backends", list(self.nixl_backends),
                       f"names {unknown}, which the installed NIXL has no plugin for; choose from {list(installed)}")

    def _check_auth(self) -> None:
        for name, value in key_files(self).items():  # read once, here: a later use never reads a file
            object.__setattr__(self, name, value)
        check(self, None)  # what holds for every role; each side checks its own role when it starts

    @property
    def listen_host(self) -> str:
        """The address the side channel binds: ``bind_host``, else ``host``."""
        return self.bind_host or self.host

    def base_port(self) -> int:
        """The first port of this DP rank, as ``kv_transfer_params.remote_port`` carries it (0: any)."""
        return addresses.dp_base_port(self.port, self.dp_rank, self.tp_size)

    def rank_port(self, rank: int | None = None) -> int:
        """The side-channel port of TP rank ``rank`` of this DP rank (this rank by default); 0 when port is 0."""
        return addresses.rank_port(self.port, self.dp_rank, self.tp_size, self.rank if rank is None else rank)

    def __repr__(self) -> str:  # never print the secret key
        shown = {k: v for k, v in self.__dict__.items() if k != "curve_secret_key"}
        return f"DisaggConfig({', '.join(f'{k}={v!r}' for k, v in shown.items())}, curve_secret_key=<hidden>)"

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], *, path: str = "$", what: str = WHAT,
                  env: Mapping[str, str] | None = None) -> DisaggConfig:
        """``raw`` with the environment's overrides on top (``addresses.ENV_FIELDS``), typed and checked."""
        if not isinstance(raw, Mapping):
            raise DisaggConfigError(f"{what}: {path}={raw!r} must be an object of DisaggConfig fields")
        env = os.environ if env is None else env
        merged = {**raw, **addresses.env_overrides(env, DisaggConfigError, what)}
        try:
            return build(cls, merged, what=what, error=DisaggConfigError, path=path)
        except DisaggConfigError as e:
            raise DisaggConfigError(addresses.blame(str(e), env)) from e
