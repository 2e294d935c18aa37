"""Staged pulls in bounded chunks, between real sides in this process (Mooncake and NIXL on 127.0.0.1).

Fused against split MLA stages every layer: whole source blocks land in the decode's staging buffer and are
re-laid out into its cache. A pull several times larger than ``DisaggConfig.staging_bytes`` must still land
every byte, chunk by chunk through that buffer; a buffer smaller than one source block is refused naming the
field, its value and the minimum. A push still stages the whole request (its protocol has no per-chunk flow
control), so a push larger than the buffer is refused the same way.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import numpy as np
import pytest
import torch
from kvref import canonical
from pair import Engine, make, prefill_ranks, push_params, token_for, watched_local_kv

from kvplane.flows.disagg.decode import decode_side as decode_module
from kvplane.flows.disagg.decode import decode_start, staged_pull
from kvplane.kv.spec import KVSpec

ENGINES = ("mooncake", "nixl")
TOKENS = 200
RANK, ROPE = 64, 16


def mla(block: int) -> KVSpec:
    return KVSpec.mla(4, kv_lora_rank=RANK, rope_dim=ROPE, dtype="float32", tokens_per_block=block)


def source_block_bytes(block: int) -> int:
    """One source block of one layer: ``block`` tokens of kv_c + k_pe, float32 (fused or split alike)."""
    return block * (RANK + ROPE) * 4


def landed(spec: KVSpec, decode: Engine, d_ids: list[int], prefill: Engine, p_ids: list[int], tokens: int) -> bool:
    """Every layer's tokens equal on both sides, compared as bits (the seeded pattern holds NaNs as floats)."""
    for layer in spec.layers:
        got = canonical(decode.layout, decode.cache[layer.name], np.asarray(d_ids), tokens, layer)
        want = canonical(prefill.layout, prefill.cache[layer.name], np.asarray(p_ids), tokens, layer)
        for slot in want:
            if not torch.equal(got[slot].contiguous().view(torch.int32), want[slot].contiguous().view(torch.int32)):
                return False
    return True


CASES = {  # (prefill layout, block), (decode layout, block)
    "fused-to-split": (("mla_fused", 16), ("mla_split", 16)),
    "split-to-fused": (("mla_split", 16), ("mla_fused", 16)),
    "fused16-to-split32": (("mla_fused", 16), ("mla_split", 32)),  # chunks end inside a decode block
    "split32-to-fused16": (("mla_split", 32), ("mla_fused", 16)),
}


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("case", list(CASES))
def test_a_pull_many_times_larger_than_staging_bytes_lands_every_byte(case: str, engine: str) -> None:
    (p_layout, p_block), (d_layout, d_block) = CASES[case]
    p_spec, d_spec = mla(p_block), mla(d_block)
    staging = 3 * source_block_bytes(p_block)  # the request stages 4 layers x 7-13 blocks: 9-17x this
    prefill = make("prefill", p_spec, p_layout, seed=7, engine=engine)
    decode = make("decode", d_spec, d_layout, engine=engine, staging_bytes=staging)
    try:
        tables = {}
        for request in ("r1", "r2", "r3"):  # started at once: they queue for the buffer, each reuses its range
            p_ids, d_ids = prefill.allocate(TOKENS), decode.allocate(TOKENS)
            tables[request] = p_ids, d_ids
            decode.side.start_pull(request, prefill.side.request_finished(request, p_ids, TOKENS), d_ids)
        for request, (p_ids, d_ids) in tables.items():
            done = decode.wait(request)
            assert done.state == "done", done.reason
            assert landed(d_spec, decode, d_ids, prefill, p_ids, TOKENS)
            assert prefill.wait(request).state == "done"
        assert decode.side.local.arena.in_use == 0
        assert prefill.side.held_requests() == 0
    finally:
        decode.close()
        prefill.close()


@pytest.mark.parametrize("engine", ENGINES)
def test_staging_smaller_than_one_source_block_is_refused_naming_the_minimum(engine: str) -> None:
    prefill = make("prefill", mla(16), "mla_fused", seed=3, engine=engine)
    decode = make("decode", mla(16), "mla_split", engine=engine, staging_bytes=1000)
    try:
        p_ids = prefill.allocate(40)
        decode.side.start_pull("r", prefill.side.request_finished("r", p_ids, 40), decode.allocate(40))
        done = decode.wait("r")
        assert done.state == "failed"
        assert "DisaggConfig.staging_bytes=1000" in done.reason
        assert f"at least {source_block_bytes(16)}" in done.reason
        assert prefill.wait("r").state == "failed"  # told at once (ReadDone not ok), not after the lease
    finally:
        decode.close()
        prefill.close()


def test_a_push_larger_than_staging_bytes_is_refused_saying_a_push_stages_the_whole_request() -> None:
    prefill = make("prefill", mla(16), "mla_fused", seed=3, mode="push")
    decode = make("decode", mla(16), "mla_split", mode="push", staging_bytes=3 * source_block_bytes(16))
    try:
        params = push_params(prefill.side.base_port, "r", prefill.side.config.engine_id)
        decode.side.register_push("r", params, decode.allocate(TOKENS), TOKENS)
        prefill.side.request_finished("r", prefill.allocate(TOKENS), TOKENS, token=token_for("r"))
        done = decode.wait("r")
        need = 4 * -(-TOKENS // 16) * source_block_bytes(16)
        assert done.state == "failed"
        assert "push" in done.reason and "DisaggConfig.staging_bytes" in done.reason
        assert f"at least {need}" in done.reason
    finally:
        decode.close()
        prefill.close()


@pytest.mark.parametrize("engine", ENGINES)
def test_an_abort_during_a_chunked_pull_stops_it_and_gives_the_staging_range_back(engine: str) -> None:
    """Aborted right after it starts (however far its chunks got), the request is reported once, the prefill is
    told, the range goes back, and the next pull through the same buffer lands every byte."""
    spec = mla(16)
    prefill = make("prefill", spec, "mla_fused", num_blocks=160, seed=9, engine=engine)
    decode = make("decode", spec, "mla_split", num_blocks=160, engine=engine,
                  staging_bytes=2 * source_block_bytes(16))
    try:
        tokens = 1000  # 63 blocks x 4 layers: 252 chunks of one block, two in flight
        p_ids, d_ids = prefill.allocate(tokens), decode.allocate(tokens)
        decode.side.start_pull("big", prefill.side.request_finished("big", p_ids, tokens), d_ids)
        decode.side.abort("big")
        assert decode.wait("big").state in ("failed", "done")  # "done" only if every chunk beat the abort
        prefill.wait("big")
        assert decode.side.local.arena.in_use == 0
        p_ids, d_ids = prefill.allocate(TOKENS), decode.allocate(TOKENS)
        decode.side.start_pull("next", prefill.side.request_finished("next", p_ids, TOKENS), d_ids)
        assert decode.wait("next").state == "done"
        assert landed(spec, decode, d_ids, prefill, p_ids, TOKENS)
    finally:
        decode.close()
        prefill.close()


@pytest.mark.parametrize("engine", ENGINES)
def test_a_chunk_whose_relayout_executor_closed_fails_the_pull_instead_of_hanging(engine: str) -> None:
    """While a side closes, its re-layout executor may close before the last READ of a chunk calls back (the
    loop's stop gives up after its timeout). Such a chunk must end: the request fails, naming why, its staging
    range goes back and the prefill is told. On main at cbeed0c ``post`` raised on the loop, the chunk stayed
    busy and the request never ended (a pull past its deadline drains until its READs end)."""
    spec = mla(16)
    prefill = make("prefill", spec, "mla_fused", seed=9, engine=engine)
    decode = make("decode", spec, "mla_split", engine=engine, staging_bytes=3 * source_block_bytes(16),
                  transfer_timeout_s=3.0, handshake_timeout_s=3.0)
    try:
        decode.side._starter.relayouts.close()  # as DecodeSide.close does, with the loop still running
        p_ids = prefill.allocate(TOKENS)
        decode.side.start_pull("r", prefill.side.request_finished("r", p_ids, TOKENS), decode.allocate(TOKENS))
        done = decode.wait("r", 20.0)
        assert done.state == "failed" and "re-layout" in done.reason, done.reason
        assert decode.side.local.arena.in_use == 0
        assert prefill.wait("r").state == "failed"  # told by ReadDone(ok=False), not left to its lease
    finally:
        decode.close()
        prefill.close()


def test_a_failed_relayout_fails_its_request_only_and_keeps_the_prefill_connection(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """A re-layout that fails is this rank's own fault (here: the first one raises), not the prefill's: the
    request fails, naming it, and the prefill is told; the next request reuses the connection as it is. On main
    at cbeed0c the failure marked the connection stale, as a failed READ does (the prefill's engine may have
    been reset), and the next request handshook again for nothing."""
    real, calls = staged_pull.apply_relayout, []

    def relayout_failing_once(*args: Any) -> None:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("planted re-layout failure")
        real(*args)

    monkeypatch.setattr(staged_pull, "apply_relayout", relayout_failing_once)
    spec = mla(16)
    prefill = make("prefill", spec, "mla_fused", seed=7)
    decode = make("decode", spec, "mla_split", staging_bytes=3 * source_block_bytes(16))
    try:
        p_ids, d_ids = prefill.allocate(TOKENS), decode.allocate(TOKENS)
        decode.side.start_pull("bad", prefill.side.request_finished("bad", p_ids, TOKENS), d_ids)
        done = decode.wait("bad")
        assert done.state == "failed" and "planted re-layout failure" in done.reason, done.reason
        assert prefill.wait("bad").state == "failed"
        with caplog.at_level(logging.WARNING, logger="kvplane.disagg"):
            p_ids, d_ids = prefill.allocate(TOKENS), decode.allocate(TOKENS)
            decode.side.start_pull("next", prefill.side.request_finished("next", p_ids, TOKENS), d_ids)
            assert decode.wait("next").state == "done"
        assert landed(spec, decode, d_ids, prefill, p_ids, TOKENS)
        again = [r.getMessage() for r in caplog.records if "handshaking again" in r.getMessage()]
        assert again == [], again
    finally:
        decode.close()
        prefill.close()


def calls_before_each_start(monkeypatch: pytest.MonkeyPatch, side: Any, name: str) -> tuple[list[int], list[int]]:
    """Count the calls of ``decode_start.<name>``: the calls (one entry each), and a list that gets, at each start
    attempt of ``side``'s Starter, how many of those calls came before it."""
    real, calls, starts = getattr(decode_start, name), [], []
    real_start = side._starter.start

    def counted(*args: Any) -> Any:
        calls.append(1)
        return real(*args)

    def start(want: Any) -> Any:
        starts.append(len(calls))
        return real_start(want)

    monkeypatch.setattr(decode_start, name, counted)
    monkeypatch.setattr(side._starter, "start", start)
    return starts, calls


def wait_for_starts(starts: list[int], count: int = 6) -> None:
    """Until the first start and five retries were made (a hang guard, not a timing check)."""
    end = time.monotonic() + 20
    while len(starts) < count:
        assert time.monotonic() < end, f"only {len(starts)} starts"
        time.sleep(0.01)


def test_a_pull_waiting_for_staging_room_is_planned_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """While the staging buffer is full, a staged pull retries its start on every tick of the loop (20 ms): it
    must reuse the plan it made, not plan again each time (on main at cbeed0c every retry called the planner
    again, for every layer of every prefill rank). Once room is free, the same plan lands every byte."""
    spec = mla(16)
    prefill = make("prefill", spec, "mla_fused", seed=7)
    decode = make("decode", spec, "mla_split", staging_bytes=3 * source_block_bytes(16))
    side = decode.side
    starts, _ = calls_before_each_start(monkeypatch, side, "route_plan")
    try:
        arena = side.local.arena
        held = side._loop.submit(lambda: arena.take(arena.size)).result(10)  # another request holds it all
        p_ids, d_ids = prefill.allocate(TOKENS), decode.allocate(TOKENS)
        side.start_pull("r", prefill.side.request_finished("r", p_ids, TOKENS), d_ids)
        wait_for_starts(starts)
        assert starts[1] > 0 and starts[-1] == starts[1], f"planner calls before each start: {starts}"
        side._loop.submit(lambda: arena.give(held)).result(10)
        assert decode.wait("r").state == "done"
        assert landed(spec, decode, d_ids, prefill, p_ids, TOKENS)
    finally:
        decode.close()
        prefill.close()


def test_a_pull_from_prefill_ranks_whose_manifests_differ_is_refused_naming_the_field() -> None:
    """A chunked pull decides per layer, for all prefill ranks at once, whether it lands directly or is staged:
    that holds when the ranks of the prefill instance have the same manifest. Here rank 0 stores head-major
    blocks (its heads land directly in the decode's head-major blocks) and rank 1 token-major ones (staged and
    re-laid out over the same destination blocks). The pull is refused, naming the field, both values and the
    fix, and both prefill ranks are told. On main at cbeed0c it went ahead, mixing both kinds of writes."""
    spec = KVSpec.gqa(2, 2, 32, tokens_per_block=16, dtype="float32")  # one rank's share of 4 KV heads
    ranks = prefill_ranks(spec, ["packed_kv@HND", "packed_kv"], seed=7)
    decode = make("decode", KVSpec.gqa(2, 4, 32, tokens_per_block=16, dtype="float32"), "packed_kv@HND")
    try:
        params = [r.side.request_finished("r", r.allocate(TOKENS), TOKENS, token=token_for("r")) for r in ranks]
        decode.side.start_pull("r", params[0], decode.allocate(TOKENS))
        done = decode.wait("r")
        assert done.state == "failed", done
        assert "regions['layers.0']" in done.reason and "'HND'" in done.reason and "'NHD'" in done.reason, \
            done.reason
        assert "same KV layout" in done.reason, done.reason
        assert [r.wait("r").state for r in ranks] == ["failed", "failed"]
    finally:
        decode.close()
        for r in ranks:
            r.close()


def test_a_push_waiting_for_staging_room_is_planned_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """As a pull: a staged push retrying its start on every tick while the buffer is full plans once (on main at
    cbeed0c every retry planned the whole request again to size it), and is not planned again when it starts (on
    main at 46387ea the start planned once more, for the re-layout, what sizing had planned already)."""
    spec = mla(16)
    prefill = make("prefill", spec, "mla_fused", seed=7, mode="push")
    decode = make("decode", spec, "mla_split", mode="push", staging_bytes=4 * 13 * source_block_bytes(16))
    side = decode.side
    starts, plans = calls_before_each_start(monkeypatch, side, "route_plan")
    try:
        arena = side.local.arena
        held = side._loop.submit(lambda: arena.take(arena.size)).result(10)  # another request holds it all
        p_ids, d_ids = prefill.allocate(TOKENS), decode.allocate(TOKENS)
        side.register_push("r", push_params(prefill.side.base_port, "r", prefill.side.config.engine_id), d_ids,
                           TOKENS)
        wait_for_starts(starts)
        assert starts[1] > 0 and starts[-1] == starts[1], f"sizings before each start: {starts}"
        side._loop.submit(lambda: arena.give(held)).result(10)
        prefill.side.request_finished("r", p_ids, TOKENS, token=token_for("r"))
        assert decode.wait("r").state == "done"
        assert len(plans) == starts[1], f"plans made: {len(plans)}, before the first retry: {starts[1]}"
        assert landed(spec, decode, d_ids, prefill, p_ids, TOKENS)
    finally:
        decode.close()
        prefill.close()


@pytest.mark.parametrize("engine", ENGINES)
def test_a_chunk_whose_relayout_is_dropped_at_close_fails_the_pull_instead_of_hanging(
    monkeypatch: pytest.MonkeyPatch, engine: str
) -> None:
    """The other way a closing side loses a re-layout: queued behind a running one when the executor closes
    and drops what has not begun. That chunk must end too (on main at cbeed0c nothing ever called it back)."""
    real, entered, release = staged_pull.apply_relayout, threading.Event(), threading.Event()

    def held_relayout(*args: Any) -> None:
        entered.set()
        assert release.wait(30), "the test never released the re-layout"
        real(*args)

    real_read, reads = staged_pull.StagedPull._read, []

    def counted_read(self: Any, *args: Any) -> None:
        real_read(self, *args)
        reads.append(1)  # this chunk's re-layout is queued (or it failed)

    monkeypatch.setattr(staged_pull, "apply_relayout", held_relayout)
    monkeypatch.setattr(staged_pull.StagedPull, "_read", counted_read)
    spec = mla(16)
    prefill = make("prefill", spec, "mla_fused", seed=9, engine=engine)
    decode = make("decode", spec, "mla_split", engine=engine,
                  staging_bytes=2 * source_block_bytes(16))  # two one-block slots
    try:
        p_ids = prefill.allocate(TOKENS)
        decode.side.start_pull("r", prefill.side.request_finished("r", p_ids, TOKENS), decode.allocate(TOKENS))
        end = time.monotonic() + 20
        while not (entered.is_set() and len(reads) >= 2):  # one re-layout running, one queued (hang guard only)
            assert time.monotonic() < end, "the first two chunks did not land"
            time.sleep(0.005)
        decode.side._starter.relayouts.close(discard_pending=True, wait=False)  # as DecodeSide.close does
        release.set()
        done = decode.wait("r", 20.0)
        assert done.state == "failed" and "re-layout" in done.reason, done.reason
        assert decode.side.local.arena.in_use == 0
        assert prefill.wait("r").state == "failed"
    finally:
        release.set()
        decode.close()
        prefill.close()


@pytest.mark.parametrize("engine", ENGINES)
def test_close_ends_a_running_relayout_before_the_local_kv_closes_and_reports_its_chunk(
    monkeypatch: pytest.MonkeyPatch, engine: str
) -> None:
    """``DecodeSide.close`` while a staged chunk is being re-laid out: the re-layout executor closes (and the
    running re-layout ends) before the loop stops and the ``LocalKV`` closes, so no re-layout writes after the
    local KV closed, and the chunk's end is still reported. On main the loop, the transfer thread and the local KV
    closed first: the re-layout wrote after that, and the request was never reported."""
    watched, built = watched_local_kv()
    monkeypatch.setattr(decode_module, "LocalKV", watched)
    real, entered, local_closed_at_write = staged_pull.apply_relayout, threading.Event(), []

    def relayout_during_close(*args: Any) -> None:
        entered.set()
        end = time.monotonic() + 30
        # hang guard only: whichever of the two closes comes first decides
        while not (relayouts.closed or built[-1].closes):
            assert time.monotonic() < end, "the side never began to close"
            time.sleep(0.001)
        local_closed_at_write.append(built[-1].closes > 0)
        real(*args)

    monkeypatch.setattr(staged_pull, "apply_relayout", relayout_during_close)
    spec = mla(16)
    prefill = make("prefill", spec, "mla_fused", seed=9, engine=engine)
    decode = make("decode", spec, "mla_split", engine=engine, staging_bytes=64 * source_block_bytes(16))
    relayouts = decode.side._starter.relayouts
    try:
        p_ids = prefill.allocate(16)
        decode.side.start_pull("r", prefill.side.request_finished("r", p_ids, 16), decode.allocate(16))
        assert entered.wait(20), "the staged chunk never reached its re-layout"
        decode.close()
        assert local_closed_at_write and not any(local_closed_at_write)  # one entry per layer re-laid out
        assert "r" in decode.collect()  # reported before the loop stopped (done: its one chunk landed)
    finally:
        decode.close()
        prefill.close()
