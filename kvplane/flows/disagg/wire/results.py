"""How a request ends on either side: exactly one of ``done``, ``failed`` or ``timed_out``.

A ``Completion`` is reported once per request, when kvplane no longer touches its blocks: the engine may free
(prefill) or use (decode, ``done`` only) them then. ``failed_block_ids`` lists, per KV-cache group, the local
blocks whose bytes cannot be trusted, so an engine applies its policy (fail the request, or recompute them).
A partial transfer is never ``done``. ``skipped_blocks`` (decode): the request's blocks the transfer left out
because this rank held their KV already (``local_tokens``).
"""

from __future__ import annotations

from typing import Literal

import msgspec

State = Literal["done", "failed", "timed_out"]


class Completion(msgspec.Struct, frozen=True):
    request_id: str
    state: State
    failed_block_ids: dict[int, tuple[int, ...]] = {}
    reason: str = ""
    skipped_blocks: int = 0

    @property
    def ok(self) -> bool:
        return self.state == "done"

    def all_failed_block_ids(self) -> set[int]:
        return {b for ids in self.failed_block_ids.values() for b in ids}
