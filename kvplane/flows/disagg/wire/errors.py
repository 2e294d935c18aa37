"""Typed errors of the disaggregation flow. Messages name the field, the value it had and the fix.

A peer that vanishes or a transfer that fails is not raised at the engine: the request ends ``failed`` or
``timed_out`` (``results.Completion``). These errors are for misuse (bad config, malformed transfer parameters)
and for a handshake that cannot succeed, which the request's completion quotes.
"""

from __future__ import annotations

from kvplane.errors import KvplaneError


class DisaggError(KvplaneError, ValueError):
    """The prefill or decode side was called with input it cannot act on."""


class DisaggConfigError(DisaggError):
    """A ``DisaggConfig`` field is out of range."""


class TransferParamsError(DisaggError):
    """``kv_transfer_params`` from a prefill instance are missing a field or hold a wrong value."""


class RelayoutError(DisaggError):
    """Staged blocks could not be re-laid out on this rank (a failure of its own, or its re-layout thread is
    closed): the request fails, and the prefill rank it read from is not suspected (no new handshake)."""


class HandshakeError(KvplaneError, RuntimeError):
    """The two sides cannot exchange KV: manifests differ, the peer refused, or it did not answer in time."""


class ProtocolError(KvplaneError, ValueError):
    """A side-channel message is malformed, oversized or of an unknown type."""
