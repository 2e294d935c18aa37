"""Free TCP ports on 127.0.0.1 for a test's side channels (the kernel picks them; they may be taken again later)."""

from __future__ import annotations

import contextlib
import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_ports(count: int) -> int:
    """The first of ``count`` consecutive ports free on 127.0.0.1 (the kernel may hand them out again later)."""
    for _ in range(50):
        base = free_port()
        if base + count > 65536:
            continue
        try:
            with contextlib.ExitStack() as held:
                for port in range(base, base + count):
                    sock = held.enter_context(socket.socket())
                    sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise RuntimeError(f"no {count} consecutive free ports on 127.0.0.1")
