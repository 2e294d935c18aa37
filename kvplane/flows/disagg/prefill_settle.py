"""How a prefill rank ends its requests: push results to decode ranks, releases, lease expiry.

``Settler.settle`` runs on the I/O loop whenever something happened to a held request (a write ended, a decode
rank read or cancelled, the engine finished or aborted it) and releases the request once nothing more can
happen to its blocks: exactly one ``Completion`` each, ``done`` only when every decode rank of the instance read
or received every layer this rank owes it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kvplane.flows.disagg.messages import PushResult
from kvplane.flows.disagg.records import Held
from kvplane.flows.disagg.results import Completion, State
from kvplane.metrics import recorder

if TYPE_CHECKING:
    from kvplane.flows.disagg.prefill import PrefillSide

logger = logging.getLogger("kvplane.disagg")
REMEMBERED = 10_000  # released request ids kept to answer late messages about them


class Settler:
    def __init__(self, side: PrefillSide) -> None:
        self.side = side

    def settle(self, held: Held) -> None:
        """Report finished pushes, and release the request once nothing more can happen to its blocks."""
        side = self.side
        for target in held.targets.values():
            if target.reported or target.inflight or not target.checked:
                continue
            complete = held.finished and set(target.layers) <= target.sent
            if held.declined:  # one decode rank gave the request up: nothing more is written to any of them
                target.error = target.error or held.declined
            if target.error or held.aborted or complete or not target.layers:
                reason = target.error or ("aborted on the prefill instance" if held.aborted else "")
                ok = not reason and (complete or not target.layers)
                side._reply(target.peer.identity, PushResult(held.request_id, side.config.rank, ok, reason))
                target.reported = True
        if not held.known or any(t.inflight for t in held.targets.values()):
            return
        if held.aborted:
            self.release(held, "failed", "aborted before its prefill finished")
            return
        if not held.finished:
            return
        if held.declined:
            self.release(held, "failed", held.declined)
            return
        if held.reader_tp and len(held.readers) >= held.reader_tp:
            failed = [k for k, ok in held.readers.items() if not ok]
            if failed:
                self.release(held, "failed", f"decode rank(s) {failed} reported the read failed")
            else:
                self.release(held, "done")
        elif held.target_tp and len(held.targets) >= held.target_tp and all(t.reported for t in held.targets.values()):
            errors = [t.error for t in held.targets.values() if t.error]
            self.release(held, "failed" if errors else "done", "; ".join(errors))

    def release(self, held: Held, state: State, reason: str = "") -> None:
        side = self.side
        del side._held[held.request_id]
        side._out.registered.discard(held.request_id)
        side._released[held.request_id] = (f"{state}{': ' + reason if reason else ''}", held.token)
        while len(side._released) > REMEMBERED:
            side._released.popitem(last=False)
        if state != "done":
            side._limit.warn(logger, "prefill rank %d: request %s %s%s", side.config.rank, held.request_id, state,
                             f" ({reason})" if reason else "")
        recorder().request_ended(side.config.mode, state)
        side._out.add(Completion(held.request_id, state, reason=reason))

    def expire(self, held: Held) -> None:
        side = self.side
        recorder().lease_expired()
        if not held.known:  # word of a request that never came here: nothing of the engine's is held
            del side._held[held.request_id]
            side._out.registered.discard(held.request_id)
            side._early -= 1
            for target in held.targets.values():
                if not target.reported:
                    side._reply(target.peer.identity, PushResult(held.request_id, side.config.rank, False,
                                                                 "the prefill instance never saw this request"))
            return
        for target in held.targets.values():
            if not target.reported:
                target.error = target.error or "lease expired before the push completed"
                side._reply(target.peer.identity, PushResult(held.request_id, side.config.rank, False, target.error))
                target.reported = True
        self.release(held, "timed_out", f"lease of {side.config.lease_s} s expired without the decode finishing")
