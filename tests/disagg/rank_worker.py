"""One rank of a prefill or decode instance, as its own process: ``python rank_worker.py``.

It runs the tiny model on a paged cache and exchanges KV through kvplane's ``PrefillSide`` / ``DecodeSide``.
The test process drives it with framed msgpack commands (``framed.py``); TP ranks of one instance join a gloo
process group so the model can all-gather head outputs. Commands (``cmd``) and replies:

- ``group`` (world, rank, init_method) -> {}: join the instance's process group (TP > 1 only);
- ``setup`` (role, shape, layout, config, num_blocks, device) -> {port, base_port}: a fresh cache, model and side,
  on the cpu backend or a vendor's emulated one (``vendors.py``);
- ``setup_cache`` (role, spec, layout, config, num_blocks, seed) -> the same for a bare cache holding a seeded
  pattern, and ``hold`` (request_id, table, num_tokens) -> {params}: ``request_finished`` without a model;
- ``digest`` (table, tokens) -> {digest}: of a request's tokens, to compare caches across processes;
- ``prefill`` (request_id, prompt, table, layerwise, token) -> {params, logits, first}: the prompt's forward, with
  ``start_request``/``save_layer`` hooks when layer-wise, then ``request_finished``;
- ``pull`` / ``push`` (request_id, params, table, num_tokens) -> {}: ``start_pull`` / ``register_push``;
- ``wait`` (request_id, within) -> the request's completion, or {state: "none"} when none came in time;
- ``decode`` (first, start, steps, table) -> {tokens, logits};
- ``mark`` / ``unmarked`` (table, value) -> {} / {changed, total}: fill a request's blocks with a marker once
  the engine has them back, then count the block slots written since;
- ``status`` -> counts (pending, draining, in flight, held, staging in use) and the completions so far;
- ``finished`` -> completions so far; ``held`` -> requests the side still holds; ``teardown``; ``exit``.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import msgspec
import torch
from framed import read_frame, reply_channel, write_frame
from kvfill import digest, fill, mark, unmarked
from kvref import split_choice
from tiny_model import Shape, TinyDecoder
from vendors import ascend_cache, backend_for


class Worker:
    def __init__(self) -> None:
        from kvplane.backend import get_backend

        self.backend = get_backend("cpu")
        self.side: Any = None
        self.model: TinyDecoder | None = None
        self.completions: dict[str, dict[str, Any]] = {}

    def gather(self, heads: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        parts = [torch.empty_like(heads) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, heads.contiguous())
        return torch.cat(parts, dim=1)

    def handle(self, msg: dict[str, Any]) -> Any:
        cmd = msg["cmd"]
        if cmd == "group":
            import torch.distributed as dist

            dist.init_process_group("gloo", init_method=msg["init_method"], rank=msg["rank"],
                                    world_size=msg["world"])
            return {}
        if cmd == "setup":
            return self.setup(msg)
        if cmd == "setup_cache":
            return self.setup_cache(msg)
        if cmd == "prefill":
            return self.prefill(msg)
        if cmd == "hold":
            table = {int(g): v for g, v in msg["table"].items()}
            params = self.side.request_finished(msg["request_id"], table, msg["num_tokens"], token=msg.get("token"))
            return {"params": params.to_dict()}
        if cmd == "digest":
            table = {int(g): v for g, v in msg["table"].items()}
            return {"digest": digest(self.spec, self.cache, self.layout, table, msg["tokens"])}
        if cmd == "mark":  # the engine took the blocks back: fill them, so a later write shows
            table = {int(g): v for g, v in msg["table"].items()}
            mark(self.spec, self.cache, self.layout, table, float(msg["value"]))
            return {}
        if cmd == "unmarked":
            table = {int(g): v for g, v in msg["table"].items()}
            changed, total = unmarked(self.spec, self.cache, self.layout, table, float(msg["value"]))
            return {"changed": changed, "total": total}
        if cmd == "status":
            self.collect()
            side = self.side
            return {"pending": side.pending_requests() if hasattr(side, "pending_requests") else 0,
                    "in_flight": side.transfers_in_flight(),
                    "draining": side.draining_requests() if hasattr(side, "draining_requests") else -1,
                    "held": side.held_requests() if hasattr(side, "held_requests") else 0,
                    "arena": side.local.arena.in_use,
                    "completions": self.completions, "now": time.monotonic()}
        if cmd in ("pull", "push"):
            table = {int(g): v for g, v in msg["table"].items()}
            if cmd == "pull":
                self.side.start_pull(msg["request_id"], msg["params"], table, msg.get("num_tokens"))
            else:
                self.side.register_push(msg["request_id"], msg["params"], table, msg["num_tokens"])
            return {}
        if cmd == "wait":
            return self.wait(msg["request_id"], float(msg["within"]))
        if cmd == "decode":
            assert self.model is not None
            table = {int(g): v for g, v in msg["table"].items()}
            tokens, logits = self.model.decode(msg["first"], msg["start"], msg["steps"], table, self.gather)
            return {"tokens": tokens, "logits": torch.stack(logits).numpy().tobytes()}
        if cmd == "finished":
            self.collect()
            return self.completions
        if cmd == "held":
            return {"held": self.side.held_requests() if hasattr(self.side, "held_requests")
                    else self.side.pending_requests()}
        if cmd == "teardown":
            if self.side is not None:
                self.side.close()
            self.side, self.model, self.completions = None, None, {}
            return {}
        return {"error": f"unknown command {cmd!r}"}

    def setup(self, msg: dict[str, Any]) -> dict[str, Any]:
        from kvplane.flows.disagg import DecodeSide, DisaggConfig, PrefillSide
        from kvplane.kv.binding import allocate_cache
        from kvplane.kv.bound import bind

        if self.side is not None:
            self.side.close()
        shape = Shape(**msg["shape"])
        name, order = split_choice(msg["layout"])
        device = msg.get("device", "cpu")  # a vendor's rank (vendors.py): its backend, and vllm-ascend's allocations
        allocate = ascend_cache if device.startswith("npu") else allocate_cache
        cache = allocate(shape.spec(), name, msg["num_blocks"], order=order)
        self.model = TinyDecoder(shape, msg["layout"], cache)
        config = DisaggConfig(**msg["config"])
        cls = PrefillSide if msg["role"] == "prefill" else DecodeSide
        self.side = cls(bind(backend_for(device), shape.spec(), cache, name), config)
        self.spec, self.layout, self.cache = shape.spec(), msg["layout"], cache
        self.completions = {}
        port = getattr(self.side, "port", 0)
        return {"port": port, "base_port": port - config.rank if port else 0}

    def setup_cache(self, msg: dict[str, Any]) -> dict[str, Any]:
        """A side on a bare cache filled with a seeded pattern (no model): bulk and failure tests."""
        from kvplane.flows.disagg import DecodeSide, DisaggConfig, PrefillSide
        from kvplane.kv.binding import allocate_cache
        from kvplane.kv.bound import bind
        from kvplane.kv.spec import KVSpec

        if self.side is not None:
            self.side.close()
        self.spec = msgspec.msgpack.decode(msg["spec"], type=KVSpec)
        self.layout = msg["layout"]
        name, order = split_choice(self.layout)
        self.cache = allocate_cache(self.spec, name, msg["num_blocks"], order=order)
        fill(self.cache, msg["seed"])
        config = DisaggConfig(**msg["config"])
        cls = PrefillSide if msg["role"] == "prefill" else DecodeSide
        self.side = cls(bind(self.backend, self.spec, self.cache, name), config)
        self.model, self.completions = None, {}
        port = getattr(self.side, "port", 0)
        return {"port": port, "base_port": port - config.rank if port else 0}

    def prefill(self, msg: dict[str, Any]) -> dict[str, Any]:
        assert self.model is not None
        rid, prompt = msg["request_id"], msg["prompt"]
        table = {int(g): v for g, v in msg["table"].items()}
        layerwise = msg.get("layerwise", False)
        if layerwise:
            self.side.start_request(rid, table, len(prompt), token=msg.get("token"))
        delay = float(msg.get("layer_delay_s", 0.0))

        def after(name: str) -> None:
            if layerwise:
                self.side.save_layer(name)
            if delay:
                time.sleep(delay)  # a slower model: gives pushes something to overlap with

        logits = self.model.forward(prompt, 0, table, self.gather, after_layer=after)[-1]
        params = self.side.request_finished(rid, table, len(prompt), token=msg.get("token"))
        return {"params": params.to_dict(), "logits": logits.numpy().tobytes(), "first": int(logits.argmax())}

    def collect(self) -> None:
        for c in self.side.get_finished():
            self.completions[c.request_id] = {
                "state": c.state, "reason": c.reason,
                "failed": {str(g): list(ids) for g, ids in c.failed_block_ids.items()},
                "at": time.monotonic(),
            }

    def wait(self, request_id: str, timeout: float) -> dict[str, Any]:
        end = time.monotonic() + timeout
        while True:
            self.collect()
            if request_id in self.completions:
                return self.completions[request_id]
            if time.monotonic() > end:
                return {"state": "none"}
            time.sleep(0.002)


def main() -> None:
    replies = reply_channel()
    worker = Worker()
    write_frame(replies, {"ready": True})
    while (msg := read_frame(sys.stdin.buffer)) is not None:
        if msg["cmd"] == "exit":
            break
        try:
            reply = worker.handle(msg)
        except Exception as e:  # the test sees it, with the type, instead of a silent dead child
            reply = {"error": f"{type(e).__name__}: {e}"}
        write_frame(replies, reply)
    if worker.side is not None:
        worker.side.close()


if __name__ == "__main__":
    main()
