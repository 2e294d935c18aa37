"""Authentication of the side channel: ZMQ CURVE with keys from ``DisaggConfig`` (or the environment), and an
allow-list of decode public keys checked through ``zmq.auth``.

With keys, the prefill's ROUTER is a CURVE server that admits only the decode public keys in
``curve_allowed_clients``; each decode's DEALER is a CURVE client that knows the prefill's public key
(``curve_server_key``), so both sides know whom they talk to and everything on the wire is encrypted. The
secret key comes from ``curve_secret_key`` or the ``KVPLANE_CURVE_SECRET_KEY`` environment variable (for
deployments that keep secrets out of config files). Keys are Z85 text, as ``zmq.curve_keypair()`` makes them.

Without keys the side channel is unauthenticated: allowed on a loopback address only (logged), or anywhere
when ``allow_unauthenticated`` says so explicitly. The transfer engines are a separate matter: Mooncake TE's
RPC listens on 0.0.0.0 and NIXL's UCX on its devices, neither authenticated (docs/disagg.md).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import zmq

from kvplane.flows.disagg.errors import DisaggConfigError
from kvplane.hosts import is_loopback

if TYPE_CHECKING:
    from kvplane.flows.disagg.config import DisaggConfig

logger = logging.getLogger("kvplane.disagg")
SECRET_ENV = "KVPLANE_CURVE_SECRET_KEY"


@dataclass(frozen=True)
class CurveKeys:
    secret: bytes
    public: bytes
    server: bytes  # decode: the prefill instances' public key
    allowed: frozenset[bytes]  # prefill: decode public keys admitted




def _key(value: str, field: str) -> bytes:
    raw = value.encode()
    if len(raw) != 40:
        raise DisaggConfigError(f"DisaggConfig.{field}={value[:6]!r}... must be a 40-character Z85 CURVE key, "
                                f"as zmq.curve_keypair() makes")
    return raw


def curve_keys(config: DisaggConfig, role: str) -> CurveKeys | None:
    """The rank's CURVE keys, or None when the side channel runs without (checked to be allowed then)."""
    secret = config.curve_secret_key or os.environ.get(SECRET_ENV, "")
    if not secret:
        if config.curve_server_key or config.curve_allowed_clients:
            raise DisaggConfigError(
                f"DisaggConfig names CURVE peer keys but no secret key: set curve_secret_key or {SECRET_ENV}"
            )
        if not is_loopback(config.listen_host) and not config.allow_unauthenticated:
            raise DisaggConfigError(
                f"DisaggConfig.bind_host/host={config.listen_host!r} is not a loopback address and no CURVE keys are set: anyone "
                f"who reaches it could hold or end requests. Set curve_secret_key (or {SECRET_ENV}) with "
                f"curve_server_key / curve_allowed_clients, or allow_unauthenticated=True to accept the risk"
            )
        logger.warning("kvplane %s rank %d: side channel on %s is unauthenticated (no CURVE keys)", role,
                       config.rank, config.listen_host)
        return None
    secret_b = _key(secret, "curve_secret_key")
    allowed = frozenset(_key(k, "curve_allowed_clients[]") for k in config.curve_allowed_clients)
    if role == "prefill" and not allowed:
        raise DisaggConfigError("DisaggConfig.curve_allowed_clients is empty: with CURVE keys a prefill rank "
                                "admits only the decode public keys listed there")
    if role == "decode" and not config.curve_server_key:
        raise DisaggConfigError("DisaggConfig.curve_server_key is empty: with CURVE keys a decode rank needs "
                                "the prefill instances' public key")
    server = _key(config.curve_server_key, "curve_server_key") if config.curve_server_key else b""
    return CurveKeys(secret_b, zmq.curve_public(secret_b), server, allowed)


class _AllowList:
    def __init__(self, allowed: frozenset[bytes]) -> None:
        self.allowed = allowed

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.allowed


class Guard:
    """The ZAP handler of one side's ZMQ context (prefill), and the socket options of both roles."""

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]], keys: CurveKeys | None) -> None:
        self.keys = keys
        self._auth = None
        if keys is not None and keys.allowed:
            from zmq.auth.thread import ThreadAuthenticator

            self._auth = ThreadAuthenticator(context)
            self._auth.start()
            self._auth.configure_curve_callback("*", credentials_provider=_AllowList(keys.allowed))

    def server(self, sock: zmq.Socket[bytes]) -> None:
        if self.keys is not None:
            sock.curve_secretkey = self.keys.secret
            sock.curve_publickey = self.keys.public
            sock.curve_server = True

    def client(self, sock: zmq.Socket[bytes]) -> None:
        if self.keys is not None:
            sock.curve_secretkey = self.keys.secret
            sock.curve_publickey = self.keys.public
            sock.curve_serverkey = self.keys.server

    def stop(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
