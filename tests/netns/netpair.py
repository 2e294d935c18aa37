"""A prefill rank worker in one namespace and a decode rank worker in the other, over a ``Link``.

The workers are ``tests/disagg/rank_worker.py`` processes started with ``ip netns exec``, so every byte between
them crosses the veth pair. NIXL's UCX is told to use TCP on the namespace's veth (otherwise it picks shared
memory between two processes of one kernel and sends nothing over the link); Mooncake gets more TCP lanes per
peer (one round trip per descriptor per lane).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
from framed import FramedProcess
from nslink import Link, Side

from kvplane.kv.spec import KVSpec

WORKER = Path(__file__).parent.parent / "disagg" / "rank_worker.py"
STARTUP_S = 120.0


class NsProcess(FramedProcess):
    """``FramedProcess`` run inside a namespace; an ``env`` value of "" unsets the variable."""

    def __init__(self, side: Side, log: Path, env: dict[str, str]) -> None:
        self.log = log
        here = [str(Path(__file__).parent.parent / d) for d in ("unit", "disagg")]
        path = os.pathsep.join([*here, os.environ.get("PYTHONPATH", "")])
        with open(log, "wb") as err:
            self.proc = subprocess.Popen(
                [*side.exec_prefix(), sys.executable, str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=err, env={k: v for k, v in {**os.environ, "PYTHONPATH": path, **env}.items() if v},
            )
        self._pending = b""
        self.read(STARTUP_S)


def engine_env(side: Side, engine: str) -> dict[str, str]:
    env = {"OMP_NUM_THREADS": "1"}
    if engine == "nixl":
        env.update(UCX_TLS="tcp", UCX_NET_DEVICES=side.dev)
    else:
        env.update(MC_TCP_LANES_PER_PEER="16")
    return env


def config(role: str, side: Side, engine: str, mode: str, **extra: Any) -> dict[str, Any]:
    return {"engine_id": f"{role}-{side.netns}", "transport": engine, "host": side.addr, "mode": mode,
            "allow_unauthenticated": True, "lease_s": 30.0, "heartbeat_s": 0.5, "handshake_timeout_s": 5.0,
            **extra}


class Pair:
    """Prefill in ``link.a``, decode in ``link.b``, each on a bare cache of ``spec`` with a seeded pattern."""

    def __init__(self, link: Link | Any, tmp: Path, engine: str, mode: str, spec: KVSpec, num_blocks: int,
                 decode_env: dict[str, str] | None = None, decode_host: str = "",
                 prefill_env: dict[str, str] | None = None, **extra: Any) -> None:
        self.link, self.engine, self.mode, self.spec = link, engine, mode, spec
        self.prefill = NsProcess(link.a, tmp / "prefill.log", {**engine_env(link.a, engine), **(prefill_env or {})})
        self.decode = NsProcess(link.b, tmp / "decode.log", {**engine_env(link.b, engine), **(decode_env or {})})
        blob = msgspec.msgpack.encode(spec)
        for proc, role, side, seed in ((self.prefill, "prefill", link.a, 7), (self.decode, "decode", link.b, 0)):
            settings = config(role, side, engine, mode, **extra)
            if role == "decode" and decode_host:
                settings["host"] = decode_host  # what it advertises to the prefill
            reply = proc.ask(cmd="setup_cache", role=role, spec=blob, layout="packed_kv", num_blocks=num_blocks,
                             seed=seed, config=settings)
            assert "error" not in reply, reply
            if role == "prefill":
                self.port = reply["base_port"]

    def start(self, request_id: str, src: list[int], dst: list[int], tokens: int) -> None:
        """Pull: hold on the prefill, then start the READ; push: register, then finish the request."""
        token = hashlib.blake2b(request_id.encode(), digest_size=16).hexdigest()
        if self.mode == "pull":
            params = self.prefill.ask(cmd="hold", request_id=request_id, table={0: src}, num_tokens=tokens,
                                      token=token)["params"]
            reply = self.decode.ask(cmd="pull", request_id=request_id, params=params, table={0: dst},
                                    num_tokens=tokens)
            assert reply == {}, reply
            return
        from kvplane.flows.disagg import TransferParams

        params = TransferParams.for_push(f"prefill-{self.link.a.netns}", request_id, self.link.a.addr, self.port,
                                         token=token)
        assert self.decode.ask(cmd="push", request_id=request_id, params=params.to_dict(), table={0: dst},
                               num_tokens=tokens) == {}
        time.sleep(0.3)  # the registration reaches the prefill first, the usual order
        reply = self.prefill.ask(cmd="hold", request_id=request_id, table={0: src}, num_tokens=tokens, token=token)
        assert "error" not in reply, reply

    def status(self, role: str = "decode") -> dict[str, Any]:
        proc = self.decode if role == "decode" else self.prefill
        reply: dict[str, Any] = proc.ask(cmd="status")
        return reply

    def wait(self, request_id: str, within_s: float, role: str = "decode") -> dict[str, Any]:
        proc = self.decode if role == "decode" else self.prefill
        reply: dict[str, Any] = proc.ask(timeout=within_s + 30, cmd="wait", request_id=request_id, within=within_s)
        return reply

    def same_bytes(self, src: list[int], dst: list[int], tokens: int) -> bool:
        a = self.prefill.ask(cmd="digest", table={0: src}, tokens=tokens)["digest"]
        b = self.decode.ask(cmd="digest", table={0: dst}, tokens=tokens)["digest"]
        return bool(a == b)

    def close(self) -> None:
        for proc in (self.prefill, self.decode):
            proc.close()
