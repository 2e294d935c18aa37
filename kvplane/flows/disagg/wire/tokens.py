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

from kvplane.flows.disagg.wire.errors import DisaggError

TOKEN_BYTES = 16
_FORMAT = re.compile(r"[0-9a-f]{32}")


def new_token() -> str:
    return secrets.token_hex(TOKEN_BYTES)


def is_token(value: str) -> bool:
    return bool(_FORMAT.fullmatch(value))


def same_token(expected: str, given: str) -> bool:
    """``given`` is the request's token; never true for a request that has none."""
    return bool(expected) and hmac.compare_digest(expected.encode(), given.encode())


def request_token(request_id: str, token: str | None, known: str | None, mode: str, tp_size: int) -> str:
    """The token a prefill rank holds ``request_id`` under: ``token`` if given (the one ``start_request`` was
    given, ``known``, otherwise), else a fresh one, which only a single-rank pull may draw for itself."""
    if token is None:
        token = known
    if token is None:
        if mode != "pull":
            raise DisaggError(
                f"request {request_id!r}: mode={mode!r} needs the token the proxy gave both instances; pass "
                f"token=params.kvplane_token (build the params with TransferParams.for_push)"
            )
        if tp_size > 1:
            raise DisaggError(
                f"request {request_id!r}: with tp_size={tp_size} every rank must hold the same token; draw one "
                f"with kvplane.flows.disagg.wire.tokens.new_token() and pass token= to each rank"
            )
        return new_token()
    if known is not None and token != known:
        raise DisaggError(f"request {request_id!r}: token differs from the one start_request was given")
    if not is_token(token):
        raise DisaggError(f"request {request_id!r}: token={token!r} is not 32 lowercase hex digits; draw it with "
                          f"kvplane.flows.disagg.wire.tokens.new_token()")
    return token
