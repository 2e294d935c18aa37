"""The KV-event subscriber of ``--policy kv-aware``: one thread, a ZMQ SUB socket per instance, replay on demand.

Each instance named with ``kv_events=tcp://HOST:PORT`` (``config.py``) gets a ``Feed``: its ``PrefixIndex``, its
``Stream`` machine and a lock the router shares. The thread blocks in ``zmq.Poller.poll`` (an idle proxy spends no
CPU here; the request path never waits on it), reads what came, runs each batch through the stream machine and
applies what it says to the index under the feed's lock. A ZMQ monitor on each SUB socket reports the publisher's
disconnection (its process ended), which starts the stream over. A gap is asked of the instance's replay socket
(``kv_events_replay=``) with a DEALER, as vLLM's ROUTER expects; a replay that does not end within
``REPLAY_TIMEOUT_S`` counts as failed. Every odd thing (a gap, a restart, a batch not readable, events of unknown
types, a batch from another data-parallel rank than the first one seen, the index at its bound) is counted in
``kvplane_proxy_kv_events_total{url, outcome}`` and logged once per instance and kind.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq

from kvplane.proxy import kv_wire
from kvplane.proxy.kv_index import PrefixIndex, tier_of
from kvplane.proxy.kv_stream import Action, Apply, Forget, Replay, Stream

logger = logging.getLogger("kvplane.proxy")
REPLAY_TIMEOUT_S = 5.0
Count = Callable[[str, str, int], None]  # (instance URL, outcome, how many)


@dataclass
class Feed:
    url: str
    endpoint: str
    replay_endpoint: str
    index: PrefixIndex
    stream: Stream
    lock: threading.Lock = field(default_factory=threading.Lock)
    dp_rank: int | None = None  # the data-parallel rank of the first batch: later ones from another are refused
    logged: set[str] = field(default_factory=set)

    def once(self, kind: str, message: str, *args: object) -> None:
        """A warning the first time this kind happens on this instance; later ones at debug level."""
        level = logging.DEBUG if kind in self.logged else logging.WARNING
        self.logged.add(kind)
        logger.log(level, "kvplane proxy: kv events of %s: " + message, self.url, *args)


class Subscriber:
    def __init__(self, feeds: list[Feed], count: Count) -> None:
        self.feeds = feeds
        self.count = count
        self._ctx = zmq.Context()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvplane-kv-events", daemon=True)
        self._wake = self._ctx.socket(zmq.PAIR)
        self._wake.bind(f"inproc://kv-events-wake-{id(self)}")
        self._subs: dict[zmq.Socket[bytes], Feed] = {}
        self._monitors: dict[zmq.Socket[bytes], Feed] = {}  # each SUB socket's EVENT_DISCONNECTED
        self._replays: dict[zmq.Socket[bytes], tuple[Feed, float]] = {}
        self._poller = zmq.Poller()  # the thread's own, as every socket above but _wake's peer

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        """False once started and its thread has ended (closed, or a bug of the proxy, logged with its traceback)."""
        return self._thread.ident is None or self._thread.is_alive()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            with self._ctx.socket(zmq.PAIR) as poke:
                poke.connect(f"inproc://kv-events-wake-{id(self)}")
                poke.send(b"")
            self._thread.join()
        self._ctx.destroy(linger=0)

    def _run(self) -> None:
        try:
            self._serve()
        except Exception:  # the router then serves by load (KvRouter.in_step: "stopped")
            logger.exception("kvplane proxy: the kv-event subscriber failed; routing by load from now on")

    def _serve(self) -> None:
        poller = self._poller
        poller.register(self._wake, zmq.POLLIN)
        for feed in self.feeds:
            sub = self._ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            sub.connect(feed.endpoint)
            poller.register(sub, zmq.POLLIN)
            poller.register(monitor, zmq.POLLIN)
            self._subs[sub] = feed
            self._monitors[monitor] = feed
            with feed.lock:
                self._run_actions(feed, feed.stream.started())
        while not self._stop.is_set():
            ready = dict(poller.poll(self._poll_ms()))
            for sock in ready:
                if sock in self._subs:
                    self._drain(sock, self._subs[sock], self._live)
                elif sock in self._replays:
                    self._drain(sock, self._replays[sock][0], self._replayed)
                elif sock in self._monitors:
                    self._drain(sock, self._monitors[sock], self._disconnected)
            self._expire_replays()

    def _drain(self, sock: zmq.Socket[bytes], feed: Feed, handle: Callable[..., None]) -> None:
        for _ in range(1000):  # then back to the poller, so one busy instance does not starve the others
            if sock.closed:  # a replay that just ended
                return
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            handle(sock, feed, frames)

    def _live(self, sock: zmq.Socket[bytes], feed: Feed, frames: list[bytes]) -> None:
        if len(frames) != 3:
            self.count(feed.url, "bad_frame", 1)
            feed.once("bad_frame", "a message of %d frames, not (topic, seq, payload): skipped", len(frames))
            return
        try:
            seq = kv_wire.seq_of(frames[1])
            batch, events, skipped = kv_wire.decode(frames[2])
        except kv_wire.WireError as e:
            with feed.lock:
                self._run_actions(feed, feed.stream.undecodable(-1 if len(frames[1]) != 8 else
                                                                int.from_bytes(frames[1], "big"), str(e)))
            return
        if feed.dp_rank is None:
            feed.dp_rank = batch.data_parallel_rank
        if batch.data_parallel_rank != feed.dp_rank:
            self.count(feed.url, "unknown_source", 1)
            feed.once("unknown_source", "a batch of data-parallel rank %s after batches of rank %s: not this "
                      "instance's stream, skipped (give each DP rank's endpoint as its own instance)",
                      batch.data_parallel_rank, feed.dp_rank)
            return
        if skipped:
            self.count(feed.url, "unknown_event", 1)
            feed.once("unknown_event", "%d events of types this proxy does not know: skipped", skipped)
        clears = any(isinstance(e, kv_wire.AllBlocksCleared) for e in events)
        with feed.lock:
            self._run_actions(feed, feed.stream.live(seq, events, clears))

    def _disconnected(self, sock: zmq.Socket[bytes], feed: Feed, frames: list[bytes]) -> None:
        self._end_replays(feed)
        feed.dp_rank = None
        with feed.lock:
            self._run_actions(feed, feed.stream.disconnected())

    def _replayed(self, sock: zmq.Socket[bytes], feed: Feed, frames: list[bytes]) -> None:
        if len(frames) == 4 and frames[2] == kv_wire.END_SEQ:  # (b"", b"", END_SEQ, b""): the ROUTER's end
            with feed.lock:
                self._run_actions(feed, feed.stream.replay_end())
            self._end_replay(sock)
            return
        try:
            if len(frames) != 4:
                raise kv_wire.WireError(f"a replayed message of {len(frames)} frames, not (b'', topic, seq, payload)")
            seq = kv_wire.seq_of(frames[2])
            _, events, _ = kv_wire.decode(frames[3])
        except kv_wire.WireError as e:
            with feed.lock:
                self._run_actions(feed, feed.stream.replay_failed(str(e)))
            self._end_replay(sock)
            return
        with feed.lock:
            self._run_actions(feed, feed.stream.replayed(seq, events))

    def _poll_ms(self) -> int | None:
        """Until the first replay's deadline; none pending: until a socket is readable (close wakes ``_wake``)."""
        if not self._replays:
            return None
        deadline = min(deadline for _, deadline in self._replays.values())
        return max(1, int((deadline - time.monotonic()) * 1000) + 1)

    def _expire_replays(self) -> None:
        now = time.monotonic()
        for sock, (feed, deadline) in list(self._replays.items()):
            if now > deadline:
                with feed.lock:
                    self._run_actions(feed, feed.stream.replay_failed(
                        f"{feed.replay_endpoint} did not end its replay within {REPLAY_TIMEOUT_S:g} s"))
                self._end_replay(sock)

    def _end_replay(self, sock: zmq.Socket[bytes]) -> None:
        self._poller.unregister(sock)
        del self._replays[sock]
        sock.close(linger=0)

    def _run_actions(self, feed: Feed, actions: list[Action]) -> None:
        """Under ``feed.lock``."""
        for action in actions:
            if isinstance(action, Apply):
                self._apply(feed, action.batch)
            elif isinstance(action, Forget):
                outcome = "restart" if action.restart else "lost"
                self.count(feed.url, outcome, 1)
                feed.once(outcome, "%s; routing by load until it is in step again", action.why)
                feed.index.reset() if action.restart else feed.index.cleared()
            elif isinstance(action, Replay):
                self._ask_replay(feed, action.start)

    def _end_replays(self, feed: Feed) -> None:
        """At most one replay per feed: an older one's answers belong to what the stream no longer asks."""
        for sock, (owner, _) in list(self._replays.items()):
            if owner is feed:
                self._end_replay(sock)

    def _ask_replay(self, feed: Feed, start: int) -> None:
        self._end_replays(feed)
        self.count(feed.url, "replay", 1)
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.connect(feed.replay_endpoint)
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        self._replays[dealer] = (feed, time.monotonic() + REPLAY_TIMEOUT_S)
        self._poller.register(dealer, zmq.POLLIN)

    def _apply(self, feed: Feed, events: list[kv_wire.Event]) -> None:
        evicted = apply(feed.index, events)
        self.count(feed.url, "batch", 1)
        if evicted:
            self.count(feed.url, "evicted", evicted)
            feed.once("evicted", "the index reached its bound (--kv-index-entries %d): the least recently "
                      "announced or used entries go", feed.index.max_entries)


def apply(index: PrefixIndex, events: list[kv_wire.Event]) -> int:
    """One batch's events, in order, to the index; the entries its bound dropped. Only KV-cache group 0 (or
    none named) counts: other groups of a hybrid model hash other blocks, of other sizes."""
    evicted = index.evicted
    for event in events:
        if isinstance(event, kv_wire.AllBlocksCleared):
            index.cleared()
        elif event.group_idx not in (None, 0):
            continue
        elif isinstance(event, kv_wire.BlockStored):
            index.stored(event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size,
                         tier_of(event.medium, event.locality), event.plain)
        else:
            index.removed(event.block_hashes, tier_of(event.medium, event.locality))
    return index.evicted - evicted
