"""``kvplane keys NAME``: a CURVE key pair for the P/D side channel, as two files a deployment can share.

``NAME.key`` holds the secret key (mode 0600: it stays on the host that runs with it) and ``NAME.pub`` the public
key (copied to the peers); each is one line of Z85 text, as ``zmq.curve_keypair()`` makes it. ``DisaggConfig``
reads them through ``curve_secret_key_file``, ``curve_server_key_file`` and ``curve_allowed_clients_file``
(``flows/disagg/wire/auth.py``; docs/deploy.md, CURVE keys). An existing file is never overwritten without ``--force``,
and the secret is never printed.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import zmq

from kvplane.errors import KvplaneError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", metavar="NAME",
                        help="path prefix of the pair: writes NAME.key (secret, mode 0600) and NAME.pub (public)")
    parser.add_argument("--force", action="store_true", help="overwrite an existing NAME.key / NAME.pub")


def _write(path: Path, text: str, mode: int, force: bool) -> None:
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if force else os.O_EXCL)
    fd = os.open(path, flags, mode)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), mode)  # an overwritten file keeps its old mode otherwise
        f.write(text)


def write_pair(name: str, force: bool = False) -> tuple[Path, Path, str]:
    """Make a key pair and write ``NAME.key`` and ``NAME.pub``; (secret path, public path, public key)."""
    secret_path, public_path = Path(f"{name}.key"), Path(f"{name}.pub")
    if not secret_path.parent.is_dir():
        raise KvplaneError(f"kvplane keys: directory {str(secret_path.parent)!r} does not exist; create it first")
    there = [str(p) for p in (secret_path, public_path) if p.exists()]
    if there and not force:
        raise KvplaneError(f"kvplane keys: {there} already there; pass --force to replace the pair (peers that "
                           f"hold the old public key must get the new one) or choose another NAME")
    public, secret = zmq.curve_keypair()
    try:
        _write(secret_path, secret.decode() + "\n", 0o600, force)
        _write(public_path, public.decode() + "\n", 0o644, force)
    except OSError as e:
        raise KvplaneError(f"kvplane keys: cannot write {e.filename!r} ({e.strerror})") from e
    return secret_path, public_path, public.decode()


def run(args: argparse.Namespace) -> int:
    secret_path, public_path, public = write_pair(args.name, args.force)
    print(f"secret key: {secret_path} (mode 0600; keep it on this host: curve_secret_key_file)")
    print(f"public key: {public_path} ({public}; copy it to the peers: curve_server_key_file on decode "
          f"instances for a prefill key, curve_allowed_clients_file on prefill instances for a decode key)")
    return 0
