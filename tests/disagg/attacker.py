"""A third process on 127.0.0.1 that attacks a prefill rank's side channel: ``python attacker.py``.

Driven by framed msgpack commands (``framed.py``) from the test, like ``rank_worker.py``. Messages are built as
plain msgpack maps, so the attacks do not depend on kvplane's own message classes. Commands (``cmd``):

- ``setup`` (spec, engine, seed) -> {}: a cache of its own holding a seeded pattern, with a real transport;
- ``connect`` (port, name) -> {}: a new DEALER connection called ``name`` to the prefill rank;
- ``handshake`` (name, engine_id, peer?) -> {reply, reason}: a handshake as a decode rank named ``engine_id``
  (``peer``: a transport descriptor of the attacker's choosing instead of its own);
- ``send`` (name, message, count) -> {}: one msgpack map, ``count`` times; ``send_raw`` (name, nbytes);
- ``replies`` (name, within) -> {count, types}: what came back on ``name`` within ``within`` seconds;
- ``silent_listener`` -> {port}: a TCP port that accepts and never answers;
- ``digest`` (table, tokens) -> {digest}: of the attacker's own cache.
"""

from __future__ import annotations

import socket
import sys
import time
from typing import Any

import msgspec
import zmq
from framed import read_frame, reply_channel, write_frame
from kvfill import digest, fill


class Attacker:
    def __init__(self) -> None:
        self.context = zmq.Context()
        self.socks: dict[str, zmq.Socket[bytes]] = {}
        self.local: Any = None
        self.listeners: list[socket.socket] = []

    def handle(self, msg: dict[str, Any]) -> Any:
        cmd = msg["cmd"]
        if cmd == "setup":
            from kvplane.backend import get_backend
            from kvplane.flows.disagg.wire.config import DisaggConfig
            from kvplane.flows.disagg.wire.local import LocalKV
            from kvplane.kv.binding import allocate_cache
            from kvplane.kv.bound import bind
            from kvplane.kv.spec import KVSpec

            self.spec = msgspec.msgpack.decode(msg["spec"], type=KVSpec)
            self.cache = allocate_cache(self.spec, "packed_kv", msg["num_blocks"])
            fill(self.cache, msg["seed"])
            self.local = LocalKV(bind(get_backend("cpu"), self.spec, self.cache),
                                 DisaggConfig(msg["engine_id"], transport=msg["engine"]), "decode")
            return {}
        if cmd == "connect":
            sock = self.context.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://127.0.0.1:{msg['port']}")
            self.socks[msg["name"]] = sock
            return {}
        if cmd == "handshake":
            hello = msgspec.structs.asdict(self.local.handshake())
            hello.update(type="handshake", engine_id=msg["engine_id"], rank=msg.get("rank", 0))
            if msg.get("peer") is not None:
                hello["peer"] = msg["peer"]
            self.socks[msg["name"]].send(msgspec.msgpack.encode(hello))
            return self.first_reply(msg["name"], float(msg.get("within", 10.0)))
        if cmd == "send":
            frame = msgspec.msgpack.encode(msg["message"])
            for _ in range(int(msg.get("count", 1))):
                self.socks[msg["name"]].send(frame)
            return {}
        if cmd == "send_raw":
            self.socks[msg["name"]].send(b"\x00" * int(msg["nbytes"]))
            return {}
        if cmd == "replies":
            return self.replies(msg["name"], float(msg["within"]))
        if cmd == "silent_listener":
            listener = socket.socket()
            listener.bind(("127.0.0.1", 0))
            listener.listen(64)
            self.listeners.append(listener)  # accepted by the kernel, never answered
            return {"port": listener.getsockname()[1]}
        if cmd == "digest":
            table = {int(g): v for g, v in msg["table"].items()}
            return {"digest": digest(self.spec, self.cache, "packed_kv", table, msg["tokens"])}
        return {"error": f"unknown command {cmd!r}"}

    def first_reply(self, name: str, within: float) -> dict[str, Any]:
        """The answer to a handshake (replies to earlier messages on the connection are skipped)."""
        sock, end = self.socks[name], time.monotonic() + within
        while (left := end - time.monotonic()) > 0:
            if not sock.poll(int(left * 1000) + 1):
                break
            raw = msgspec.msgpack.decode(sock.recv())
            if raw.get("type") in ("handshake", "reject"):
                return {"reply": raw["type"], "reason": str(raw.get("reason", ""))}
        return {"reply": "none", "reason": ""}

    def replies(self, name: str, within: float) -> dict[str, Any]:
        sock, types, end = self.socks[name], [], time.monotonic() + within
        while (left := end - time.monotonic()) > 0:
            if sock.poll(int(left * 1000) + 1):
                types.append(msgspec.msgpack.decode(sock.recv()).get("type", "?"))
        return {"count": len(types), "types": sorted(set(types))}


def main() -> None:
    replies = reply_channel()
    attacker = Attacker()
    write_frame(replies, {"ready": True})
    while (msg := read_frame(sys.stdin.buffer)) is not None:
        if msg["cmd"] == "exit":
            break
        try:
            reply = attacker.handle(msg)
        except Exception as e:
            reply = {"error": f"{type(e).__name__}: {e}"}
        write_frame(replies, reply)
    if attacker.local is not None:
        attacker.local.close()


if __name__ == "__main__":
    main()
