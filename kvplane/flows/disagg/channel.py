"""Sending and receiving side-channel messages on ZMQ sockets, on the I/O loop's thread.

Every socket carries ``zmq.MAXMSGSIZE`` (``DisaggConfig.max_message_bytes``), so an oversized frame is refused
by libzmq before it is read whole.

The prefill rank binds a ROUTER socket; each decode rank talks to it through one DEALER socket per prefill
rank. Frames are ``[identity,] payload``; a payload that does not decode is logged, counted and dropped, and
a reply that cannot be delivered (the peer went away) is dropped too: nothing here raises into the loop.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import zmq

from kvplane.flows.disagg import messages
from kvplane.flows.disagg.errors import ProtocolError

logger = logging.getLogger("kvplane.disagg")
HWM = 100_000  # queued messages per peer before ZMQ drops: far above 200 requests' worth


def router(context: zmq.Context[zmq.Socket[bytes]], host: str, port: int, max_bytes: int,
           secure: Callable[[zmq.Socket[bytes]], None]) -> tuple[zmq.Socket[bytes], int]:
    """A ROUTER bound to ``host:port`` (a free port when 0); returns it and the port. libzmq drops a peer
    that sends a frame over ``max_bytes`` before reading it into memory."""
    sock = context.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unknown identity raises instead of silently dropping
    secure(sock)  # CURVE server options, before bind (auth.Guard)
    sock.setsockopt(zmq.SNDHWM, HWM)
    sock.setsockopt(zmq.RCVHWM, HWM)
    if port:
        sock.bind(f"tcp://{host}:{port}")
        return sock, port
    return sock, sock.bind_to_random_port(f"tcp://{host}")


def dealer(context: zmq.Context[zmq.Socket[bytes]], host: str, port: int, max_bytes: int,
           secure: Callable[[zmq.Socket[bytes]], None]) -> zmq.Socket[bytes]:
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
    sock.setsockopt(zmq.SNDHWM, HWM)
    sock.setsockopt(zmq.RCVHWM, HWM)
    sock.setsockopt(zmq.IMMEDIATE, 0)  # queue while connecting: the handshake deadline bounds the wait
    secure(sock)  # CURVE client options, before connect (auth.Guard)
    sock.connect(f"tcp://{host}:{port}")
    return sock


class Counters:
    """What the channel dropped, for logs, stats and tests."""

    def __init__(self) -> None:
        self.rejected = 0
        self.undeliverable = 0


def receive(sock: zmq.Socket[bytes], max_bytes: int, counters: Counters, routed: bool
            ) -> list[tuple[bytes, messages.Message]]:
    """Every message waiting on ``sock`` as ``(identity, message)`` (identity ``b""`` on a DEALER)."""
    out: list[tuple[bytes, messages.Message]] = []
    while True:
        try:
            frames = sock.recv_multipart(zmq.NOBLOCK, copy=True)
        except zmq.Again:
            return out
        identity = frames[0] if routed and len(frames) > 1 else b""
        payload = frames[-1]
        if (routed and len(frames) != 2) or (not routed and len(frames) != 1):
            counters.rejected += 1
            logger.warning("side channel: dropped a message of %d frames (expected %d)", len(frames),
                           2 if routed else 1)
            continue
        try:
            out.append((identity, messages.decode(payload, max_bytes)))
        except ProtocolError as e:
            counters.rejected += 1
            logger.warning("side channel: %s", e)
    return out


def send(sock: zmq.Socket[bytes], message: messages.Message, counters: Counters, identity: bytes = b"") -> bool:
    frames = [identity, messages.encode(message)] if identity else [messages.encode(message)]
    try:
        sock.send_multipart(frames, zmq.NOBLOCK)
        return True
    except (zmq.Again, zmq.ZMQError) as e:  # EHOSTUNREACH: that decode rank disconnected
        counters.undeliverable += 1
        logger.warning("side channel: could not deliver %s (%s)", type(message).__name__, e)
        return False
