"""Side-channel messages between a decode rank and a prefill rank, as msgpack through msgspec (never pickle).

Every message is a tagged struct; ``decode`` rejects anything oversized, malformed or of an unknown type with a
``ProtocolError`` and the listener logs it and carries on. Who sends what:

- decode -> prefill: ``Handshake`` (the reply is the prefill's own ``Handshake`` or a ``Reject``), ``Heartbeat``
  (renews leases), ``ReadDone`` (a pull finished reading: the blocks may go), ``PushRegister`` (destination
  blocks for a push), ``Cancel`` (the decode gave up on a push).
- prefill -> decode: ``PushResult`` (a push to this decode rank ended), ``Problem`` (a request message the
  prefill could not act on, e.g. one addressed to a previous boot of it).

``boot_id`` names one process lifetime: a peer that restarts has a new one, so the other side handshakes again
instead of using stale descriptors.
"""

from __future__ import annotations

from typing import cast

import msgspec

from kvplane.flows.disagg.errors import ProtocolError

BlockIds = dict[int, list[int]]  # KV-cache group -> block ids


class Handshake(msgspec.Struct, tag="handshake", frozen=True):
    engine_id: str
    boot_id: str
    role: str  # "prefill" or "decode"
    rank: int
    tp_size: int
    manifest: bytes  # Manifest.encode()
    peer: bytes  # the transport's PeerInfo, msgpack
    fingerprint: str  # Manifest.fingerprint: the compatibility hash both sides compare


class Reject(msgspec.Struct, tag="reject", frozen=True):
    field: str
    local: str
    remote: str
    reason: str


class Heartbeat(msgspec.Struct, tag="heartbeat", frozen=True):
    engine_id: str
    rank: int
    request_ids: list[str]


class ReadDone(msgspec.Struct, tag="read_done", frozen=True):
    request_id: str
    engine_id: str
    rank: int
    tp_size: int
    ok: bool
    expect_boot: str  # the prefill boot the decode read from


class PushRegister(msgspec.Struct, tag="push_register", frozen=True):
    request_id: str
    engine_id: str
    rank: int
    tp_size: int
    block_ids: BlockIds
    num_tokens: int
    staging_addr: int  # where staged layers of this push land on the decode rank (0: none needed)
    staging_bytes: int
    expect_boot: str


class Cancel(msgspec.Struct, tag="cancel", frozen=True):
    request_id: str
    engine_id: str
    rank: int


class PushResult(msgspec.Struct, tag="push_result", frozen=True):
    request_id: str
    rank: int  # the prefill rank that pushed
    ok: bool
    reason: str = ""


class Problem(msgspec.Struct, tag="problem", frozen=True):
    request_id: str
    rank: int
    reason: str


Message = Handshake | Reject | Heartbeat | ReadDone | PushRegister | Cancel | PushResult | Problem
_decoder = msgspec.msgpack.Decoder(Message)
_encoder = msgspec.msgpack.Encoder()


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


def decode(data: bytes, max_bytes: int) -> Message:
    """One message from bytes; ``ProtocolError`` (naming the problem) for anything else."""
    if len(data) > max_bytes:
        raise ProtocolError(f"message of {len(data)} B exceeds max_message_bytes={max_bytes}; dropped")
    try:
        return cast(Message, _decoder.decode(data))
    except (msgspec.MsgspecError, ValueError) as e:  # ValueError: invalid UTF-8 inside a string
        raise ProtocolError(f"malformed side-channel message ({len(data)} B): {e}") from None
