"""Authentication of the side channel: ZMQ CURVE with keys from ``DisaggConfig`` (or the environment), and an
allow-list of decode public keys checked through ``zmq.auth``.

With keys, the prefill's ROUTER is a CURVE server that admits only the decode public keys in
``curve_allowed_clients``; each decode's DEALER is a CURVE client that knows the prefill's public key
(``curve_server_key``), so both sides know whom they talk to and everything on the wire is encrypted. The
secret key comes from the ``KVPLANE_CURVE_SECRET_KEY`` environment variable when it is set (for deployments
that keep secrets out of config files; it wins over the config, as every environment override does), else from
``curve_secret_key``. Keys are Z85 text, as ``zmq.curve_keypair()`` makes them.

``check`` is the one rule: the sides call it when they start (``curve_keys``), ``DisaggConfig`` calls its
role-free part when it is built, and ``kvplane info`` calls it for the roles a config will run.

Without keys the side channel is unauthenticated: allowed on a loopback address only (logged), or anywhere
when ``allow_unauthenticated`` says so explicitly. The transfer engines are a separate matter: Mooncake TE's
RPC listens on 0.0.0.0 and NIXL's UCX on its devices, neither authenticated (docs/disagg.md).
"""

from __future__ import annotations

import logging
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import zmq
from zmq.utils import z85

from kvplane.config import invalid
from kvplane.flows.disagg.errors import DisaggConfigError
from kvplane.hosts import is_loopback

if TYPE_CHECKING:
    from kvplane.flows.disagg.config import DisaggConfig

logger = logging.getLogger("kvplane.disagg")
SECRET_ENV = "KVPLANE_CURVE_SECRET_KEY"
KEYPAIR_FIX = "make a key pair with zmq.curve_keypair() (docs/deploy.md, CURVE keys)"
Role = Literal["prefill", "decode"]


@dataclass(frozen=True)
class CurveKeys:
    secret: bytes
    public: bytes
    server: bytes  # decode: the prefill instances' public key
    allowed: frozenset[bytes]  # prefill: decode public keys admitted




def secret_key(config: DisaggConfig, env: Mapping[str, str] | None = None) -> tuple[str, str]:
    """The rank's secret key and where it came from: ``$KVPLANE_CURVE_SECRET_KEY`` when set (non-empty) wins over
    ``curve_secret_key``, as every environment override wins over the config (``addresses.py``)."""
    env = os.environ if env is None else env
    from_env = env.get(SECRET_ENV, "").strip()
    return (from_env, f"${SECRET_ENV}") if from_env else (config.curve_secret_key, "DisaggConfig.curve_secret_key")


def _z85_key(value: str) -> bytes | None:
    raw = value.encode()
    if len(raw) != 40:
        return None
    try:
        return raw if z85.encode(z85.decode(raw)) == raw else None
    except (KeyError, ValueError, struct.error):  # a character outside Z85, or a group above 2**32
        return None


def _public_key(value: str, field: str) -> bytes:
    raw = _z85_key(value)
    if raw is None:
        raise invalid(DisaggConfigError, "DisaggConfig", field, value, f"is not a 40-character Z85 CURVE public "
                      f"key; {KEYPAIR_FIX}")
    return raw


def check(config: DisaggConfig, role: Role | None, env: Mapping[str, str] | None = None) -> CurveKeys | None:
    """The rank's CURVE keys, or None when the side channel runs without (then allowed only on loopback or with
    ``allow_unauthenticated``). The one rule: ``curve_keys`` (the sides), ``DisaggConfig`` (``role=None``: what
    holds for every role) and ``kvplane info`` all call it. Raises ``DisaggConfigError`` naming the field (or
    the variable) and the fix; a secret key is never printed."""
    secret, source = secret_key(config, env)
    if not secret:
        if config.curve_server_key or config.curve_allowed_clients:
            raise DisaggConfigError(
                f"DisaggConfig names CURVE peer keys (curve_server_key / curve_allowed_clients) but no secret key: "
                f"set curve_secret_key or {SECRET_ENV} to this rank's secret key"
            )
        if not is_loopback(config.listen_host) and not config.allow_unauthenticated:
            raise invalid(DisaggConfigError, "DisaggConfig", "bind_host" if config.bind_host else "host",
                          config.listen_host, f"is not a loopback address and no CURVE keys are set: anyone who "
                          f"reaches it could hold or end requests. Set curve_secret_key (or {SECRET_ENV}) with "
                          f"curve_server_key / curve_allowed_clients, or allow_unauthenticated=True to accept the "
                          f"risk")
        return None
    secret_b = _z85_key(secret)
    if secret_b is None:
        raise DisaggConfigError(f"{source} ({len(secret)} characters, not shown) is not a 40-character Z85 CURVE "
                                f"secret key; {KEYPAIR_FIX}")
    allowed = frozenset(_public_key(k, "curve_allowed_clients[]") for k in config.curve_allowed_clients)
    server = _public_key(config.curve_server_key, "curve_server_key") if config.curve_server_key else b""
    if role == "prefill" and not allowed:
        raise DisaggConfigError("DisaggConfig.curve_allowed_clients is empty: with CURVE keys a prefill rank "
                                "admits only the decode public keys listed there; list them")
    if role == "decode" and not server:
        raise DisaggConfigError("DisaggConfig.curve_server_key is empty: with CURVE keys a decode rank needs "
                                "the prefill instances' public key; set it")
    return CurveKeys(secret_b, zmq.curve_public(secret_b), server, allowed)


def curve_keys(config: DisaggConfig, role: Role) -> CurveKeys | None:
    """``check`` for a side that starts now (its environment), logging when it runs unauthenticated."""
    keys = check(config, role)
    if keys is None:
        logger.warning("kvplane %s rank %d: side channel on %s is unauthenticated (no CURVE keys)", role,
                       config.rank, config.listen_host)
    return keys


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
