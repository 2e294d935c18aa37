"""Per-request tokens: 128 random bits that bind every side-channel message to one request.

The prefill draws a request's token (``new_token``) and puts it in ``kv_transfer_params`` (pull), or a proxy
draws it and puts it in both sides' parameters (push, ``TransferParams.for_push``). A ``ReadDone``, ``Cancel``,
``Heartbeat`` or ``PushRegister`` counts only when it carries the token, compared in constant time, so a third
party that learned a request id and boot id (both travel in the parameters too) cannot end, hold or hijack it.
"""

from __future__ import annotations

import hmac
import re
import secrets

TOKEN_BYTES = 16
_FORMAT = re.compile(r"[0-9a-f]{32}")


def new_token() -> str:
    return secrets.token_hex(TOKEN_BYTES)


def is_token(value: str) -> bool:
    return bool(_FORMAT.fullmatch(value))


def same_token(expected: str, given: str) -> bool:
    """``given`` is the request's token; never true for a request that has none."""
    return bool(expected) and hmac.compare_digest(expected.encode(), given.encode())
