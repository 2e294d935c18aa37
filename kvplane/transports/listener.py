"""Tearing a Mooncake engine down without waiting out its handshake listener.

Mooncake's handshake listener loops on ``accept()`` with a 1 s receive timeout, and the engine's destructor
joins it after clearing its running flag: every engine teardown (``close``, and each ``reset``) waited up to a
second, holding the GIL. ``woken(port)`` wraps a teardown in a native thread (``kvplane/_native/
listener_waker.c``) that connects to the listener and hangs up every 2 ms, so ``accept()`` returns and the loop
sees the flag. Without the native module (a source tree not built) the teardown waits as before.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from kvplane._native import optional

WAKE_S = 5.0  # the waker gives up after this long: a teardown stuck elsewhere is not poked forever

_waker, _ = optional("_listener_waker")


@contextmanager
def woken(port: int) -> Iterator[None]:
    """Within the block, a listener on ``127.0.0.1:port`` is woken every 2 ms (``port`` 0: nothing is)."""
    handle = _waker.start(port, WAKE_S) if _waker is not None and port > 0 else None
    try:
        yield
    finally:
        if handle is not None:
            assert _waker is not None
            _waker.stop(handle)
