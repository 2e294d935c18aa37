"""Authentication of the side channel: ZMQ CURVE with keys from ``DisaggConfig`` (or the environment), and an
allow-list of decode public keys checked through ``zmq.auth``.

With keys, the prefill's ROUTER is a CURVE server that admits only the decode public keys in
``curve_allowed_clients``; each decode's DEALER is a CURVE client that knows the prefill's public key
(``curve_server_key``), so both sides know whom they talk to and everything on the wire is encrypted. The
secret key comes from the ``KVPLANE_CURVE_SECRET_KEY`` environment variable when it is set (for deployments
that keep secrets out of config files; it wins over the config, as every environment override does), else from
``curve_secret_key``. Keys are Z85 text, as ``zmq.curve_keypair()`` makes them. ``kvplane keys NAME`` writes a pair
as files (``NAME.key``, ``NAME.pub``); ``curve_secret_key_file``, ``curve_server_key_file`` and
``curve_allowed_clients_file`` name such files, read once when the config is built (``key_files``): one key per
line, blank lines and ``#`` comments skipped; the allow-list file's keys join ``curve_allowed_clients``.

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
from pathlib import Path
from typing import Any, Literal, Protocol

import zmq
from zmq.utils import z85

from kvplane.config import invalid
from kvplane.flows.disagg.wire.errors import DisaggConfigError
from kvplane.hosts import is_loopback


class KeyedConfig(Protocol):
    """What the rule reads of a ``DisaggConfig``: its keys, key files and addresses (a protocol, so this module
    needs nothing of ``config.py``, which calls it)."""

    @property
    def rank(self) -> int: ...
    @property
    def bind_host(self) -> str: ...
    @property
    def listen_host(self) -> str: ...
    @property
    def allow_unauthenticated(self) -> bool: ...
    @property
    def curve_secret_key(self) -> str: ...
    @property
    def curve_server_key(self) -> str: ...
    @property
    def curve_allowed_clients(self) -> tuple[str, ...]: ...
    @property
    def curve_secret_key_file(self) -> str: ...
    @property
    def curve_server_key_file(self) -> str: ...
    @property
    def curve_allowed_clients_file(self) -> str: ...

logger = logging.getLogger("kvplane.disagg")
SECRET_ENV = "KVPLANE_CURVE_SECRET_KEY"
KEYPAIR_FIX = "make a key pair with `kvplane keys NAME` or zmq.curve_keypair() (docs/deploy.md, CURVE keys)"
FILE_FIX = ("make the pair with `kvplane keys NAME` on the host that keeps NAME.key, and copy NAME.pub to its peers "
            "(docs/deploy.md, CURVE keys)")
Role = Literal["prefill", "decode"]


@dataclass(frozen=True)
class CurveKeys:
    secret: bytes
    public: bytes
    server: bytes  # decode: the prefill instances' public key
    allowed: frozenset[bytes]  # prefill: decode public keys admitted




def secret_key(config: KeyedConfig, env: Mapping[str, str] | None = None) -> tuple[str, str]:
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


def _file_keys(config: KeyedConfig, field: str) -> list[str]:
    """The keys in the file ``field`` names: its lines, blank ones and ``#`` comments skipped."""
    path = getattr(config, field)
    try:
        text = Path(path).expanduser().read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise invalid(DisaggConfigError, "DisaggConfig", field, path, f"cannot be read ({type(e).__name__}: "
                      f"{getattr(e, 'strerror', None) or e}); fix the path, or {FILE_FIX}") from e
    lines = [line.strip() for line in text.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def _one_key(config: KeyedConfig, field: str, kind: str) -> str:
    keys = _file_keys(config, field)
    if len(keys) != 1 or _z85_key(keys[0]) is None:
        shown = f"{len(keys)} line(s), not shown" if kind == "secret" else f"{keys[:2]!r}"
        raise invalid(DisaggConfigError, "DisaggConfig", field, getattr(config, field),
                      f"does not hold one 40-character Z85 CURVE {kind} key ({shown}); {FILE_FIX}")
    return keys[0]


def key_files(config: KeyedConfig) -> dict[str, Any]:
    """The key fields ``config``'s ``curve_*_file`` fields give, read now (``DisaggConfig`` calls it once, when
    it is built): a secret or server key file holds one key, the allow-list file one public key per line, added
    to ``curve_allowed_clients``. A key given both inline and by a file must be the same key."""
    out: dict[str, Any] = {}
    for field, wrong, right in (("curve_secret_key_file", ".pub", ".key"), ("curve_server_key_file", ".key", ".pub"),
                                ("curve_allowed_clients_file", ".key", ".pub")):
        path = getattr(config, field)
        if path.endswith(wrong):  # `kvplane keys` names: a secret file never goes where a public one belongs
            raise invalid(DisaggConfigError, "DisaggConfig", field, path,
                          f"names a {'public' if wrong == '.pub' else 'secret'} key file; name the "
                          f"{'secret' if right == '.key' else 'public'} one ({path[:-4]}{right})")
    for field, key_field, kind in (("curve_secret_key_file", "curve_secret_key", "secret"),
                                   ("curve_server_key_file", "curve_server_key", "public")):
        if not getattr(config, field):
            continue
        key, inline = _one_key(config, field, kind), getattr(config, key_field)
        if inline and inline != key:
            raise invalid(DisaggConfigError, "DisaggConfig", field, getattr(config, field),
                          f"holds another key than {key_field}, which is set too; keep one of the two")
        out[key_field] = key
    if config.curve_allowed_clients_file:
        listed = _file_keys(config, "curve_allowed_clients_file")
        bad = [k for k in listed if _z85_key(k) is None]
        if not listed or bad:
            raise invalid(DisaggConfigError, "DisaggConfig", "curve_allowed_clients_file",
                          config.curve_allowed_clients_file,
                          f"must list decode public keys, one 40-character Z85 key per line (found {len(listed)} "
                          f"line(s){f', not keys: {bad[:2]!r}' if bad else ''}); {FILE_FIX}")
        out["curve_allowed_clients"] = tuple(dict.fromkeys((*config.curve_allowed_clients, *listed)))
    return out


def _public_key(value: str, field: str) -> bytes:
    raw = _z85_key(value)
    if raw is None:
        raise invalid(DisaggConfigError, "DisaggConfig", field, value, f"is not a 40-character Z85 CURVE public "
                      f"key; {KEYPAIR_FIX}")
    return raw


def check(config: KeyedConfig, role: Role | None, env: Mapping[str, str] | None = None) -> CurveKeys | None:
    """The rank's CURVE keys, or None when the side channel runs without (then allowed only on loopback or with
    ``allow_unauthenticated``). The one rule: ``curve_keys`` (the sides), ``DisaggConfig`` (``role=None``: what
    holds for every role) and ``kvplane info`` all call it. Raises ``DisaggConfigError`` naming the field (or
    the variable) and the fix; a secret key is never printed."""
    secret, source = secret_key(config, env)
    if not secret:
        if config.curve_server_key or config.curve_allowed_clients:
            raise DisaggConfigError(
                f"DisaggConfig names CURVE peer keys (curve_server_key / curve_allowed_clients) but no secret key: "
                f"set curve_secret_key_file (or curve_secret_key, or {SECRET_ENV}) to this rank's secret key"
            )
        if not is_loopback(config.listen_host) and not config.allow_unauthenticated:
            raise invalid(DisaggConfigError, "DisaggConfig", "bind_host" if config.bind_host else "host",
                          config.listen_host, f"is not a loopback address and no CURVE keys are set: anyone who "
                          f"reaches it could hold or end requests. Make keys with `kvplane keys NAME` and set "
                          f"curve_secret_key_file (or curve_secret_key, or {SECRET_ENV}) with curve_server_key_file"
                          f" / curve_allowed_clients_file (or the keys inline), or allow_unauthenticated=True to "
                          f"accept the risk")
        return None
    secret_b = _z85_key(secret)
    if secret_b is None:
        raise DisaggConfigError(f"{source} ({len(secret)} characters, not shown) is not a 40-character Z85 CURVE "
                                f"secret key; {KEYPAIR_FIX}")
    allowed = frozenset(_public_key(k, "curve_allowed_clients[]") for k in config.curve_allowed_clients)
    server = _public_key(config.curve_server_key, "curve_server_key") if config.curve_server_key else b""
    if role == "prefill" and not allowed:
        raise DisaggConfigError("DisaggConfig.curve_allowed_clients is empty: with CURVE keys a prefill rank "
                                "admits only the decode public keys listed there; list them (or name a file of "
                                "them in curve_allowed_clients_file)")
    if role == "decode" and not server:
        raise DisaggConfigError("DisaggConfig.curve_server_key is empty: with CURVE keys a decode rank needs "
                                "the prefill instances' public key; set it (or curve_server_key_file to their "
                                ".pub file)")
    return CurveKeys(secret_b, zmq.curve_public(secret_b), server, allowed)


def curve_keys(config: KeyedConfig, role: Role) -> CurveKeys | None:
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
