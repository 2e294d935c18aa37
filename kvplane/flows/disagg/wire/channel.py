"""Sending and receiving side-channel messages on ZMQ sockets, on the I/O loop's thread.

Every socket carries ``zmq.MAXMSGSIZE`` (``DisaggConfig.max_message_bytes``), so an oversized frame is refused
by libzmq before it is read whole.

The prefill rank binds a ROUTER socket; each decode rank talks to it through one DEALER socket per prefill
rank. Frames are ``[identity,] payload``; a payload that does not decode is logged, counted and dropped, and
a reply that cannot be delivered (the peer went away) is dropped too: nothing here raises into the loop.

Half-open connections: every socket sends ZMQ heartbeats (ZMTP PING, ``ZMQ_HEARTBEAT_IVL``/``_TIMEOUT``/``_TTL``,
libzmq >= 4.2; answered by the peer's libzmq I/O thread, so a peer busy in Python still answers) and closes a
connection whose peer is silent for ``DisaggConfig.peer_timeout_s``: a process that is stopped or behind a dropped
network no longer holds its name at a prefill rank until TCP notices (hours, for an idle connection). A DEALER has
a random routing id of its own (``ZMQ_ROUTING_ID``) and the ROUTER hands an id over to its newest connection
(``ZMQ_ROUTER_HANDOVER``), so a decode whose connection was closed and that reconnects by itself is still the
connection that handshook: its word keeps counting without a new handshake. The id is 16 random bytes that only
the two ends see (inside CURVE's encryption where keys are set). A client that learned it anyway can still take the
id over (libzmq hands it to the newest connection), so under CURVE each routed message also carries the sender's
public key (ZAP's User-Id, ``auth.Guard``) and the prefill knows a decode by both (``admission``): a connection
under a decode's id with another key is refused. Without keys the id is all there is (docs/deploy.md).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator

import zmq

from kvplane.flows.disagg.wire import messages
from kvplane.flows.disagg.wire.errors import DisaggConfigError, ProtocolError

# frames one readable event handles before the loop turns (timers, other sockets): a flood waits in libzmq, and
# the loop never stalls behind it (489 heartbeats of 4096 ids once held it 1-15 s, issue 28)
RECEIVE_BUDGET = 32

logger = logging.getLogger("kvplane.disagg")
HWM = 100_000  # queued messages per peer before ZMQ drops: far above 200 requests' worth
HEARTBEATS = (4, 2)  # the libzmq that has ZMQ_HEARTBEAT_*


def heartbeats(sock: zmq.Socket[bytes], peer_timeout_s: float) -> None:
    """PING the peer every quarter of ``peer_timeout_s``; close the connection when nothing came back for
    ``peer_timeout_s``, and ask the peer to do the same (TTL)."""
    if zmq.zmq_version_info()[:2] < HEARTBEATS:
        raise DisaggConfigError(
            f"DisaggConfig.peer_timeout_s={peer_timeout_s} needs ZMQ heartbeats, which libzmq "
            f"{zmq.zmq_version()} lacks (they came in {'.'.join(map(str, HEARTBEATS))}); install a pyzmq that "
            f"bundles a newer libzmq (pip install -U pyzmq)"
        )
    timeout_ms = round(peer_timeout_s * 1000)
    sock.setsockopt(zmq.HEARTBEAT_IVL, max(50, timeout_ms // 4))
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, timeout_ms)
    sock.setsockopt(zmq.HEARTBEAT_TTL, timeout_ms)


def router(context: zmq.Context[zmq.Socket[bytes]], host: str, port: int, max_bytes: int,
           secure: Callable[[zmq.Socket[bytes]], None], peer_timeout_s: float) -> tuple[zmq.Socket[bytes], int]:
    """A ROUTER bound to ``host:port`` (a free port when 0); returns it and the port. libzmq drops a peer
    that sends a frame over ``max_bytes`` before reading it into memory, and one silent for ``peer_timeout_s``."""
    sock = context.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unknown identity raises instead of silently dropping
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a decode's socket that reconnected keeps its routing id
    heartbeats(sock, peer_timeout_s)
    secure(sock)  # CURVE server options, before bind (auth.Guard)
    sock.setsockopt(zmq.SNDHWM, HWM)
    sock.setsockopt(zmq.RCVHWM, HWM)
    if port:
        sock.bind(f"tcp://{host}:{port}")
        return sock, port
    return sock, sock.bind_to_random_port(f"tcp://{host}")


def dealer(context: zmq.Context[zmq.Socket[bytes]], host: str, port: int, max_bytes: int,
           secure: Callable[[zmq.Socket[bytes]], None], peer_timeout_s: float) -> zmq.Socket[bytes]:
    """A DEALER connected to a prefill rank, under a random routing id it keeps across reconnections."""
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, b"k" + os.urandom(15))  # not starting with 0: libzmq reserves those ids
    heartbeats(sock, peer_timeout_s)
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


def receive(sock: zmq.Socket[bytes], max_bytes: int, counters: Counters, routed: bool,
            budget: int = RECEIVE_BUDGET) -> Iterator[tuple[bytes, str, messages.Message]]:
    """The messages waiting on ``sock`` as ``(identity, key, message)`` (identity ``b""`` on a DEALER; key: the
    sender's CURVE public key, Z85, on a CURVE server socket, else ``""``), each read and
    decoded only once the caller has handled the one before: at most one decoded message is held at a time. At
    most ``budget`` frames a call: the rest stay queued in libzmq, the socket stays readable, and the loop's
    other work runs first (libzmq's ROUTER fair-queues its peers, so each connection gets its turn)."""
    keyed = routed and bool(sock.getsockopt(zmq.CURVE_SERVER))
    for _ in range(budget):
        try:
            frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return
        identity = frames[0].bytes if routed and len(frames) > 1 else b""
        key = _user_id(frames[-1]) if keyed else ""
        payload = frames[-1].bytes
        if (routed and len(frames) != 2) or (not routed and len(frames) != 1):
            counters.rejected += 1
            logger.warning("side channel: dropped a message of %d frames (expected %d)", len(frames),
                           2 if routed else 1)
            continue
        try:
            message = messages.decode(payload, max_bytes)
        except ProtocolError as e:
            counters.rejected += 1
            logger.warning("side channel: %s", e)
            continue
        yield identity, key, message


def _user_id(frame: zmq.Frame) -> str:
    """The sender's CURVE public key, as the ZAP handler (``auth.Guard``) named the connection; "" without one."""
    try:
        return str(frame.get("User-Id"))
    except zmq.ZMQError:  # no ZAP handler on this context: the connection has no user id
        return ""


def send(sock: zmq.Socket[bytes], message: messages.Message, counters: Counters, identity: bytes = b"") -> bool:
    frames = [identity, messages.encode(message)] if identity else [messages.encode(message)]
    try:
        sock.send_multipart(frames, zmq.NOBLOCK)
        return True
    except (zmq.Again, zmq.ZMQError) as e:  # EHOSTUNREACH: that decode rank disconnected
        counters.undeliverable += 1
        logger.warning("side channel: could not deliver %s (%s)", type(message).__name__, e)
        return False
