"""Failures on the P/D path: peers that die mid-transfer, leases, mismatched models, bad messages, restarts,
aborts and a partial transfer. Every path ends the request in exactly one of done / failed / timed_out, within
a bound, with every block back in its engine's pool.
"""

from __future__ import annotations

import random
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
import zmq
from framed import FramedProcess
from kvfill import digest
from kvref import canonical
from pair import Engine, make, push_params, ready_prefill_ranks, small_spec, token_for
from rank_pool import spawn

from kvplane.flows.disagg import DisaggError, TransferParamsError
from kvplane.flows.disagg.wire import messages
from kvplane.flows.disagg.wire.config import DisaggConfig
from kvplane.flows.disagg.wire.local import LocalKV
from kvplane.kv.binding import allocate_cache
from kvplane.kv.bound import bind
from kvplane.kv.spec import KVSpec

pytestmark = pytest.mark.integration
ENGINES = ("mooncake", "nixl")
BIG = KVSpec.gqa(8, 8, 128, tokens_per_block=16)  # 32 KiB a token: 16k tokens = 512 MiB per side
BIG_TOKENS, BIG_BLOCKS = 16_384, 1100
FAILURE_BOUND_S = 25.0  # transfer_timeout_s is 10 in these tests: a failure must be reported well within this


@pytest.fixture
def worker(tmp_path: Path) -> Iterator[FramedProcess]:
    proc = spawn(tmp_path / "worker.log")
    try:
        yield proc
    finally:
        proc.kill()


def wait_until(predicate: object, within_s: float, what: str) -> None:
    end = time.monotonic() + within_s
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > end:
            raise AssertionError(f"{what} did not happen within {within_s} s")
        time.sleep(0.001)


def port_below_ephemeral_range() -> int:
    """A free port for a prefill that restarts on it. Not one the kernel hands out as a connection's source port:
    between the close and the restart, any outbound connection on the host (the decode's own reconnects
    included) could take such a port, and the restarted prefill could not bind it."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for port in random.sample(range(max(1024, low - 8000), low), 200):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise AssertionError(f"no free port in {max(1024, low - 8000)}..{low - 1}")


def big_config(role: str, engine: str, **extra: object) -> dict[str, object]:
    return {"engine_id": f"{role}-big", "transport": engine, "transfer_timeout_s": 10.0, "lease_s": 30.0,
            "heartbeat_s": 0.5, "drain_timeout_s": 5.0, **extra}


@pytest.mark.parametrize("moment", ["before_read", "during_read"])
@pytest.mark.parametrize("engine", ENGINES)
def test_pull_survives_prefill_crash_without_leaking_blocks(worker: FramedProcess, engine: str, moment: str) -> None:
    """A prefill that dies before the READ fails the request; one that dies during it either fails it or, when the
    READ beat the kill on loopback, completes it. Either way the outcome comes within a bound and no block leaks."""
    reply = worker.ask(cmd="setup_cache", role="prefill", spec=msgspec.msgpack.encode(BIG), layout="packed_kv",
                       num_blocks=BIG_BLOCKS, seed=5, config=big_config("prefill", engine))
    assert "error" not in reply, reply
    table = list(range(3, 3 + BIG_TOKENS // 16))
    params = worker.ask(cmd="hold", request_id="big", table={0: table}, num_tokens=BIG_TOKENS)["params"]
    # before_read: nobody answers the handshake, so the request fails when it times out; 1 s is as good as 5 s
    # for that, and during_read keeps 5 s for the live prefill to answer on a loaded machine
    decode = make("decode", BIG, num_blocks=BIG_BLOCKS, engine=engine, transfer_timeout_s=10.0,
                  handshake_timeout_s=1.0 if moment == "before_read" else 5.0)
    try:
        ids = decode.allocate(BIG_TOKENS)
        if moment == "before_read":
            worker.kill()
        decode.side.start_pull("big", params, ids)
        if moment == "during_read":
            wait_until(lambda: decode.side.transfers_in_flight() > 0 or "big" in decode.collect(), 15,
                       "the READ starting")
            worker.kill()
        start = time.monotonic()
        done = decode.wait("big", FAILURE_BOUND_S)
        assert time.monotonic() - start < FAILURE_BOUND_S
        if moment == "before_read" or done.state != "done":
            assert done.state in ("failed", "timed_out"), done
            assert done.all_failed_block_ids() == set(ids)  # the engine recomputes or fails exactly these
        decode.pool.free(ids)
        assert decode.whole and decode.side.pending_requests() == 0
        assert decode.side.local.arena.in_use == 0
    finally:
        decode.close()


@pytest.mark.parametrize("moment", ["before_write", "during_write"])
@pytest.mark.parametrize("engine", ENGINES)
def test_push_survives_decode_crash_without_leaking_blocks(worker: FramedProcess, engine: str, moment: str) -> None:
    """A decode that registered and then died before the WRITE fails the push; one that dies during it fails it
    or, when the WRITE beat the kill on loopback, sees it done. The prefill's blocks come back either way."""
    prefill = make("prefill", BIG, num_blocks=BIG_BLOCKS, seed=6, engine=engine, transfer_timeout_s=10.0,
                   lease_s=30.0)
    try:
        reply = worker.ask(cmd="setup_cache", role="decode", spec=msgspec.msgpack.encode(BIG), layout="packed_kv",
                           num_blocks=BIG_BLOCKS, seed=0, config=big_config("decode", engine, mode="push"))
        assert "error" not in reply, reply
        params = push_params(prefill.side.base_port, "big", prefill.side.config.engine_id)
        table = list(range(2, 2 + BIG_TOKENS // 16))
        assert worker.ask(cmd="push", request_id="big", params=params.to_dict(), table={0: table},
                          num_tokens=BIG_TOKENS) == {}
        ids = prefill.allocate(BIG_TOKENS)
        wait_until(lambda: prefill.side.push_registered("big"), 15, "the registration reaching the prefill")
        if moment == "before_write":
            worker.kill()
        prefill.side.request_finished("big", ids, BIG_TOKENS, token=token_for("big"))
        if moment == "during_write":
            wait_until(lambda: prefill.side.transfers_in_flight() > 0 or "big" in prefill.collect(), 15,
                       "the WRITE starting")
            worker.kill()
        start = time.monotonic()
        done = prefill.wait("big", FAILURE_BOUND_S)
        assert time.monotonic() - start < FAILURE_BOUND_S
        if moment == "before_write":
            assert done.state in ("failed", "timed_out"), done
        prefill.pool.free(ids)
        assert prefill.whole and prefill.side.held_requests() == 0
    finally:
        prefill.close()


def test_a_lease_expires_without_heartbeats_and_frees_the_blocks() -> None:
    prefill = make("prefill", small_spec(), lease_s=0.4, heartbeat_s=0.1)
    try:
        ids = prefill.allocate(40)
        prefill.side.request_finished("lonely", ids, 40)
        assert prefill.side.held_requests() == 1
        done = prefill.wait("lonely", 5.0)
        assert done.state == "timed_out" and "lease" in done.reason
        prefill.pool.free(ids)
        assert prefill.whole and prefill.side.held_requests() == 0
    finally:
        prefill.close()


def raw_decode_socket(prefill: Engine, context: zmq.Context[zmq.Socket[bytes]]) -> zmq.Socket[bytes]:
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{prefill.side.port}")
    return sock


def test_heartbeats_renew_the_lease_until_they_stop() -> None:
    prefill = make("prefill", small_spec(), lease_s=0.4, heartbeat_s=0.1)
    context = zmq.Context()
    sock = raw_decode_socket(prefill, context)
    decode_kv = LocalKV(bind(prefill.side.backend, small_spec(), allocate_cache(small_spec(), "packed_kv", 8)),
                        DisaggConfig("raw-decode", transport="mooncake"), "decode")
    try:
        sock.send(messages.encode(decode_kv.handshake()))  # heartbeats count only from a handshaken decode
        assert sock.poll(10_000) and isinstance(messages.decode(sock.recv(), 1 << 26), messages.Handshake)
        ids = prefill.allocate(40)
        params = prefill.side.request_finished("kept", ids, 40)
        beat = messages.encode(messages.Heartbeat("raw-decode", 0, [("kept", params.kvplane_token)]))
        end = time.monotonic() + 1.5  # almost four leases
        while time.monotonic() < end:
            sock.send(beat)
            time.sleep(0.05)
        assert prefill.collect() == {} and prefill.side.held_requests() == 1
        assert prefill.wait("kept", 5.0).state == "timed_out"
        prefill.pool.free(ids)
        assert prefill.whole
    finally:
        decode_kv.close()
        sock.close()
        context.term()
        prefill.close()


@pytest.mark.parametrize(
    "decode_spec,field",
    [
        (KVSpec.gqa(4, 4, 16, tokens_per_block=16, dtype="float32"), "layers"),
        (KVSpec.gqa(4, 4, 32, tokens_per_block=16, dtype="bfloat16"), "dtype"),
        (KVSpec.gqa(3, 4, 32, tokens_per_block=16, dtype="float32"), "num_layers"),
    ],
    ids=["head_dim", "dtype", "layers"],
)
def test_a_mismatched_model_fails_the_handshake_naming_the_field_before_any_byte_moves(
    decode_spec: KVSpec, field: str
) -> None:
    prefill = make("prefill", small_spec(), seed=3)
    decode = make("decode", decode_spec)
    try:
        params = prefill.side.request_finished("r", prefill.allocate(32), 32)
        before = digest(decode.spec, decode.cache, "packed_kv", {0: list(range(64))}, 64 * 16)
        ids = decode.allocate(32)
        decode.side.start_pull("r", params, ids)
        done = decode.wait("r", 10.0)
        assert done.state == "failed" and field in done.reason and "local=" in done.reason, done.reason
        assert digest(decode.spec, decode.cache, "packed_kv", {0: list(range(64))}, 64 * 16) == before
        decode.pool.free(ids)
        assert decode.whole
    finally:
        decode.close()
        prefill.close()


def test_malformed_oversized_and_unknown_messages_are_dropped_and_the_listener_keeps_serving() -> None:
    prefill = make("prefill", small_spec(), max_message_bytes=64 * 1024)
    context = zmq.Context()
    sock = raw_decode_socket(prefill, context)
    decode_kv = LocalKV(bind(prefill.side.backend, small_spec(), allocate_cache(small_spec(), "packed_kv", 8)),
                        DisaggConfig("raw-decode", transport="mooncake"), "decode")
    try:
        big = raw_decode_socket(prefill, context)  # libzmq drops the connection of an oversized frame
        big.send(b"x" * (128 * 1024))
        big.close()
        sock.send(b"\x00garbage\xff")
        sock.send(msgspec.msgpack.encode({"type": "format_disk", "path": "/"}))
        sock.send(msgspec.msgpack.encode({"type": "read_done", "request_id": 5}))
        sock.send_multipart([b"a", b"b", b"c"])
        sock.send(messages.encode(decode_kv.handshake()))
        assert sock.poll(10_000), "the listener stopped answering"
        reply = messages.decode(sock.recv(), 1 << 26)
        assert isinstance(reply, messages.Handshake) and reply.role == "prefill"
        wait_until(lambda: prefill.side.counters.rejected >= 4, 5, "four rejections")
    finally:
        decode_kv.close()
        sock.close()
        context.term()
        prefill.close()


def test_a_restarted_prefill_is_handshaken_again_and_old_parameters_fail_cleanly() -> None:
    spec = small_spec()
    port = port_below_ephemeral_range()
    first = make("prefill", spec, seed=11, port=port)
    decode = make("decode", spec)
    try:
        old = first.side.request_finished("a", first.allocate(32), 32)
        ids = decode.allocate(32)
        decode.side.start_pull("a", old, ids)
        assert decode.wait("a").state == "done"
        first.close()
        second = make("prefill", spec, seed=12, port=port, engine_id=old.remote_engine_id)
        try:
            table = second.allocate(48)
            new = second.side.request_finished("b", table, 48)
            ids_b = decode.allocate(48)
            decode.side.start_pull("b", new, ids_b)
            assert decode.wait("b").state == "done"
            assert digest(spec, decode.cache, "packed_kv", {0: ids_b}, 48) == \
                digest(spec, second.cache, "packed_kv", {0: table}, 48)
            stale = msgspec.structs.replace(old, remote_request_id="a2")
            ids_c = decode.allocate(32)
            decode.side.start_pull("c", stale, ids_c)
            done = decode.wait("c")
            assert done.state == "failed" and "restarted" in done.reason
        finally:
            second.close()
    finally:
        decode.close()


def test_parameters_of_an_old_prefill_lifetime_fail_as_restarted_without_disturbing_a_push_in_flight() -> None:
    """A request naming the prefill's previous lifetime makes the decode handshake again on the connection it
    has, not on a second one: the prefill refuses a second connection under a decode's name while the first
    lives, so that request failed with "a second connection ... is refused" whenever the first connection was
    still open (held by a request in flight here; in the restart test above, a garbage-collected socket whose
    close raced the new handshake), and the request in flight lost its replies on the forsaken socket."""
    spec = small_spec()
    port = port_below_ephemeral_range()
    first = make("prefill", spec, seed=11, port=port)
    decode = make("decode", spec)
    try:
        old = first.side.request_finished("a", first.allocate(32), 32)
        decode.side.start_pull("a", old, decode.allocate(32))
        assert decode.wait("a").state == "done"
        first.close()
        second = make("prefill", spec, seed=12, port=port, engine_id=old.remote_engine_id)
        try:
            new = second.side.request_finished("b", second.allocate(48), 48)
            decode.side.start_pull("b", new, decode.allocate(48))
            assert decode.wait("b").state == "done"
            ids_x = decode.allocate(32)  # a push to the restarted rank, waiting for its prefill to finish it
            decode.side.register_push("x", push_params(port, "x", old.remote_engine_id), ids_x, 32)
            stale = msgspec.structs.replace(old, remote_request_id="a2")
            decode.side.start_pull("c", stale, decode.allocate(32))
            done = decode.wait("c")
            assert done.state == "failed" and "restarted" in done.reason, done.reason
            table_x = second.allocate(32)
            second.side.request_finished("x", table_x, 32, token=token_for("x"))
            assert decode.wait("x").state == "done"
            assert digest(spec, decode.cache, "packed_kv", {0: ids_x}, 32) == \
                digest(spec, second.cache, "packed_kv", {0: table_x}, 32)
            assert second.wait("x").state == "done"
        finally:
            second.close()
    finally:
        decode.close()


@pytest.mark.parametrize("engine", ENGINES)
def test_an_abort_during_a_pull_holds_the_blocks_until_the_read_has_drained(engine: str) -> None:
    prefill = make("prefill", BIG, num_blocks=BIG_BLOCKS, seed=9, engine=engine)
    decode = make("decode", BIG, num_blocks=BIG_BLOCKS, engine=engine)
    try:
        p_ids = prefill.allocate(BIG_TOKENS)
        params = prefill.side.request_finished("r", p_ids, BIG_TOKENS)
        ids = decode.allocate(BIG_TOKENS)
        decode.side.start_pull("r", params, ids)
        wait_until(lambda: decode.side.transfers_in_flight() > 0 or "r" in decode.collect(), 15, "the READ starting")
        decode.side.abort("r")
        done = decode.wait("r")
        assert decode.side.transfers_in_flight() == 0  # reported only once nothing can write the blocks
        if done.state == "done":  # the READ beat the abort to the I/O loop (NIXL on loopback can): then it is whole
            assert digest(BIG, decode.cache, "packed_kv", {0: ids}, BIG_TOKENS) == \
                digest(BIG, prefill.cache, "packed_kv", {0: p_ids}, BIG_TOKENS)
            assert prefill.wait("r").state == "done"
        else:
            assert done.state == "failed" and "aborted" in done.reason, done
            assert prefill.wait("r").state == "failed"  # told, so it frees its blocks without waiting for the lease
    finally:
        decode.close()
        prefill.close()


@pytest.mark.parametrize("prefill_blocks, bad", [(64, 999), (16, 40)], ids=["past-both", "past-the-prefill-only"])
def test_block_ids_outside_the_cache_fail_the_request_and_never_report_a_partial_transfer(prefill_blocks: int,
                                                                                         bad: int) -> None:
    # past-the-prefill-only: a prefill (a DP rank) with fewer blocks than the decode answers an id the decode's
    # cache could hold but its own cannot (vLLM PR 46106's overflow): the decode checks it against the prefill's
    # manifest, not its own
    spec = small_spec()
    prefill = make("prefill", spec, seed=2, num_blocks=prefill_blocks)
    decode = make("decode", spec)
    try:
        params = prefill.side.request_finished("r", prefill.allocate(48), 48)
        bad_params = msgspec.structs.replace(params, remote_block_ids=[[0, 1, bad]])
        decode.side.start_pull("r", bad_params, decode.allocate(48))
        done = decode.wait("r")
        assert done.state == "failed" and f"block id {bad} is out of range" in done.reason
        assert f"blocks 0..{prefill_blocks - 1}" in done.reason
        assert prefill.wait("r").state == "failed"  # the decode said the read failed: the blocks go back
    finally:
        decode.close()
        prefill.close()


def test_malformed_transfer_params_are_refused_naming_the_field() -> None:
    decode = make("decode", small_spec())
    try:
        with pytest.raises(TransferParamsError, match="remote_port"):
            decode.side.start_pull("r", {"remote_engine_id": "p", "remote_request_id": "r", "remote_host": "h"}, [1, 2])
        good = push_params(5555, "r", "p").to_dict()
        with pytest.raises(TransferParamsError, match="tp_size"):
            decode.side.register_push("r", {**good, "tp_size": "two"}, [1, 2], 20)
        with pytest.raises(DisaggError, match="cannot hold num_tokens=40"):
            decode.side.register_push("r", good, [1, 2], 40)
        with pytest.raises(DisaggError, match="nothing to pull"):
            decode.side.start_pull("r", good, [1, 2])
    finally:
        decode.close()


@pytest.mark.parametrize("engine", ENGINES)
def test_layerwise_push_writes_each_layer_as_soon_as_it_is_saved(engine: str) -> None:
    spec = small_spec(layers=3)
    prefill = make("prefill", spec, seed=21, engine=engine, mode="layerwise")
    decode = make("decode", spec, engine=engine, mode="layerwise")
    try:
        p_ids, d_ids = prefill.allocate(40), decode.allocate(40)
        decode.side.register_push("r", push_params(prefill.side.base_port, "r", prefill.side.config.engine_id),
                                  d_ids, 40)
        prefill.side.start_request("r", p_ids, 40, token=token_for("r"))
        wait_until(lambda: prefill.side.push_registered("r"), 15, "the registration reaching the prefill")

        def layer_landed(name: str) -> bool:  # compared as bits: the seeded pattern holds NaNs as floats
            layer = spec.layer(name)
            got = canonical("packed_kv", decode.cache[name], np.asarray(d_ids), 40, layer)
            want = canonical("packed_kv", prefill.cache[name], np.asarray(p_ids), 40, layer)
            return all(torch.equal(got[s].contiguous().view(torch.int32), want[s].contiguous().view(torch.int32))
                       for s in want)

        prefill.side.save_layer("layers.0")
        wait_until(lambda: layer_landed("layers.0"), 10, "layer 0 arriving at decode")
        assert not layer_landed("layers.1")  # not saved yet, so not sent: the prefill is still computing it
        prefill.side.save_layer("layers.1")
        wait_until(lambda: layer_landed("layers.1"), 10, "layer 1 arriving at decode")
        assert decode.collect() == {}  # not done before the request is finished
        prefill.side.save_layer("layers.2")
        prefill.side.request_finished("r", p_ids, 40)
        assert decode.wait("r").state == "done"
        assert all(layer_landed(n) for n in spec.layer_names)
        assert prefill.wait("r").state == "done"
    finally:
        decode.close()
        prefill.close()


@pytest.mark.parametrize("engine,mode", [("mooncake", "pull"), ("nixl", "pull"), ("mooncake", "push"),
                                         ("nixl", "layerwise")])
def test_200_concurrent_requests_of_mixed_lengths_all_finish_without_leaking(engine: str, mode: str) -> None:
    spec = small_spec(layers=2)
    rng = np.random.default_rng(200)
    lengths = rng.integers(1, 160, 200).tolist()
    blocks = sum(-(-n // 16) for n in lengths) + 8
    prefill = make("prefill", spec, num_blocks=blocks, seed=31, engine=engine, mode=mode)
    decode = make("decode", spec, num_blocks=blocks, engine=engine, mode=mode)
    try:
        names = [f"req-{i}-{uuid.uuid4().hex[:4]}" for i in range(200)]
        p_ids = {r: prefill.allocate(n) for r, n in zip(names, lengths)}
        d_ids = {r: decode.allocate(n) for r, n in zip(names, lengths)}
        if mode == "pull":
            params = {r: prefill.side.request_finished(r, p_ids[r], n) for r, n in zip(names, lengths)}
            for r, n in zip(names, lengths):
                decode.side.start_pull(r, params[r], d_ids[r])
        else:
            for r, n in zip(names, lengths):
                decode.side.register_push(r, push_params(prefill.side.base_port, r, prefill.side.config.engine_id),
                                          d_ids[r], n)
            for r, n in zip(names, lengths):
                if mode == "layerwise":
                    prefill.side.start_request(r, p_ids[r], n, token=token_for(r))
            if mode == "layerwise":
                for name in spec.layer_names:
                    prefill.side.save_layer(name)
            for r, n in zip(names, lengths):
                prefill.side.request_finished(r, p_ids[r], n, token=token_for(r))
        for r, n in zip(names, lengths):
            assert decode.wait(r, 60).state == "done", decode.done[r]
            assert digest(spec, decode.cache, "packed_kv", {0: d_ids[r]}, n) == \
                digest(spec, prefill.cache, "packed_kv", {0: p_ids[r]}, n), r
            decode.pool.free(d_ids[r])
        for r in names:
            assert prefill.wait(r, 30).state == "done"
            prefill.pool.free(p_ids[r])
        assert prefill.whole and decode.whole
        assert prefill.side.held_requests() == 0 and decode.side.pending_requests() == 0
    finally:
        decode.close()
        prefill.close()


def test_starting_a_request_that_is_still_receiving_is_refused() -> None:
    spec = small_spec()
    prefill = make("prefill", spec, seed=4)
    decode = make("decode", spec)
    try:
        params = prefill.side.request_finished("r", prefill.allocate(32), 32)
        ids = decode.allocate(32)
        decode.side.start_pull("r", params, ids)
        with pytest.raises(DisaggError, match="already receiving"):
            decode.side.start_pull("r", params, ids)
        assert decode.wait("r").state == "done"
        assert list(decode.done) == ["r"]  # one completion, for the one that ran
    finally:
        decode.close()
        prefill.close()


@pytest.mark.parametrize("order", ["handed_first", "registered_first", "layerwise_started_first"])
def test_a_push_the_decode_cannot_plan_frees_the_prefill_blocks_before_the_lease(order: str) -> None:
    """Fused against split MLA stages every layer, and 64 B of staging cannot hold it: the decode fails the
    request naming staging_bytes and tells the prefill, which frees the blocks at once (a layer-wise request
    once it is finished), not after its 60 s lease (the poll below gives up at 15 s)."""
    spec = KVSpec.mla(2, kv_lora_rank=64, rope_dim=16, dtype="float32", tokens_per_block=16)
    mode = "layerwise" if order.startswith("layerwise") else "push"
    prefill = make("prefill", spec, "mla_fused", seed=3, lease_s=60.0, push_timeout_s=60.0, mode=mode)
    decode = make("decode", spec, "mla_split", staging_bytes=64, push_timeout_s=60.0, mode=mode)
    try:
        params = push_params(prefill.side.base_port, "r", prefill.side.config.engine_id)
        ids = prefill.allocate(40)
        if order == "handed_first":
            prefill.side.request_finished("r", ids, 40, token=token_for("r"))
        elif order == "layerwise_started_first":
            prefill.side.start_request("r", ids, 40, token=token_for("r"))
        decode.side.register_push("r", params, decode.allocate(40), 40)
        done = decode.wait("r")
        assert done.state == "failed" and "staging_bytes" in done.reason
        if order == "registered_first":
            time.sleep(0.2)  # the decode's word may come before the engine hands the request over
            prefill.side.request_finished("r", ids, 40, token=token_for("r"))
        elif order == "layerwise_started_first":
            for name in spec.layer_names:
                prefill.side.save_layer(name)  # nothing is written: the decode rank gave the request up
            prefill.side.request_finished("r", ids, 40)
        ended = prefill.wait("r", 15.0)
        assert ended.state == "failed" and "could not plan" in ended.reason
        assert prefill.side.held_requests() == 0
    finally:
        decode.close()
        prefill.close()


@pytest.mark.parametrize("order", ["handed_first", "registered_first"])
@pytest.mark.parametrize("ends", ["push_deadline", "handshake_timeout", "abort"])
def test_a_push_given_up_while_a_prefill_rank_never_answers_frees_the_ranks_that_did_at_once(
        ends: str, order: str) -> None:
    """A push to a TP-2 prefill instance whose rank 1 never answers the handshake (a silent listener on its
    port) ends before it is registered: at push_timeout_s ("timed_out"), when the handshake with rank 1 times
    out ("failed"), or when the decode engine aborts it once rank 0 handshook ("failed", "aborted"). Rank 0
    handshook, holds the request's blocks and must free them at once, on the decode's Cancel
    (DecodeRequest._give_up), not after its 60 s lease (the poll gives up at 20 s). The abort sent no
    Cancel on main at cbeed0c."""
    spec = small_spec()
    timeouts = {"push_timeout_s": 4.0, "handshake_timeout_s": 60.0} if ends == "push_deadline" else \
        {"push_timeout_s": 60.0, "handshake_timeout_s": 4.0} if ends == "handshake_timeout" else \
        {"push_timeout_s": 60.0, "handshake_timeout_s": 60.0}  # rank 0 handshakes well within 4 s, as in FAST
    prefill = make("prefill", spec, seed=5, lease_s=60.0, push_timeout_s=60.0, mode="push")
    decode = make("decode", spec, mode="push", **timeouts)
    silent = socket.socket()
    try:
        try:
            silent.bind(("127.0.0.1", prefill.side.base_port + 1))  # where rank 1 would listen
            silent.listen()
        except OSError:  # someone else holds it: it answers no kvplane handshake either
            pass
        params = push_params(prefill.side.base_port, "r", prefill.side.config.engine_id, tp=2)
        ids = prefill.allocate(40)
        if order == "handed_first":
            prefill.side.request_finished("r", ids, 40, token=token_for("r"))
        decode.side.register_push("r", params, decode.allocate(40), 40)
        if ends == "abort":
            wait_until(lambda: ready_prefill_ranks(decode) == 1, 15, "prefill rank 0 handshaking")
            decode.side.abort("r")
        done = decode.wait("r")
        expected = ("timed_out", "did not start before the deadline") if ends == "push_deadline" else \
            ("failed", "handshake with prefill rank 1") if ends == "handshake_timeout" else ("failed", "aborted")
        assert (done.state, expected[1] in done.reason) == (expected[0], True), done.reason
        assert not prefill.side.push_registered("r")  # given up before any registration
        if order == "registered_first":
            time.sleep(0.2)  # the decode's word may come before the engine hands the request over
            prefill.side.request_finished("r", ids, 40, token=token_for("r"))
        ended = prefill.wait("r", 20.0)
        assert ended.state == "failed", ended.reason
        assert prefill.side.held_requests() == 0
    finally:
        silent.close()
        decode.close()
        prefill.close()
