"""A tiny OpenAI-style engine for the proxy tests, as its own process: ``python engine_server.py --role ...``.

It serves the tests' tiny paged-KV decoder (``tests/disagg/tiny_model.py``) over ``/v1/completions``,
``/v1/chat/completions`` (streamed or not) and ``/health``, and moves KV with kvplane's ``PrefillSide`` /
``DecodeSide`` the way vLLM's connector does with ``kv_transfer_params``:

- ``{"do_remote_decode": true, "kvplane_token"?}`` on a prefill instance: compute the prompt (layer-wise:
  ``start_request`` and ``save_layer`` around each layer), ``request_finished`` with the token, answer one token
  and the returned ``kv_transfer_params``; the blocks go back when the side reports the request;
- ``{"do_remote_prefill": true, ...}`` on a decode instance: ``start_pull`` (pull) or ``register_push`` (push
  modes), wait for the KV, recompute the prompt's last token (as vLLM does) and generate;
- no ``kv_transfer_params``: compute everything locally.

Request ids follow vLLM's OpenAI server: ``cmpl-<X-Request-Id>-0`` and ``chatcmpl-<X-Request-Id>``. Prompts
are token ids, or text mapped a character to a token; answers carry ``token_ids`` per choice. All model and side
calls run on one engine thread, as in an engine core. Writes ``{http_port, side_port, engine_id}`` as JSON to
``--ready`` once serving.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from aiohttp import web
from tiny_model import VOCAB, Shape, TinyDecoder

from kvplane.backend import get_backend
from kvplane.blocks.pool import BlockPool
from kvplane.flows.disagg import DecodeSide, DisaggConfig, PrefillSide
from kvplane.kv.binding import allocate_cache
from kvplane.kv.bound import bind

LAYOUT, NUM_BLOCKS, BLOCK = "packed_kv", 64, 16
FAST = {"lease_s": 10.0, "heartbeat_s": 0.5, "transfer_timeout_s": 20.0, "handshake_timeout_s": 5.0,
        "push_timeout_s": 20.0, "drain_timeout_s": 5.0}


def tokens_of(path: str, body: dict[str, Any]) -> list[int]:
    if path.endswith("/chat/completions"):
        text = "\n".join(str(m.get("content", "")) for m in body["messages"])
        return [ord(c) % VOCAB for c in text]
    prompt = body["prompt"]
    return [ord(c) % VOCAB for c in prompt] if isinstance(prompt, str) else [int(t) for t in prompt]


def text_of(tokens: list[int]) -> str:
    return "".join(chr(48 + t) for t in tokens)


class Engine:
    def __init__(self, role: str, mode: str, transport: str, engine_id: str) -> None:
        self.role, self.mode = role, mode
        self.shape = Shape("gqa", BLOCK)
        self.cache = allocate_cache(self.shape.spec(), LAYOUT, NUM_BLOCKS)
        self.model = TinyDecoder(self.shape, LAYOUT, self.cache)
        self.pool = BlockPool(NUM_BLOCKS)
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="engine")
        config = DisaggConfig(engine_id=engine_id, mode=mode, transport=transport, **FAST)  # type: ignore[arg-type]
        cls = PrefillSide if role == "prefill" else DecodeSide
        self.side: Any = cls(bind(get_backend("cpu"), self.shape.spec(), self.cache, LAYOUT), config) \
            if role in ("prefill", "decode") else None
        self.waiting: dict[str, asyncio.Future[Any]] = {}
        self.held: dict[str, list[int]] = {}  # prefill: blocks until the side reports the request
        self.wake = asyncio.Event()  # set when a request starts waiting on the side

    async def call(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.thread, fn, *args)

    async def poll(self) -> None:
        while True:
            if not (self.waiting or self.held):  # idle: no spinning on a 2-core CI machine; a request wakes it
                self.wake.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.wake.wait(), 0.5)
            if self.side is not None:
                for c in await self.call(self.side.get_finished):
                    if c.request_id in self.held:
                        self.pool.free(self.held.pop(c.request_id))
                    future = self.waiting.pop(c.request_id, None)
                    if future is not None and not future.done():
                        future.set_result(c)
            await asyncio.sleep(0.005)

    def blocks(self, tokens: int) -> list[int]:
        return self.pool.allocate(-(-tokens // BLOCK))

    # -- engine-thread work -------------------------------------------------------------------------------
    def prefill(self, rid: str, prompt: list[int], table: list[int], token: str | None) -> dict[str, Any]:
        layerwise = self.mode == "layerwise"
        if layerwise:
            self.side.start_request(rid, {0: table}, len(prompt), token=token)
        after = self.side.save_layer if layerwise else None
        first = int(self.model.forward(prompt, 0, {0: table}, after_layer=after)[-1].argmax())
        params = self.side.request_finished(rid, {0: table}, len(prompt), token=token)
        return {"tokens": [first], "kv_transfer_params": params.to_dict()}

    def generate(self, prompt: list[int], table: list[int], start: int, steps: int) -> list[int]:
        """Compute ``prompt[start:]`` (the KV of ``prompt[:start]`` is in the cache) and generate ``steps``."""
        first = int(self.model.forward(prompt[start:], start, {0: table})[-1].argmax())
        rest, _ = self.model.decode(first, len(prompt), steps - 1, {0: table}) if steps > 1 else ([], [])
        return [first, *rest]

    # -- HTTP ---------------------------------------------------------------------------------------------
    async def serve(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        chat = request.path.endswith("/chat/completions")
        xrid = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        rid = f"chatcmpl-{xrid}" if chat else f"cmpl-{xrid}-0"
        prompt = tokens_of(request.path, body)
        steps = int(body.get("max_tokens", 8))
        params = body.get("kv_transfer_params") or {}
        extra: dict[str, Any] = {}
        if params.get("do_remote_decode") and self.role == "prefill":
            table = self.blocks(len(prompt))
            self.held[rid] = table
            self.wake.set()
            out = await self.call(self.prefill, rid, prompt, table, params.get("kvplane_token"))
            tokens, extra = out["tokens"], {"kv_transfer_params": out["kv_transfer_params"]}
        else:
            table = self.blocks(len(prompt) + steps)
            try:
                start = 0
                if params.get("do_remote_prefill") and self.role == "decode":
                    done = await self.receive(rid, params, table, len(prompt))
                    if done.state != "done":
                        return web.json_response({"error": {"message": f"KV of {rid} did not arrive: {done.state} "
                                                                       f"{done.reason}"}}, status=500)
                    start = len(prompt) - 1  # vLLM recomputes the last prompt token to produce the first output
                tokens = await self.call(self.generate, prompt, table, start, steps)
            finally:
                self.pool.free(table)
        return await self.answer(request, body, rid, chat, tokens, extra)

    async def receive(self, rid: str, params: dict[str, Any], table: list[int], n: int) -> Any:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.waiting[rid] = future
        self.wake.set()
        if params.get("kvplane_mode", self.mode) == "pull":
            await self.call(self.side.start_pull, rid, params, {0: table})
        else:
            await self.call(self.side.register_push, rid, params, {0: table}, n)
        return await future

    async def answer(self, request: web.Request, body: dict[str, Any], rid: str, chat: bool, tokens: list[int],
                     extra: dict[str, Any]) -> web.StreamResponse:
        kind = "chat.completion" if chat else "text_completion"

        def choice(toks: list[int]) -> dict[str, Any]:
            if chat:
                return {"index": 0, "message": {"role": "assistant", "content": text_of(toks)}, "token_ids": toks}
            return {"index": 0, "text": text_of(toks), "token_ids": toks}

        if not body.get("stream"):
            return web.json_response({"id": rid, "object": kind, "created": int(time.time()),
                                      "model": body["model"], "choices": [choice(tokens)], **extra})
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for t in tokens:
            chunk = {"id": rid, "object": f"{kind}.chunk", "model": body["model"], "choices": [choice([t])]}
            await out.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def main(args: argparse.Namespace) -> None:
    engine = Engine(args.role, args.mode, args.transport, args.engine_id)
    app = web.Application()
    app.router.add_post("/v1/completions", engine.serve)
    app.router.add_post("/v1/chat/completions", engine.serve)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", args.port)
    await site.start()
    poller = asyncio.create_task(engine.poll())
    http_port = runner.addresses[0][1]
    ready = {"http_port": http_port, "side_port": getattr(engine.side, "port", 0), "engine_id": args.engine_id}
    Path(f"{args.ready}.tmp").write_text(json.dumps(ready))
    os.replace(f"{args.ready}.tmp", args.ready)  # the reader sees no file or the whole of it
    try:
        await asyncio.Event().wait()
    finally:
        poller.cancel()
        await runner.cleanup()
        if engine.side is not None:
            engine.side.close()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--role", choices=["prefill", "decode", "both"], required=True)
    p.add_argument("--mode", default="pull")
    p.add_argument("--transport", default="mooncake")
    p.add_argument("--engine-id", default=f"engine-{uuid.uuid4().hex[:6]}")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--ready", required=True)
    try:
        asyncio.run(main(p.parse_args()))
    except KeyboardInterrupt:
        sys.exit(0)
