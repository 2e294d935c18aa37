"""A decode rank's connection to one prefill rank, as a pure state machine: ``Link``.

``DecodeConnections`` (``decode_conns.py``) keeps one link per prefill address for the side's life, feeds it
each event (a request or decline naming the rank, a handshake answer under its number, the answer's check,
the transport probe's end, a reset, the clock) and carries out the actions it returns: send a handshake under
a number, check an answer, probe the transport, wake the requests waiting on it. Nothing here does I/O, reads
the clock or logs: ``now`` and this rank's engine (``EngineView``) are arguments, and what is worth logging
comes back as a ``Note``.

The rules it enforces: only the answer to the latest handshake counts, once; an answer to a handshake that named
this rank's engine before a reset is about a descriptor that is gone, so the rank is asked again; a handshake
is never sent while this rank's engine is down after a reset (it would name an engine that is gone); a failed
link is tried again on the next request that names it, or after a doubling backoff while a decline waits for
it. Every change of phase is one of ``TRANSITIONS``, which docs/disagg.md lists (``transitions_table``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from kvplane import machines

RETRY_FIRST_S = 0.5  # a failed handshake with a rank that declines wait for is tried again after this, doubling
RETRY_MAX_S = 30.0


class LinkPhase(Enum):
    NEW = "new"  # no handshake sent yet
    DEFERRED = "deferred"  # a handshake is owed, sent once this rank's engine runs again after a reset
    HANDSHAKING = "handshaking"  # handshake number ``attempt`` is out; its answer is awaited
    PROBING = "probing"  # the answer checked out; the prefill's transport is being connected
    READY = "ready"  # requests use it
    STALE = "stale"  # ready, but a transport may have been reset since: handshake again before the next request
    FAILED = "failed"  # the handshake failed or timed out; tried again when a request or a decline needs it


_AGAIN = "handshake (deferred while this rank's engine is down)"
_HELLO = (LinkPhase.HANDSHAKING, LinkPhase.DEFERRED)  # where a handshake leads: sent, or owed until the engine runs
TRANSITIONS: tuple[tuple[LinkPhase, str, LinkPhase], ...] = (
    *((LinkPhase.NEW, f"a request or decline names the rank: {_AGAIN}", to) for to in _HELLO),
    (LinkPhase.DEFERRED, "this rank's engine runs again", LinkPhase.HANDSHAKING),
    (LinkPhase.DEFERRED, "handshake_timeout_s passed", LinkPhase.FAILED),
    (LinkPhase.HANDSHAKING, "the answer checks out", LinkPhase.PROBING),
    (LinkPhase.HANDSHAKING, "rejected, a bad answer, or handshake_timeout_s passed", LinkPhase.FAILED),
    *((LinkPhase.HANDSHAKING, f"the answer is to a handshake from before this rank's reset: {_AGAIN}", to)
      for to in _HELLO),
    (LinkPhase.PROBING, "the transport answers", LinkPhase.READY),
    (LinkPhase.PROBING, "the transport does not answer, or handshake_timeout_s passed", LinkPhase.FAILED),
    (LinkPhase.READY, "a transport was reset, or a READ from the rank failed", LinkPhase.STALE),
    *((LinkPhase.READY, f"a request names another lifetime of the rank, or this rank's engine restarted: {_AGAIN}",
       to) for to in _HELLO),
    *((LinkPhase.STALE, f"a request names the rank: {_AGAIN}", to) for to in _HELLO),
    (LinkPhase.FAILED, "a late answer to its latest handshake checks out", LinkPhase.PROBING),
    (LinkPhase.FAILED, "a late answer to its latest handshake does not check out", LinkPhase.FAILED),
    *((LinkPhase.FAILED, f"a request names it, or a decline waits for it past its backoff: {_AGAIN}", to)
      for to in _HELLO),
)
_ALLOWED = {(a, b) for a, _, b in TRANSITIONS}


def transitions_table() -> str:
    """The link machine's transitions as the markdown table docs/disagg.md carries."""
    return machines.transitions_table(TRANSITIONS)


@dataclass(frozen=True)
class EngineView:
    """This rank's own transfer engine as the shell sees it now: its generation (one more per reset), and
    whether it runs again since the latest reset (a handshake names its descriptor, so it waits until then)."""

    generation: int
    runs: bool


@dataclass(frozen=True)
class SendHello:
    attempt: int  # the number the handshake goes out under; only the answer under it is taken


@dataclass(frozen=True)
class Check:
    """Check the answer that came (``peers.check_hello``) and feed ``checked``."""


@dataclass(frozen=True)
class Probe:
    """Connect the prefill's transport and feed ``probed``."""


@dataclass(frozen=True)
class Ready:
    """The link is ready: send the declines waiting for it, show the requests waiting on it."""


@dataclass(frozen=True)
class Failed:
    reason: str  # shown to the requests waiting on the link, which are no longer waiting on it


@dataclass(frozen=True)
class Note:
    text: str  # for the log, at INFO


LinkAction = SendHello | Check | Probe | Ready | Failed | Note


class Link:
    def __init__(self, handshake_timeout_s: float) -> None:
        self.handshake_timeout_s = handshake_timeout_s
        self.phase = LinkPhase.NEW
        self.attempt = 0  # the number of the latest handshake sent
        self.answered = False  # its answer came (a second one is dropped)
        self.generation = -1  # of this rank's engine when that handshake was sent
        self.since = 0.0  # when the handshake (or its answer's probe) started, for handshake_timeout_s
        self.boot_id = ""  # the rank's lifetime, once ready
        self.error = ""  # why it failed last
        self.failures = 0  # in a row
        self.retry_at = float("inf")  # failed: when a decline waiting for the rank may handshake again

    @property
    def usable(self) -> bool:
        """Messages go out on it (a stale link still carries them; its next request handshakes again first)."""
        return self.phase in (LinkPhase.READY, LinkPhase.STALE)

    # -- events -------------------------------------------------------------------------------------------
    def need(self, now: float, engine: EngineView, boot_id: str = "") -> list[LinkAction]:
        """A request or a decline names the rank (``boot_id``: the lifetime it expects, "" for any)."""
        if self.phase in (LinkPhase.NEW, LinkPhase.FAILED, LinkPhase.STALE):
            return self._handshake(now, engine)
        other_lifetime = bool(boot_id) and bool(self.boot_id) and boot_id != self.boot_id
        if self.phase is LinkPhase.READY and (engine.generation != self.generation or other_lifetime):
            return self._handshake(now, engine)
        return []

    def answer(self, now: float, attempt: int, rejected: str | None, engine: EngineView) -> list[LinkAction]:
        """A ``Handshake`` (``rejected`` None) or ``Reject`` came, under ``attempt``."""
        kind = "Handshake" if rejected is None else "Reject"
        if attempt != self.attempt or self.answered:
            return [Note(f"answered handshake {attempt} ({kind}) after handshake {self.attempt} was sent; dropped")]
        if self.phase is LinkPhase.DEFERRED:  # it is asked again once this rank's engine runs
            self.answered = True
            return []
        if self.phase is LinkPhase.HANDSHAKING and self.generation != engine.generation:
            self.answered = True  # about a descriptor of this rank that is gone, whatever the verdict: ask again
            return self._handshake(now, engine)
        if rejected is not None:
            self.answered = True
            return self._fail(now, f"the prefill rank rejected the handshake: {rejected}") \
                if self.phase is LinkPhase.HANDSHAKING else []
        if self.phase not in (LinkPhase.HANDSHAKING, LinkPhase.FAILED):  # also a late one: declines may wait
            return []
        self.answered, self.since = True, now
        return [Check()]

    def checked(self, now: float, error: str = "") -> list[LinkAction]:
        """The answer was checked (``error``: why it is refused)."""
        if error:
            return self._fail(now, error)
        self._to(LinkPhase.PROBING)
        return [Probe()]

    def probed(self, now: float, error: str = "", boot_id: str = "") -> list[LinkAction]:
        """The prefill's transport was connected (``error``: it was not); ``boot_id``: the rank's lifetime."""
        if self.phase is not LinkPhase.PROBING:
            return []
        if error:
            return self._fail(now, error)
        self._to(LinkPhase.READY)
        self.boot_id, self.failures, self.retry_at, self.error = boot_id, 0, float("inf"), ""
        return [Ready()]

    def stale(self) -> list[LinkAction]:
        """A transport was reset, or a READ from the rank failed: learn its descriptor again before using it."""
        if self.phase is LinkPhase.READY:
            self._to(LinkPhase.STALE)
        return []

    def tick(self, now: float, engine: EngineView) -> list[LinkAction]:
        """The clock: a deferred handshake whose engine runs again, and the handshake's timeout."""
        if self.phase is LinkPhase.DEFERRED and engine.runs:
            return self._handshake(now, engine)
        if self.phase in (LinkPhase.DEFERRED, LinkPhase.HANDSHAKING, LinkPhase.PROBING) and \
                now - self.since > self.handshake_timeout_s:
            if self.phase is LinkPhase.DEFERRED:
                return self._fail(now, "this rank's transfer engine did not start again after a reset within "
                                       f"handshake_timeout_s={self.handshake_timeout_s}")
            if self.phase is LinkPhase.PROBING:
                return self._fail(now, f"the handshake was answered, but connecting its transport did not end within "
                                       f"handshake_timeout_s={self.handshake_timeout_s}")
            return self._fail(now, f"no answer to handshake {self.attempt} within handshake_timeout_s="
                                   f"{self.handshake_timeout_s}; is the prefill instance running and reachable?")
        return []

    def retry(self, now: float, engine: EngineView) -> list[LinkAction]:
        """A decline waits for the rank: handshake again once the backoff after its last failure ended."""
        if self.phase is LinkPhase.FAILED and now >= self.retry_at:
            self.retry_at = float("inf")
            return self._handshake(now, engine)
        return []

    # -- rules --------------------------------------------------------------------------------------------
    def _to(self, phase: LinkPhase) -> None:
        if (self.phase, phase) not in _ALLOWED:  # a bug in this file; the transition table is the contract
            raise RuntimeError(f"link: {self.phase.name} -> {phase.name} is not in TRANSITIONS")
        self.phase = phase

    def _handshake(self, now: float, engine: EngineView) -> list[LinkAction]:
        self.since = now
        if not engine.runs:  # the old descriptor names an engine that is gone, so the prefill would refuse it
            self._to(LinkPhase.DEFERRED)
            return []
        self._to(LinkPhase.HANDSHAKING)
        self.attempt, self.answered, self.generation = self.attempt + 1, False, engine.generation
        return [SendHello(self.attempt)]

    def _fail(self, now: float, reason: str) -> list[LinkAction]:
        self._to(LinkPhase.FAILED)
        self.error, self.failures = reason, self.failures + 1
        self.retry_at = now + min(RETRY_MAX_S, RETRY_FIRST_S * 2 ** min(self.failures - 1, 16))
        return [Failed(reason)]
