"""The native listener waker (``kvplane/_native/listener_waker.c``, used by ``transports/listener.py``): while a
Mooncake engine is torn down it connects to the engine's handshake listener and hangs up, from a thread that
needs no GIL, so the listener's ``accept()`` returns instead of waiting out its 1 s timeout. Here against a
plain listening socket: connections arrive, each closed by the waker at once; ``stop`` joins; a listener that
is gone ends the thread early; bad arguments are refused."""

from __future__ import annotations

import importlib
import socket
import threading

import pytest

from kvplane.transports import listener

waker = importlib.import_module("kvplane._native._listener_waker")


def _listening() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    return sock


def test_the_waker_connects_and_hangs_up_until_stopped() -> None:
    sock = _listening()
    accepted: list[bytes] = []

    def serve() -> None:
        while len(accepted) < 3:
            conn, _ = sock.accept()
            accepted.append(conn.recv(1))  # b"": the waker hung up without sending anything
            conn.close()

    server = threading.Thread(target=serve)
    server.start()
    handle = waker.start(sock.getsockname()[1], 30.0)
    server.join(30.0)
    pokes = waker.stop(handle)
    sock.close()
    assert accepted == [b"", b"", b""] and pokes >= 3


def test_a_listener_that_is_gone_ends_the_waker_by_itself() -> None:
    sock = _listening()
    port = sock.getsockname()[1]
    sock.close()  # connections are refused from now on
    assert waker.stop(waker.start(port, 30.0)) == 0


@pytest.mark.parametrize("port, seconds", [(0, 1.0), (70_000, 1.0), (1234, 0.0), (1234, float("nan"))])
def test_bad_arguments_are_refused_naming_them(port: int, seconds: float) -> None:
    with pytest.raises(ValueError, match="port=.*seconds"):
        waker.start(port, seconds)


def test_woken_wakes_a_listener_and_port_zero_wakes_nothing() -> None:
    sock = _listening()
    sock.settimeout(30.0)
    with listener.woken(sock.getsockname()[1]):
        conn, _ = sock.accept()
        conn.close()
    sock.close()
    with listener.woken(0):
        pass
