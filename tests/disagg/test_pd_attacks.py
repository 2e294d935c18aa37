"""Attacks on a prefill rank's side channel from a third process on 127.0.0.1 (``attacker.py``), against real
sides: forged ``ReadDone``, ``Cancel`` and heartbeats, a push registration for someone else's request, a replayed
handshake under the decode's engine id, amplification, a 64 MiB frame, block id 2**64-1. After each, the victim's
bytes and blocks are untouched and a real transfer still succeeds.

The attacker knows what travels in ``kv_transfer_params`` (request id, boot id, engine ids, ports) but not the
request's token. Its messages are plain msgpack maps, so the attacks do not depend on kvplane's message classes.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
from framed import FramedProcess
from kvfill import digest
from pair import Engine, make, push_params, small_spec, token_for

from kvplane.flows.disagg.wire import limits

pytestmark = pytest.mark.integration
ATTACKER = Path(__file__).with_name("attacker.py")
SPEC = small_spec()
WRONG = "0" * 32  # a token guess


@pytest.fixture
def attacker(tmp_path: Path) -> Iterator[FramedProcess]:
    proc = FramedProcess([str(ATTACKER)], tmp_path / "attacker.log", env={"OMP_NUM_THREADS": "1"})
    proc.read(120)
    try:
        yield proc
    finally:
        proc.kill()


def ask(attacker: FramedProcess, **message: Any) -> Any:
    reply = attacker.ask(**message)
    assert "error" not in reply, reply
    return reply


def arm(attacker: FramedProcess, prefill: Engine, name: str = "evil", engine: str = "mooncake") -> None:
    """The attacker sets up a real transport and cache of its own and handshakes as decode ``name``."""
    ask(attacker, cmd="setup", spec=msgspec.msgpack.encode(SPEC), num_blocks=16, seed=77, engine=engine,
        engine_id=name)
    ask(attacker, cmd="connect", port=prefill.side.port, name=name)
    assert ask(attacker, cmd="handshake", name=name, engine_id=name)["reply"] == "handshake"


def sync(attacker: FramedProcess, name: str = "evil") -> None:
    """Once this returns, the prefill handled everything ``name`` sent before (one connection keeps order)."""
    assert ask(attacker, cmd="handshake", name=name, engine_id=name)["reply"] == "handshake"


def read_done(request_id: str, engine_id: str, boot: str, token: str = WRONG) -> dict[str, Any]:
    return {"type": "read_done", "request_id": request_id, "engine_id": engine_id, "rank": 0, "tp_size": 1,
            "ok": True, "expect_boot": boot, "token": token}


def heartbeat(request_id: str, engine_id: str, token: str = WRONG, times: int = 1) -> dict[str, Any]:
    return {"type": "heartbeat", "engine_id": engine_id, "rank": 0, "request_ids": [request_id] * times,
            "requests": [[request_id, token]] * times}


def pull_and_check(prefill: Engine, decode: Engine, request_id: str, tokens: int = 40) -> Any:
    """A real pull after the attack: done, with the prefill's bytes, and both sides release; its params."""
    src = prefill.allocate(tokens)
    params = prefill.side.request_finished(request_id, src, tokens)
    dst = decode.allocate(tokens)
    decode.side.start_pull(request_id, params, dst)
    assert decode.wait(request_id).state == "done"
    assert digest(SPEC, decode.cache, "packed_kv", {0: dst}, tokens) == \
        digest(SPEC, prefill.cache, "packed_kv", {0: src}, tokens)
    assert prefill.wait(request_id).state == "done"
    return params


def test_a_forged_read_done_does_not_free_the_blocks_of_a_pull(attacker: FramedProcess) -> None:
    prefill, decode = make("prefill", SPEC, seed=3), make("decode", SPEC)
    try:
        src = prefill.allocate(40)
        params = prefill.side.request_finished("victim", src, 40)
        ask(attacker, cmd="connect", port=prefill.side.port, name="anon")  # no handshake at all
        ask(attacker, cmd="send", name="anon",
            message=read_done("victim", decode.side.config.engine_id, params.remote_boot_id))
        arm(attacker, prefill)  # handshaken, under its own name
        ask(attacker, cmd="send", name="evil", message=read_done("victim", "evil", params.remote_boot_id))
        ask(attacker, cmd="send", name="evil",  # claiming the real decode's name from its own connection
            message=read_done("victim", decode.side.config.engine_id, params.remote_boot_id))
        sync(attacker)
        assert prefill.collect() == {} and prefill.side.held_requests() == 1  # still held for the real decode
        dst = decode.allocate(40)
        decode.side.start_pull("victim", params, dst)
        assert decode.wait("victim").state == "done"
        assert digest(SPEC, decode.cache, "packed_kv", {0: dst}, 40) == \
            digest(SPEC, prefill.cache, "packed_kv", {0: src}, 40)
        assert prefill.wait("victim").state == "done"
    finally:
        decode.close()
        prefill.close()


def test_forged_heartbeats_do_not_hold_blocks_past_the_lease(attacker: FramedProcess) -> None:
    prefill, decode = make("prefill", SPEC, seed=3, lease_s=1.0, heartbeat_s=0.2), make("decode", SPEC)
    try:
        params = prefill.side.request_finished("victim", prefill.allocate(40), 40)
        arm(attacker, prefill)
        end = time.monotonic() + 10.0
        while "victim" not in prefill.collect():
            assert time.monotonic() < end, "forged heartbeats held the blocks past the lease"
            ask(attacker, cmd="send", name="evil", message=heartbeat("victim", "evil"))
            ask(attacker, cmd="send", name="evil", message=heartbeat("victim", decode.side.config.engine_id))
            time.sleep(0.05)
        assert prefill.done["victim"].state == "timed_out" and params.remote_request_id == "victim"
        pull_and_check(prefill, decode, "after")
    finally:
        decode.close()
        prefill.close()


def test_a_push_registration_for_another_request_neither_receives_its_kv_nor_cancels_it(
    attacker: FramedProcess,
) -> None:
    prefill, decode = make("prefill", SPEC, seed=5, mode="push"), make("decode", SPEC, mode="push")
    try:
        arm(attacker, prefill)
        own = {"0": [0, 1, 2]}
        before = ask(attacker, cmd="digest", table=own, tokens=40)["digest"]
        dst, src = decode.allocate(40), prefill.allocate(40)
        decode.side.register_push("victim", push_params(prefill.side.base_port, "victim",
                                                        prefill.side.config.engine_id), dst, 40)
        end = time.monotonic() + 15
        while not prefill.side.push_registered("victim"):
            assert time.monotonic() < end
            time.sleep(0.005)
        ask(attacker, cmd="send", name="evil", message={
            "type": "push_register", "request_id": "victim", "engine_id": "evil", "rank": 0, "tp_size": 1,
            "block_ids": {0: [0, 1, 2]}, "num_tokens": 40, "staging_addr": 0, "staging_bytes": 0,
            "expect_boot": prefill.side.local.boot_id, "token": WRONG})
        for engine_id in ("evil", decode.side.config.engine_id):
            ask(attacker, cmd="send", name="evil", message={"type": "cancel", "request_id": "victim",
                                                           "engine_id": engine_id, "rank": 0, "token": WRONG})
        sync(attacker)
        prefill.side.request_finished("victim", src, 40, token=token_for("victim"))
        assert decode.wait("victim").state == "done"
        assert digest(SPEC, decode.cache, "packed_kv", {0: dst}, 40) == \
            digest(SPEC, prefill.cache, "packed_kv", {0: src}, 40)
        assert prefill.wait("victim").state == "done"
        assert ask(attacker, cmd="digest", table=own, tokens=40)["digest"] == before  # it received nothing
    finally:
        decode.close()
        prefill.close()


def test_a_forged_cancel_before_any_registration_does_not_free_a_held_push(attacker: FramedProcess) -> None:
    """A decode rank that cannot plan a push sends ``Cancel`` without registering, and the prefill frees the
    request at once; that word counts only with the token and only from the decode that handshook."""
    prefill, decode = make("prefill", SPEC, seed=5, mode="push", lease_s=60.0), make("decode", SPEC, mode="push")
    try:
        src, dst = prefill.allocate(40), decode.allocate(40)
        prefill.side.request_finished("victim", src, 40, token=token_for("victim"))
        ask(attacker, cmd="connect", port=prefill.side.port, name="anon")  # no handshake at all
        ask(attacker, cmd="send", name="anon", message={"type": "cancel", "request_id": "victim",
                                                        "engine_id": decode.side.config.engine_id, "rank": 0,
                                                        "token": token_for("victim")})
        arm(attacker, prefill)
        for engine_id, token in (("evil", WRONG), ("evil", ""), (decode.side.config.engine_id, token_for("victim"))):
            ask(attacker, cmd="send", name="evil", message={"type": "cancel", "request_id": "victim",
                                                           "engine_id": engine_id, "rank": 0, "token": token})
        sync(attacker)
        assert prefill.collect() == {} and prefill.side.held_requests() == 1
        decode.side.register_push("victim", push_params(prefill.side.base_port, "victim",
                                                        prefill.side.config.engine_id), dst, 40)
        assert decode.wait("victim").state == "done"
        assert digest(SPEC, decode.cache, "packed_kv", {0: dst}, 40) == \
            digest(SPEC, prefill.cache, "packed_kv", {0: src}, 40)
        assert prefill.wait("victim").state == "done"
    finally:
        decode.close()
        prefill.close()


@pytest.mark.parametrize("engine", ["mooncake", "nixl"])
def test_a_replayed_handshake_under_the_decodes_engine_id_does_not_replace_it(
    attacker: FramedProcess, engine: str,
) -> None:
    prefill = make("prefill", SPEC, seed=7, mode="push", engine=engine)
    decode = make("decode", SPEC, mode="push", engine=engine)
    try:
        first_dst, first_src = decode.allocate(40), prefill.allocate(40)
        decode.side.register_push("one", push_params(prefill.side.base_port, "one", prefill.side.config.engine_id),
                                  first_dst, 40)
        prefill.side.request_finished("one", first_src, 40, token=token_for("one"))
        assert decode.wait("one").state == "done"  # the decode handshook and is connected
        ask(attacker, cmd="setup", spec=msgspec.msgpack.encode(SPEC), num_blocks=16, seed=77, engine=engine,
            engine_id=decode.side.config.engine_id)
        ask(attacker, cmd="connect", port=prefill.side.port, name="replay")
        reply = ask(attacker, cmd="handshake", name="replay", engine_id=decode.side.config.engine_id)
        assert reply["reply"] == "reject" and "connected already" in reply["reason"], reply
        dst, src = decode.allocate(40), prefill.allocate(40)
        decode.side.register_push("two", push_params(prefill.side.base_port, "two", prefill.side.config.engine_id),
                                  dst, 40)
        prefill.side.request_finished("two", src, 40, token=token_for("two"))
        assert decode.wait("two").state == "done", decode.done["two"]
        assert digest(SPEC, decode.cache, "packed_kv", {0: dst}, 40) == \
            digest(SPEC, prefill.cache, "packed_kv", {0: src}, 40)
    finally:
        decode.close()
        prefill.close()


def test_amplification_is_bounded_and_costs_no_records(attacker: FramedProcess) -> None:
    prefill, decode = make("prefill", SPEC, seed=3, max_message_bytes=1 << 20), make("decode", SPEC)
    try:
        params = pull_and_check(prefill, decode, "gone")  # released: a heartbeat naming it earns a Problem reply
        token = getattr(params, "kvplane_token", WRONG)
        arm(attacker, prefill)
        ask(attacker, cmd="send", name="evil", message=heartbeat("gone", "evil", token, times=4000))
        assert ask(attacker, cmd="replies", name="evil", within=1.0)["count"] <= 1  # one per distinct request
        ask(attacker, cmd="send", name="evil", count=5000,
            message=read_done("nobody", "evil", "not-the-boot-id"))
        replies = ask(attacker, cmd="replies", name="evil", within=2.0)["count"]
        assert replies < 1000, f"{replies} replies to 5000 ReadDones naming a wrong boot id"
        assert len(prefill.side._held) == 0  # no record for any of them
        ask(attacker, cmd="send", name="evil", message=heartbeat("gone", "evil", token, times=5000))  # over the cap
        ask(attacker, cmd="send_raw", name="evil", nbytes=64 << 20)  # refused by libzmq before it is read
        ask(attacker, cmd="connect", port=prefill.side.port, name="overflow")
        ask(attacker, cmd="send", name="overflow", message={  # 2**64-1 as a block id, then a handshake
            "type": "push_register", "request_id": "x", "engine_id": "overflow", "rank": 0, "tp_size": 1,
            "block_ids": {0: [2**64 - 1]}, "num_tokens": 1, "staging_addr": 0, "staging_bytes": 0,
            "expect_boot": prefill.side.local.boot_id, "token": WRONG})
        assert ask(attacker, cmd="handshake", name="overflow", engine_id="overflow")["reply"] == "handshake"
        pull_and_check(prefill, decode, "after")
    finally:
        decode.close()
        prefill.close()


def test_a_flood_of_problem_replies_never_drops_the_problem_answering_a_real_request(
    attacker: FramedProcess, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A handshaken attacker spends the reply budget with ReadDones naming a wrong boot id; then a real decode
    registers a push for a request the prefill already let go. Its Problem ("no longer held") must still come,
    or the decode waits out push_timeout_s (60 s here; the poll gives up at 20 s), cancels, drains and resets
    its engine. The limiter's clock is frozen, so its budget never refills and no race with the clock decides
    this. On main at cbeed0c one budget served every peer's Problems and every warning, and the reply was
    dropped."""
    frozen = limits.time.monotonic()
    monkeypatch.setattr(limits, "time", SimpleNamespace(monotonic=lambda: frozen))
    prefill = make("prefill", SPEC, seed=3, mode="push", lease_s=0.3, heartbeat_s=0.1)
    decode = make("decode", SPEC, mode="push", push_timeout_s=60.0)
    try:
        prefill.side.request_finished("gone", prefill.allocate(40), 40, token=token_for("gone"))
        assert prefill.wait("gone").state == "timed_out"  # nobody registered: its lease let it go
        arm(attacker, prefill)
        ask(attacker, cmd="send", name="evil", count=2 * int(limits.REPLIES_PER_S),
            message=read_done("nobody", "evil", "not-the-boot-id"))
        flood = ask(attacker, cmd="replies", name="evil", within=1.0)["count"]
        assert 0 < flood <= limits.REPLIES_PER_S  # the flood is still answered within its budget only
        sync(attacker)
        decode.side.register_push("gone", push_params(prefill.side.base_port, "gone", prefill.side.config.engine_id),
                                  decode.allocate(40), 40)
        done = decode.wait("gone", 20.0)
        assert done.state == "failed" and "no longer held" in done.reason, done.reason
    finally:
        decode.close()
        prefill.close()


def test_a_silent_listener_named_as_mooncake_peer_does_not_stall_the_prefill(attacker: FramedProcess) -> None:
    prefill, decode = make("prefill", SPEC, seed=3, probe_timeout_s=30.0), make("decode", SPEC)
    try:
        port = ask(attacker, cmd="silent_listener")["port"]
        ask(attacker, cmd="setup", spec=msgspec.msgpack.encode(SPEC), num_blocks=16, seed=77, engine="mooncake",
            engine_id="silent")
        ask(attacker, cmd="connect", port=prefill.side.port, name="silent")
        peer = msgspec.msgpack.encode({"engine": "mooncake", "name": f"127.0.0.1:{port}", "host": "127.0.0.1",
                                       "port": port, "metadata": b"", "spans": [[1 << 20, 1 << 20]]})
        assert ask(attacker, cmd="handshake", name="silent", engine_id="silent", peer=peer,
                   within=0.5)["reply"] == "none"  # the probe hangs: no answer yet
        pull_and_check(prefill, decode, "meanwhile")  # handshake, heartbeats and ReadDone flow all the same
    finally:
        decode.close()
        prefill.close()


def test_a_name_being_checked_is_asked_again_only_on_its_own_connection(attacker: FramedProcess) -> None:
    """A decode whose handshake timed out asks again on the same connection while the prefill still checks the
    first (its transport probe hangs here): that is not refused, the one answer covers both; a handshake under the
    name on another connection is still refused."""
    prefill = make("prefill", SPEC, seed=3, probe_timeout_s=1.0)
    try:
        port = ask(attacker, cmd="silent_listener")["port"]
        ask(attacker, cmd="setup", spec=msgspec.msgpack.encode(SPEC), num_blocks=16, seed=77, engine="mooncake",
            engine_id="victim")
        for name in ("own", "other"):
            ask(attacker, cmd="connect", port=prefill.side.port, name=name)
        peer = msgspec.msgpack.encode({"engine": "mooncake", "name": f"127.0.0.1:{port}", "host": "127.0.0.1",
                                       "port": port, "metadata": b"", "spans": [[1 << 20, 1 << 20]]})
        ask(attacker, cmd="handshake", name="own", engine_id="victim", peer=peer, within=0.0)
        checking = prefill.side._admission._probing
        end = time.monotonic() + 20.0
        while ("victim", 0) not in checking:  # the prefill took the first handshake: its probe hangs
            assert time.monotonic() < end, "the prefill never started checking the handshake"
            time.sleep(0.002)
        ask(attacker, cmd="handshake", name="own", engine_id="victim", peer=peer, within=0.0)  # asks again
        reply = ask(attacker, cmd="handshake", name="other", engine_id="victim", peer=peer)
        assert reply["reply"] == "reject" and "being checked already" in reply["reason"], reply
        while ("victim", 0) in checking:  # the probe's deadline: the one answer (a Reject: nothing listens)
            assert time.monotonic() < end, "the hung probe never ended"
            time.sleep(0.002)
        assert ask(attacker, cmd="replies", name="own", within=0.5) == {"count": 1, "types": ["reject"]}
    finally:
        prefill.close()


def test_a_flood_of_early_word_from_one_peer_never_refuses_another_peers_push(attacker: FramedProcess) -> None:
    """Issue 28, finding 1: ReadDones for made-up requests (no token: none can be checked before the engine hands
    a request over) fill one connection's share of early records, not the rank's; a real decode's push still
    registers and moves its bytes."""
    prefill, decode = make("prefill", SPEC, seed=6, mode="push"), make("decode", SPEC, mode="push")
    try:
        arm(attacker, prefill)
        boot = prefill.side.local.boot_id
        for i in range(limits.MAX_EARLY + 500):  # distinct ids, each one early record if nothing capped them
            ask(attacker, cmd="send", name="evil", message=read_done(f"made-up-{i}", "evil", boot))
        sync(attacker)
        assert len(prefill.side._early) == limits.MAX_EARLY_PER_PEER  # the flood's share, no more
        dst, src = decode.allocate(40), prefill.allocate(40)
        decode.side.register_push("victim", push_params(prefill.side.base_port, "victim",
                                                        prefill.side.config.engine_id), dst, 40)
        end = time.monotonic() + 60
        while not prefill.side.push_registered("victim"):
            assert time.monotonic() < end, "the real decode's push registration was refused"
            time.sleep(0.005)
        prefill.side.request_finished("victim", src, 40, token=token_for("victim"))
        assert decode.wait("victim").state == "done"
        assert digest(SPEC, decode.cache, "packed_kv", {0: dst}, 40) == \
            digest(SPEC, prefill.cache, "packed_kv", {0: src}, 40)
    finally:
        decode.close()
        prefill.close()
