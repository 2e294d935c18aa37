"""How many kvplane modules one P/D pull crosses on the decode, from vLLM's ``update_state_after_alloc`` to the
descriptor submit: ``.venv/bin/python scripts/measure-route.py``.

A prefill (``tests/vllm/vllm_peer.py``, a miniature vLLM with the connector) runs in a child process; the decode
is a miniature vLLM in this one, under a profiler on every thread. From the decode connector's
``update_state_after_alloc`` until the transport's first ``submit`` it records each kvplane module a function of
which is called, per thread, and prints them with the stacks (kvplane modules only) at the submit and at the
mover's ``put``. The count is an upper bound for the route: the decode's I/O loop ticks in the same window.
``--warm``: measure a second pull, over the connection the first one made (no handshake).
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "vllm"), str(ROOT / "tests" / "unit"), str(ROOT / "tests")]
KVPLANE = str(ROOT / "kvplane") + os.sep

seen: dict[str, dict[str, None]] = {}  # thread name -> modules, in first-call order
stacks: dict[str, list[str]] = {}
state = {"on": False}


def module(frame: FrameType) -> str | None:
    path = frame.f_code.co_filename
    return path[len(KVPLANE):] if path.startswith(KVPLANE) else None


def chain(frame: FrameType | None) -> list[str]:
    out: list[str] = []
    while frame is not None:
        m = module(frame)
        if m is not None and (not out or out[-1] != m):
            out.append(f"{m}:{frame.f_code.co_name}")
        frame = frame.f_back
    return out[::-1]


def profile(frame: FrameType, event: str, _: Any) -> None:
    if event != "call":
        return
    m = module(frame)
    if m is None:
        return
    name = frame.f_code.co_name
    if name == "update_state_after_alloc" and m.endswith("vllm/scheduler.py"):
        state["on"] = True
    if not state["on"]:
        return
    seen.setdefault(threading.current_thread().name, {})[m] = None
    if name == "put" and m.endswith("mover.py") and "put" not in stacks:
        stacks["put"] = chain(frame)
    if name == "submit" and m.startswith("transports/") and "submit" not in stacks:
        stacks["submit"] = chain(frame)
        state["on"] = False


def main() -> None:
    from framed import FramedProcess
    from minivllm import MiniEngine
    from ports import free_port

    prompt = [(i * 37 + 11) % 997 for i in range(83)]
    fast = {"lease_s": 10.0, "heartbeat_s": 0.5, "transfer_timeout_s": 20.0, "handshake_timeout_s": 10.0}
    port = free_port()
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "vllm"), str(ROOT / "tests" / "unit"), str(ROOT)])}
    prefill = FramedProcess([str(ROOT / "tests" / "vllm" / "vllm_peer.py")], Path("/tmp/measure-route-prefill.log"),
                            env=env)
    try:
        prefill.send(cmd="setup", extra={"disagg": {"mode": "pull", "port": port, **fast}}, kv_role="kv_producer",
                     groups=[[2, 16]], engine_id="prefill-0")
        threading.setprofile(profile)  # before the decode's threads start: they inherit it
        decode = MiniEngine({"disagg": {"mode": "pull", "port": free_port(), **fast}}, "kv_consumer",
                            groups=((2, 16),), engine_id="decode-0")
        assert "error" not in prefill.read(120.0)
        for i in range(2 if "--warm" in sys.argv else 1):  # --warm: the first pull (and its handshake) unrecorded
            done = prefill.ask(120.0, cmd="run", request_id=f"p-{i}", prompt=prompt, params={"do_remote_decode": True})
            seen.clear()
            stacks.clear()
            sys.setprofile(profile)
            out = decode.run(f"d-{i}", prompt, done["kv_transfer_params"])
            sys.setprofile(None)
            state["on"] = False
            assert out.digest == done["digest"], "the pulled KV differs from the prefill's"
            prefill.ask(60.0, cmd="pump", request_id=f"p-{i}")
        threading.setprofile(None)  # type: ignore[arg-type]
        decode.shutdown()
    finally:
        prefill.send(cmd="exit")
        prefill.close()
    union = {m for mods in seen.values() for m in mods}
    for thread, mods in seen.items():
        print(f"{thread}: {len(mods)} modules\n  " + "\n  ".join(mods))
    for where, frames in stacks.items():
        print(f"stack at {where}:\n  " + "\n  ".join(frames))
    route = {f.split(":")[0] for frames in stacks.values() for f in frames}
    print(f"modules on the stacks at put and submit: {len(route)}; called in the window, all threads: {len(union)}")


if __name__ == "__main__":
    main()
