"""One miniature vLLM instance (``minivllm.MiniEngine``) in its own process: ``python vllm_peer.py``.

Driven with framed msgpack commands (``framed.py``), one reply each:
``setup`` (extra, kv_role, groups, split_kv, engine_id) -> {}; ``run`` (request_id, prompt, params,
max_tokens) -> the ``Outcome`` as a dict; ``pump`` (request_id, within) -> {} once the connector gave the
request's blocks back; ``reference`` (tokens, n) -> {digest}; ``whole`` -> {whole}; ``teardown`` -> {} (the
engine shuts down, the process stays for the next ``setup``); ``exit``.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from framed import read_frame, reply_channel, write_frame


def main() -> None:
    replies = reply_channel()
    from minivllm import MiniEngine

    engine: MiniEngine | None = None
    out: Any
    while (msg := read_frame(sys.stdin.buffer)) is not None:
        cmd = msg.pop("cmd")
        try:
            if cmd == "exit":
                break
            if cmd == "teardown":
                if engine is not None:
                    engine.shutdown()
                engine, out = None, {}
            elif cmd == "setup":
                if engine is not None:
                    raise RuntimeError("teardown first")
                groups = tuple(tuple(g) for g in msg.pop("groups"))
                engine = MiniEngine(msg.pop("extra"), msg.pop("kv_role"), groups=groups, **msg)
                out = {}
            elif engine is None:
                raise RuntimeError("setup first")
            elif cmd == "run":
                outcome = engine.run(msg["request_id"], msg["prompt"], msg.get("params"), msg.get("max_tokens", 1))
                out = dataclasses.asdict(outcome)
                out["load_errors"] = sorted(outcome.load_errors)
            elif cmd == "pump":
                engine.pump(msg["request_id"], msg.get("within", 30.0))
                out = {}
            elif cmd == "reference":
                out = {"digest": engine.reference_digest(msg["tokens"], msg["n"])}
            elif cmd == "whole":
                out = {"whole": engine.whole, "held": sorted(engine.held)}
            else:
                raise RuntimeError(f"unknown command {cmd!r}")
        except Exception as e:  # the test sees the error instead of a dead child
            import traceback

            traceback.print_exc()
            out = {"error": f"{type(e).__name__}: {e}"}
        write_frame(replies, out)
    if engine is not None:
        engine.shutdown()


if __name__ == "__main__":
    main()
