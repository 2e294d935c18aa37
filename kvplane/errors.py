"""Typed errors of kvplane. Every message names the field, the value it had, and how to fix it.

Callers catch ``KvplaneError`` for anything kvplane rejects; the subclasses say which layer rejected it.
Input is never checked with ``assert``.
"""


class KvplaneError(Exception):
    """Base class of every error kvplane raises on purpose."""


class SpecError(KvplaneError, ValueError):
    """A KV spec is inconsistent (groups, layers, slots)."""


class LayoutError(KvplaneError, ValueError):
    """An engine tensor does not have the shape, dtype or strides its layout spec requires."""


class ManifestMismatch(KvplaneError, ValueError):
    """Two manifests cannot exchange KV: a field differs. Carries the field and both values."""

    def __init__(self, field: str, local: object, remote: object, fix: str = "") -> None:
        self.field, self.local, self.remote = field, local, remote
        message = f"manifest field {field!r} differs: local={local!r}, remote={remote!r}"
        super().__init__(f"{message}. {fix}" if fix else message)


class TransportMismatch(ManifestMismatch):
    """Two ranks' transports share nothing they could reach each other by (field ``transport``)."""

    def __init__(self, local: str, remote: str, fix: str) -> None:
        super().__init__("transport", local, remote, fix)
        self.args = (f"no transport in common: this rank {local}, the peer {remote}; no byte can move between "
                     f"them. {fix}",)


class ManifestDecodeError(KvplaneError, ValueError):
    """Bytes that should hold a manifest do not decode to one."""


class BlockError(KvplaneError, ValueError):
    """Block pool misuse: double free, unknown id, freeing a referenced block, pool exhausted."""


class PoolExhausted(BlockError):
    """No free or evictable block is left for an allocation."""


class PlanError(KvplaneError, ValueError):
    """A copy plan is malformed or does not cover exactly the bytes a request needs."""


class BackendError(KvplaneError, RuntimeError):
    """Backend discovery, selection or a backend primitive failed."""


class BackendUnavailable(BackendError):
    """The requested backend is installed but cannot run here (missing device package, no device)."""


class UnknownBackend(BackendError):
    """No installed backend has the requested name."""


class TransportError(KvplaneError, RuntimeError):
    """A transfer engine could not be set up, register memory, or reach a peer."""


class TransportUnavailable(TransportError):
    """The transfer engine's package is not installed or does not import here."""


class PeerUnreachable(TransportError):
    """The peer is unknown, refused the connection, or vanished."""


class TransferFailed(TransportError):
    """The engine reported a transfer as failed (after bounded retries)."""


class TransferTimeout(TransportError):
    """A transfer did not complete within its deadline."""
