"""The kv-event stream machine against a model of vLLM's publisher: numbered batches, a replay buffer of the last
``buffer_steps``, restarts that count from 0 again; a subscriber that misses batches, gets duplicates and
undecodable ones, replays that fail, and publishers whose socket closes (restarts ZMQ reports). Whatever comes, the machine takes only transitions of its table, and
whenever it says ``SYNCED`` the batches applied since it last forgot the index are exactly the publisher's
batches of one run, in order, with none missing up to the last it has seen: from its first, or from a batch that
cleared the cache. (Batches missed after the last one seen show as a gap when the next one comes.)

A restart the numbers alone cannot tell (the new run's numbers reach past the old ones before a batch is seen) is
seen by the socket: the publisher's process ending closes it, and ZMQ's monitor says so (``disconnect`` here,
``Subscriber._disconnected``). Numbers that go back (a duplicate, a restart seen late) are ``dup`` here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from kvplane.machines import reachable
from kvplane.proxy.kv_stream import TRANSITIONS, Apply, Forget, Phase, Replay, Stream, transitions_table

OPS = ["publish", "publish", "publish", "drop", "clear", "disconnect", "dup", "garbage", "serve", "fail", "due",
       "tick"]


@dataclass
class World:
    buffer_steps: int
    stream: Stream
    run: int = 0
    published: list[tuple[int, int, bool]] = field(default_factory=list)  # (run, seq, clears) of this run
    applied: list[tuple[int, int, bool]] = field(default_factory=list)  # since the index was last forgotten
    pending: int | None = None  # a replay asked from this number, not yet answered
    now: float = 0.0

    def take(self, actions: list[Any]) -> None:
        for action in actions:
            if isinstance(action, Apply):
                self.applied.append(action.batch)
            elif isinstance(action, Forget):
                self.applied = []
            elif isinstance(action, Replay):
                assert self.stream.can_replay
                self.pending = action.start  # the shell drops a replay still running (Subscriber._end_replays)

    def publish(self, clears: bool, delivered: bool) -> None:
        batch = (self.run, len(self.published), clears)
        self.published.append(batch)
        if delivered:
            self.take(self.stream.live(batch[1], batch, clears))

    def serve_replay(self) -> None:
        start, self.pending = self.pending, None
        assert start is not None
        for batch in self.published[-self.buffer_steps:]:
            if batch[1] >= start:
                self.take(self.stream.replayed(batch[1], batch))
        self.take(self.stream.replay_end())

    def step(self, op: str, pick: int) -> None:
        s = self.stream
        if op in ("publish", "drop", "clear"):
            self.publish(op == "clear", op != "drop")
        elif op == "disconnect":  # the publisher's process ended: the socket tells, and the shell drops its replay
            self.run, self.published, self.pending = self.run + 1, [], None
            self.take(s.disconnected())
        elif op == "dup" and self.published:
            batch = self.published[pick % len(self.published)]
            self.take(s.live(batch[1], batch, batch[2]))
        elif op == "garbage":
            self.published.append((self.run, len(self.published), False))
            self.take(s.undecodable(len(self.published) - 1, "not msgpack"))
        elif op == "serve" and self.pending is not None:
            self.serve_replay()
        elif op == "fail" and self.pending is not None:
            self.pending = None
            self.take(s.replay_failed("no answer"))
        elif op == "due":
            s.expect(self.now)
        elif op == "tick":
            self.now += 2 * s.silence_s
            s.tick(self.now)

    def check(self) -> None:
        if self.stream.phase is not Phase.SYNCED:
            return
        seqs = [seq for _, seq, _ in self.applied]
        if not self.applied:  # a replay at start found nothing (yet: a batch missed since shows with the next one)
            assert self.stream.next_seq == 0
            return
        assert len({run for run, _, _ in self.applied}) == 1, f"batches of two runs applied: {self.applied}"
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), f"a gap or a repeat: {seqs}"
        assert seqs[0] == 0 or self.applied[0][2], f"began at batch {seqs[0]}, which cleared nothing"
        assert self.stream.next_seq == seqs[-1] + 1


@settings(max_examples=500, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 50)), max_size=60), st.booleans(),
       st.integers(1, 6), st.booleans())
def test_a_synced_stream_has_applied_one_run_of_batches_whole_and_in_order(
        ops: list[tuple[str, int]], can_replay: bool, buffer_steps: int, start_with_replay: bool) -> None:
    world = World(buffer_steps, Stream(can_replay, 1.0))
    if start_with_replay:
        world.take(world.stream.started())
    for op, pick in ops:
        world.step(op, pick)  # a transition outside TRANSITIONS raises
        world.check()


def test_a_gap_the_replay_fills_leaves_the_stream_in_step() -> None:
    world = World(10, Stream(True, 1.0))
    world.publish(False, True)
    world.publish(False, False)  # missed
    world.publish(False, True)
    assert world.stream.phase is Phase.REPLAYING and world.pending == 1
    world.serve_replay()
    assert world.stream.phase is Phase.SYNCED and [seq for _, seq, _ in world.applied] == [0, 1, 2]


def test_a_gap_older_than_the_replay_buffer_loses_the_stream_until_a_clear() -> None:
    world = World(1, Stream(True, 1.0))
    world.publish(False, True)
    world.publish(False, False)
    world.publish(False, False)
    world.publish(False, True)  # batch 3: the buffer holds only it
    world.serve_replay()
    assert world.stream.phase is Phase.LOST and world.applied == []
    world.publish(False, True)
    assert world.stream.phase is Phase.LOST
    world.publish(True, True)  # AllBlocksCleared: what follows is the whole truth again
    assert world.stream.phase is Phase.SYNCED and world.applied == [(0, 5, True)]


def test_a_restarted_publisher_without_replay_starts_over_from_its_first_batch() -> None:
    world = World(10, Stream(False, 1.0))
    for _ in range(3):
        world.publish(False, True)
    world.run, world.published = 1, []  # restarted, and its socket's closing was missed: the numbers go back
    world.publish(False, True)
    assert world.stream.phase is Phase.SYNCED and world.applied == [(1, 0, False)]


def test_a_stream_due_events_goes_silent_and_comes_back_with_the_next_batch() -> None:
    stream = Stream(False, 10.0)
    stream.live(0, "b0")
    stream.expect(100.0)
    assert not stream.tick(110.0) and stream.phase is Phase.SYNCED
    assert stream.tick(110.5) and stream.phase is Phase.SILENT
    assert stream.live(1, "b1") == [Apply(1, "b1")] and stream.phase is Phase.SYNCED
    assert not stream.tick(1000.0)  # nothing due any more


def test_at_start_the_publishers_earlier_batches_are_replayed() -> None:
    world = World(10, Stream(True, 1.0))
    world.publish(False, False)  # sent before the subscription was open
    world.publish(False, False)
    world.take(world.stream.started())
    assert world.stream.phase is Phase.REPLAYING and world.pending == 0
    world.serve_replay()
    assert world.stream.phase is Phase.SYNCED and [seq for _, seq, _ in world.applied] == [0, 1]


def test_every_phase_is_reachable_from_fresh() -> None:
    assert reachable(TRANSITIONS, Phase.FRESH) == set(Phase)


def test_docs_carry_the_stream_machines_table() -> None:
    text = (Path(__file__).parents[2] / "docs" / "proxy.md").read_text()
    block = re.search(r"<!-- kv-stream-transitions:begin -->\n(.*?)\n<!-- kv-stream-transitions:end -->", text, re.S)
    assert block is not None, "docs/proxy.md: the kv-event stream machine's table is missing"
    assert block.group(1) == transitions_table(), "docs/proxy.md: paste kv_stream.transitions_table() in"
