"""The side channel with ZMQ CURVE keys: pull, push and layer-wise push work with keys on, and a client without
the key, or with a key not on the prefill's allow-list, is refused during the ZMQ handshake, before any kvplane
message is read. Without keys, a non-loopback listen is refused unless ``allow_unauthenticated``."""

from __future__ import annotations

import time
from typing import Any

import pytest
import zmq
from kvfill import digest
from pair import make, push_params, small_spec, token_for
from zmq.utils.monitor import recv_monitor_message

from kvplane.flows.disagg import DisaggConfig, DisaggConfigError
from kvplane.flows.disagg.wire import messages

pytestmark = pytest.mark.integration
SPEC = small_spec(layers=2)
REFUSED = (zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
           zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)


def keypair() -> tuple[str, str]:
    public, secret = zmq.curve_keypair()
    return public.decode(), secret.decode()


def keyed(mode: str) -> tuple[Any, Any]:
    p_pub, p_sec = keypair()
    d_pub, d_sec = keypair()
    prefill = make("prefill", SPEC, seed=4, mode=mode, curve_secret_key=p_sec, curve_allowed_clients=(d_pub,))
    decode = make("decode", SPEC, mode=mode, curve_secret_key=d_sec, curve_server_key=p_pub)
    return prefill, decode


@pytest.mark.parametrize("mode", ["pull", "push", "layerwise"])
def test_transfers_work_with_curve_keys(mode: str) -> None:
    prefill, decode = keyed(mode)
    try:
        src, dst = prefill.allocate(40), decode.allocate(40)
        if mode == "pull":
            decode.side.start_pull("r", prefill.side.request_finished("r", src, 40), dst)
        else:
            decode.side.register_push("r", push_params(prefill.side.base_port, "r", prefill.side.config.engine_id),
                                      dst, 40)
            if mode == "layerwise":
                prefill.side.start_request("r", src, 40, token=token_for("r"))
                for name in SPEC.layer_names:
                    prefill.side.save_layer(name)
            prefill.side.request_finished("r", src, 40, token=token_for("r"))
        assert decode.wait("r").state == "done"
        assert digest(SPEC, decode.cache, "packed_kv", {0: dst}, 40) == \
            digest(SPEC, prefill.cache, "packed_kv", {0: src}, 40)
        assert prefill.wait("r").state == "done"
    finally:
        decode.close()
        prefill.close()


def refused(port: int, keys: tuple[str, str, str] | None) -> bool:
    """Whether a client (no keys, or ``(public, secret, server)``) is refused in the ZMQ handshake."""
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = (k.encode() for k in keys)
    monitor = sock.get_monitor_socket()
    try:
        sock.connect(f"tcp://127.0.0.1:{port}")
        sock.send(messages.encode(messages.Heartbeat("stranger", 0, [])))
        end = time.monotonic() + 20
        while time.monotonic() < end:
            if monitor.poll(1000):
                event = recv_monitor_message(monitor)["event"]
                if event in REFUSED:
                    return True
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    return False
        return False
    finally:
        sock.disable_monitor()
        monitor.close()
        sock.close()
        context.term()


def test_a_client_without_the_key_or_off_the_allow_list_is_refused() -> None:
    prefill, decode = keyed("pull")
    try:
        port = prefill.side.port
        assert refused(port, None)
        public, secret = keypair()
        assert refused(port, (public, secret, _server_key(prefill)))
        src, dst = prefill.allocate(40), decode.allocate(40)
        decode.side.start_pull("r", prefill.side.request_finished("r", src, 40), dst)
        assert decode.wait("r").state == "done"
    finally:
        decode.close()
        prefill.close()


def _server_key(prefill: Any) -> str:
    return str(zmq.curve_public(prefill.side.config.curve_secret_key.encode()).decode())


def test_a_non_loopback_listen_without_keys_is_refused_unless_allowed_explicitly() -> None:
    with pytest.raises(DisaggConfigError, match="allow_unauthenticated"):
        DisaggConfig(engine_id="p", host="10.1.2.3")
    assert DisaggConfig(engine_id="p", host="10.1.2.3", allow_unauthenticated=True).host == "10.1.2.3"
    public, secret = keypair()
    assert DisaggConfig(engine_id="p", host="10.1.2.3", curve_secret_key=secret,
                        curve_allowed_clients=(public,)).host == "10.1.2.3"
    assert secret not in repr(DisaggConfig(engine_id="p", curve_secret_key=secret))


def pull(prefill: Any, decode: Any, request_id: str) -> None:
    src, dst = prefill.allocate(40), decode.allocate(40)
    decode.side.start_pull(request_id, prefill.side.request_finished(request_id, src, 40), dst)
    assert decode.wait(request_id).state == "done"
    assert digest(SPEC, decode.cache, "packed_kv", {0: dst}, 40) == \
        digest(SPEC, prefill.cache, "packed_kv", {0: src}, 40)


def test_a_handshake_under_a_connected_decodes_routing_id_from_another_key_is_refused() -> None:
    """Issue 28 finding 4: a second allow-listed key that learned the decode's ZMQ routing id connects under it
    (the ROUTER hands the id over to the newest connection) and replays the decode's handshake. The prefill knows
    the decode by its routing id and its CURVE key together, so the replay is refused, not answered, and the
    decode's record stays the decode's; the real decode pulls again afterwards."""
    p_pub, p_sec = keypair()
    d_pub, d_sec = keypair()
    t_pub, t_sec = keypair()  # the thief: on the allow-list too (an insider), but not the decode
    prefill = make("prefill", SPEC, seed=4, curve_secret_key=p_sec, curve_allowed_clients=(d_pub, t_pub))
    decode = make("decode", SPEC, curve_secret_key=d_sec, curve_server_key=p_pub)
    context = zmq.Context()
    try:
        pull(prefill, decode, "r1")
        (name, record), = prefill.side._admission.peers.items()
        thief = context.socket(zmq.DEALER)
        thief.setsockopt(zmq.LINGER, 0)
        thief.setsockopt(zmq.ROUTING_ID, record.identity)
        thief.curve_publickey, thief.curve_secretkey, thief.curve_serverkey = t_pub.encode(), t_sec.encode(), \
            p_pub.encode()
        thief.connect(f"tcp://127.0.0.1:{prefill.side.port}")
        thief.send(messages.encode(decode.side.local.handshake()))
        assert thief.poll(60_000), "no answer to the replayed handshake"
        answer = messages.decode(thief.recv(), 1 << 20)
        assert isinstance(answer, messages.Reject), answer  # before: the prefill's own Handshake, to the thief
        assert "key" in answer.reason, answer.reason
        thief.close()
        assert prefill.side._admission.peers[name] is record
        pull(prefill, decode, "r2")
    finally:
        context.destroy(linger=0)
        decode.close()
        prefill.close()
