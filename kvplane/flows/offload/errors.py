"""Typed errors of the offload flow. Messages name the field, the value it had and the fix.

A store tier that stops answering is not an error a request sees: the engine degrades to the host tier and logs
a warning. These errors are for misuse (bad config, unknown layer, unmatched ids) and for setting a store up.
"""

from __future__ import annotations

from kvplane.errors import KvplaneError


class OffloadError(KvplaneError, ValueError):
    """The offload engine was called with input it cannot act on (unknown layer, ids that do not pair up)."""


class OffloadConfigError(OffloadError):
    """An ``OffloadConfig`` or ``StoreConfig`` field is out of range."""


class StoreError(KvplaneError, RuntimeError):
    """The store tier cannot be used: Mooncake is not installed, or a store call failed."""


class StoreUnavailable(StoreError):
    """The store did not answer within its bound, or reports itself unhealthy; callers fall back to the host."""


class MasterError(StoreError):
    """``mooncake_master`` could not be found or started."""
