"""Instances that misbehave, for the proxy tests, as their own process: ``python bad_server.py --ready F B...``.

One port per behaviour ``B`` (the ready file maps each to its port):

- ``ok`` (and ``ok2``, ``ok3``...): a valid completion (streamed when asked) whose text is the port, with ``kv_transfer_params`` and an
  ``echo`` of the body, ``X-Request-Id`` and ``X-data-parallel-rank`` it got (the params name the side channel
  of that DP rank, port 5600 + rank, as a DP prefill with tp_size 1 answers); ``slow``: the same after 1 s;
- ``fail``: HTTP 500 with a JSON error; ``reject``: HTTP 400 with a JSON error (the client's mistake, as vLLM
  answers a prompt longer than the model's context); ``garbage``: HTTP 200 with a body that is not JSON;
- ``hang``: reads the request and never answers; ``reset``: resets the connection (RST) without answering;
- ``midstream``: starts a stream, sends one event, then resets; ``trickle``: sends one event, then nothing;
- ``kvfail``: a request with ``kv_transfer_params`` fails as vLLM 0.27.1 answers one whose KV load failed under
  ``kv_load_failure_policy=fail``: HTTP 500 with its error body, or, streamed, HTTP 200 whose first event is that
  error, then ``[DONE]``; a request without them is answered as ``ok`` answers.

``POST /tokenize`` answers vLLM's ``TokenizeResponse`` for a completions ``prompt`` or chat ``messages``: a token
per character (``ord % 1000``; chat: the messages' contents joined by newlines).
``GET /v1/models`` answers a model list naming the port (``ok``...), or misbehaves as the completions do
(``fail``, ``reject``, ``garbage``, ``hang``, ``reset``). ``GET /health`` answers 200, or 503 after ``POST /health/down`` (``POST /health/up`` restores it). Handlers of
this process may hang forever: it runs apart from the test so that they count in no leak check.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import struct
from pathlib import Path
from typing import Any

from aiohttp import web

VLLM_ERROR = {"error": {"message": "Internal server error", "type": "InternalServerError", "param": None,
                        "code": 500}}
PARAMS = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "prefill-x",
          "remote_request_id": "r", "remote_host": "127.0.0.1", "remote_port": 5600, "tp_size": 1,
          "remote_block_ids": [[1, 2]], "remote_num_tokens": 20}


def reset(request: web.Request) -> None:
    transport = request.transport
    if transport is not None:
        sock = transport.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        transport.abort()


def behaviour(kind: str, port: int) -> Any:
    healthy = {"up": True}

    async def misbehave(request: web.Request) -> web.Response | None:
        """The answer of a misbehaving kind (``hang`` never answers), or None for one that answers well."""
        if kind == "hang":
            await asyncio.sleep(3600)
        if kind == "reset":
            reset(request)
            return web.Response()
        if kind == "fail":
            return web.json_response({"error": {"message": "engine exploded"}}, status=500)
        if kind == "reject":
            return web.json_response({"error": {"message": "prompt too long for this model"}}, status=400)
        if kind == "garbage":
            return web.Response(body=b"<html>not json{", content_type="application/json")
        return None

    async def serve(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        bad = await misbehave(request)
        if bad is not None:
            return bad
        if kind == "slow":
            await asyncio.sleep(1.0)
        if kind == "kvfail" and "kv_transfer_params" in body:
            if not body.get("stream"):
                return web.json_response(VLLM_ERROR, status=500)
            failed = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await failed.prepare(request)
            await failed.write(f"data: {json.dumps(VLLM_ERROR)}\n\ndata: [DONE]\n\n".encode())
            await failed.write_eof()
            return failed
        rank = int(request.headers.get("X-data-parallel-rank", "0"))  # as a DP prefill: that rank's side channel
        answer = {"id": "x", "object": "text_completion", "model": body.get("model"),
                  "choices": [{"index": 0, "text": str(port)}],
                  "kv_transfer_params": {**PARAMS, "remote_port": PARAMS["remote_port"] + rank},
                  "echo": {"body": body, "x_request_id": request.headers.get("X-Request-Id"),
                           "dp_rank": request.headers.get("X-data-parallel-rank")}}
        if not body.get("stream"):
            return web.json_response(answer)
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        await out.write(f"data: {json.dumps(answer)}\n\n".encode())
        if kind == "midstream":
            await out.drain()
            reset(request)
            return out
        if kind == "trickle":
            await out.drain()
            await asyncio.sleep(3600)
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out

    async def models(request: web.Request) -> web.StreamResponse:
        bad = await misbehave(request)
        if bad is not None:
            return bad
        return web.json_response({"object": "list", "data": [{"id": f"tiny-{port}", "object": "model",
                                                               "owned_by": "vllm", "root": "tiny", "max_model_len": 64}],
                                  "echo": {"x_request_id": request.headers.get("X-Request-Id"),
                                           "authorization": request.headers.get("Authorization")}})

    async def tokenize(request: web.Request) -> web.Response:
        body = await request.json()
        text = body["prompt"] if "prompt" in body else "\n".join(str(m.get("content", "")) for m in body["messages"])
        tokens = [ord(c) % 1000 for c in text]
        return web.json_response({"count": len(tokens), "max_model_len": 4096, "tokens": tokens, "token_strs": None})

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"up": healthy["up"]}, status=200 if healthy["up"] else 503)

    async def set_health(request: web.Request) -> web.Response:
        healthy["up"] = request.match_info["state"] == "up"
        return web.json_response(healthy)

    app = web.Application()
    app.router.add_post("/v1/completions", serve)
    app.router.add_post("/v1/chat/completions", serve)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_get("/health", health)
    app.router.add_post("/health/{state}", set_health)
    return app


async def main(ready: str, kinds: list[str]) -> None:
    ports: dict[str, int] = {}
    for kind in kinds:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        runner = web.AppRunner(behaviour(kind, port), access_log=None, shutdown_timeout=0.1)
        await runner.setup()
        await web.SockSite(runner, sock).start()
        ports[kind] = port
    Path(f"{ready}.tmp").write_text(json.dumps(ports))
    os.replace(f"{ready}.tmp", ready)  # the reader sees no file or the whole of it
    await asyncio.Event().wait()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--ready", required=True)
    p.add_argument("kinds", nargs="+")
    args = p.parse_args()
    asyncio.run(main(args.ready, args.kinds))
