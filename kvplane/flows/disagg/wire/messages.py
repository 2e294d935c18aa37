"""Side-channel messages between a decode rank and a prefill rank, as msgpack through msgspec (never pickle).

Every message is a tagged struct; ``decode`` rejects anything oversized, malformed or of an unknown type with a
``ProtocolError`` and the listener logs it and carries on. Who sends what:

- decode -> prefill: ``Handshake`` (the reply is the prefill's own ``Handshake`` or a ``Reject``), ``Heartbeat``
  (renews leases), ``ReadDone`` (a pull finished reading: the blocks may go), ``PushRegister`` (destination
  blocks for a push, and where the push starts when the decode holds the first tokens), ``Cancel`` (the decode
  gave up on a push).
- prefill -> decode: ``PushResult`` (a push to this decode rank ended), ``Problem`` (a request message the
  prefill could not act on, e.g. one addressed to a previous boot of it).

A decode rank numbers its handshakes on a connection (``attempt``) and the prefill's answer, its ``Handshake`` or a
``Reject``, carries the number of the handshake it answers: a late answer to a handshake that timed out is not
taken for the answer to the one sent after it.

``boot_id`` names one process lifetime: a peer that restarts has a new one, so the other side handshakes again
instead of using stale descriptors. Every message about a request carries its ``token`` (``tokens.py``), which
only the two sides of that request know.

Limits before work: every field has a bound checked while decoding (string lengths, list lengths, block ids
below 2**62), so a message that would make a side allocate or loop without bound is refused as malformed
before any handler sees it. A side checks block ids against the peer's pool size on top.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from kvplane.blocks.groups import HOLE
from kvplane.flows.disagg.wire.errors import ProtocolError

MAX_NAME = 512  # characters of an engine id, request id, boot id or reason
MAX_TOKEN = 64
MAX_GROUPS = 64  # KV-cache groups of one model
MAX_BLOCKS = 1 << 20  # block ids per group in one message (a side checks its pool size on top)
MAX_BLOCK_ID = 1 << 62
MAX_RANK = 1 << 16
MAX_HEARTBEAT_IDS = 4096  # requests one heartbeat renews; a decode with more sends several

Name = Annotated[str, Meta(max_length=MAX_NAME)]
RequestId = Annotated[str, Meta(min_length=1, max_length=MAX_NAME)]
Token = Annotated[str, Meta(max_length=MAX_TOKEN)]
Rank = Annotated[int, Meta(ge=0, lt=MAX_RANK)]
TpSize = Annotated[int, Meta(ge=1, le=MAX_RANK)]
BlockId = Annotated[int, Meta(ge=HOLE, lt=MAX_BLOCK_ID)]  # HOLE: a position without a block
GroupId = Annotated[int, Meta(ge=0, lt=1 << 16)]
BlockIds = Annotated[dict[GroupId, Annotated[list[BlockId], Meta(max_length=MAX_BLOCKS)]],
                     Meta(max_length=MAX_GROUPS)]  # KV-cache group -> block ids
Count = Annotated[int, Meta(ge=0, lt=1 << 62)]


class Handshake(msgspec.Struct, tag="handshake", frozen=True):
    engine_id: Name
    boot_id: Name
    role: Name  # "prefill" or "decode"
    rank: Rank
    tp_size: TpSize
    manifest: bytes  # Manifest.encode()
    peer: bytes  # the transport's PeerInfo, msgpack
    fingerprint: Name  # Manifest.fingerprint: the compatibility hash both sides compare
    attempt: Count = 0  # decode: this handshake's number on its connection; prefill: the one it answers


class Reject(msgspec.Struct, tag="reject", frozen=True):
    field: str
    local: str
    remote: str
    reason: str
    attempt: Count = 0  # the number of the handshake it answers


class Heartbeat(msgspec.Struct, tag="heartbeat", frozen=True):
    engine_id: Name
    rank: Rank
    requests: Annotated[list[tuple[RequestId, Token]], Meta(max_length=MAX_HEARTBEAT_IDS)]  # (request id, token)


class ReadDone(msgspec.Struct, tag="read_done", frozen=True):
    request_id: RequestId
    engine_id: Name
    rank: Rank
    tp_size: TpSize
    ok: bool
    expect_boot: Name  # the prefill boot the decode read from
    token: Token = ""


class PushRegister(msgspec.Struct, tag="push_register", frozen=True):
    request_id: RequestId
    engine_id: Name
    rank: Rank
    tp_size: TpSize
    block_ids: BlockIds
    num_tokens: Count
    staging_addr: Count  # where staged layers of this push land on the decode rank (0: none needed)
    staging_bytes: Count
    expect_boot: Name
    token: Token = ""
    # per group: the first token to write (a block boundary of both sides); the decode holds those before it
    first_tokens: Annotated[dict[GroupId, Count], Meta(max_length=MAX_GROUPS)] = {}


class Cancel(msgspec.Struct, tag="cancel", frozen=True):
    request_id: RequestId
    engine_id: Name
    rank: Rank
    token: Token = ""


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
        message: Message = _decoder.decode(data)  # typed as Message by msgspec >= 0.23, Any before
        return message
    except (msgspec.MsgspecError, ValueError) as e:  # ValueError: invalid UTF-8 inside a string
        raise ProtocolError(f"malformed side-channel message ({len(data)} B): {e}") from None
