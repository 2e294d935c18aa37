"""``ProxyError``: what went wrong on one request, as the HTTP answer the client gets.

Every failure the proxy sees (a bad request, an instance that is down, fails, hangs, resets or answers garbage)
becomes one of these: an HTTP status, a short ``cause`` label (the ``cause`` of the errors metric) and a message
that names the instance and what to check. ``app.py`` answers it as an OpenAI-style JSON error body.
"""

from __future__ import annotations

from typing import Any

from kvplane.errors import KvplaneError


class ProxyError(KvplaneError):
    """``instance_status``: the HTTP status the instance answered (``<leg>_status``), or the ``code`` of the error
    event that began its stream; 0 for every other failure."""

    def __init__(self, status: int, cause: str, message: str, instance_status: int = 0) -> None:
        super().__init__(message)
        self.status, self.cause, self.message = status, cause, message
        self.instance_status = instance_status

    def body(self, request_id: str) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.cause, "code": self.status,
                          "request_id": request_id}}


class ProxyConfigError(KvplaneError, ValueError):
    """A proxy setting that cannot work, named with its value and the fix (raised at startup)."""
