"""The end-to-end run of the P/D tests: a tiny model's prefill in one instance, decode in another (rank worker
processes of ``rank_pool``), against one process doing both.

``check`` compares the decode instance's generated tokens and logits, bit for bit, with one process running prefill
and decode itself (``reference``), and where both sides run TP 1 the prompt's KV in both caches, byte for byte,
read through each side's layout (``kvfill.digest``); each ``Side`` says its family, layout, block size, TP and
device.
"""

from __future__ import annotations

import uuid
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from kvref import split_choice
from pair import free_port_run
from rank_pool import Pool
from tiny_model import Shape, TinyDecoder

from kvplane.flows.disagg import TransferParams
from kvplane.kv.binding import allocate_cache

PROMPT = [int(t) for t in np.random.default_rng(3).integers(0, 64, 37)]
STEPS, NUM_BLOCKS, WAIT_S = 4, 24, 30.0


@dataclass(frozen=True)
class Side:
    family: str
    layout: str
    block: int = 16
    tp: int = 1
    block_1: int = 0
    device: str = "cpu"  # or a vendor's emulated rank (vendors.py)

    def shape(self, rank: int = 0) -> Shape:
        return Shape(self.family, self.block, self.block_1, self.tp, rank)

    def table(self, seed: int, tokens: int) -> dict[int, list[int]]:
        rng = np.random.default_rng(seed)
        out = {0: rng.choice(NUM_BLOCKS, -(-tokens // self.block), replace=False).tolist()}
        if self.block_1:
            out[1] = rng.choice(NUM_BLOCKS, -(-tokens // self.block_1), replace=False).tolist()
        return out


def reference(side: Side) -> tuple[list[int], torch.Tensor]:
    """One process, TP 1: prefill, then decode; tokens and every logit row (prefill's last, then each step)."""
    threads = torch.get_num_threads()
    try:
        one = Side(side.family, side.layout, side.block, 1, side.block_1)
        name, order = split_choice(side.layout)
        model = TinyDecoder(one.shape(), side.layout,
                            allocate_cache(one.shape().spec(), name, NUM_BLOCKS, order=order))
        table = one.table(99, len(PROMPT) + STEPS)
        last = model.forward(PROMPT, 0, table)[-1]
        tokens, logits = model.decode(int(last.argmax()), len(PROMPT), STEPS, table)
        return tokens, torch.stack([last, *logits])
    finally:
        torch.set_num_threads(threads)


def logits_of(raw: bytes, rows: int) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(raw, dtype=np.float32).copy()).reshape(rows, -1)


def setup(pool: Pool, prefill: Side, decode: Side, engine: str, mode: str, **bounds: Any) -> tuple[list[Any], list[Any], int]:
    boot = {"prefill": uuid.uuid4().hex, "decode": uuid.uuid4().hex}
    base_port = free_port_run(prefill.tp) if prefill.tp > 1 else 0  # 0: rank 0 takes any port
    p_workers, d_workers = pool.prefill[: prefill.tp], pool.decode[: decode.tp]
    for role, side, workers in (("prefill", prefill, p_workers), ("decode", decode, d_workers)):
        for rank, w in enumerate(workers):
            config = {"engine_id": f"{role}-e2e", "boot_id": boot[role], "rank": rank, "tp_size": side.tp,
                      "transport": engine, "mode": mode, "port": base_port if role == "prefill" else 0, **bounds}
            reply = w.ask(cmd="setup", role=role, shape=asdict(side.shape(rank)), layout=side.layout,
                          config=config, num_blocks=NUM_BLOCKS, device=side.device)
            assert "error" not in reply, reply
            if role == "prefill" and rank == 0:
                base_port = reply["base_port"]
    return p_workers, d_workers, base_port


def run_pd(pool: Pool, prefill: Side, decode: Side, engine: str, mode: str, push_first: bool = True,
           **bounds: Any) -> tuple[list[int], torch.Tensor]:
    p_workers, d_workers, base_port = setup(pool, prefill, decode, engine, mode, **bounds)
    request = f"req-{uuid.uuid4().hex[:6]}"
    p_table, d_table = prefill.table(1, len(PROMPT)), decode.table(2, len(PROMPT) + STEPS)
    pre_params = TransferParams.for_push("prefill-e2e", request, "127.0.0.1", base_port, tp_size=prefill.tp,
                                         mode=mode).to_dict()  # type: ignore[arg-type]
    pushing = mode in ("push", "layerwise")
    token = pre_params["kvplane_token"]  # a proxy (push) or the scheduler (pull) gives every prefill rank one
    if pushing and push_first:
        for w in d_workers:
            assert w.ask(cmd="push", request_id=request, params=pre_params, table=d_table,
                         num_tokens=len(PROMPT)) == {}
    for w in p_workers:
        w.send(cmd="prefill", request_id=request, prompt=PROMPT, table=p_table, layerwise=mode == "layerwise",
               token=token)
    outs = [w.read(60) for w in p_workers]
    assert all("error" not in o for o in outs), outs
    for w in d_workers:
        if not pushing:
            assert w.ask(cmd="pull", request_id=request, params=outs[0]["params"], table=d_table) == {}
        elif not push_first:
            assert w.ask(cmd="push", request_id=request, params=pre_params, table=d_table,
                         num_tokens=len(PROMPT)) == {}
    for w in d_workers:
        done = w.ask(cmd="wait", request_id=request, within=WAIT_S)
        assert done.get("state") == "done", done
    if prefill.tp == decode.tp == 1:  # the bytes themselves, read through each side's layout, before decode writes
        moved = [w.ask(cmd="digest", table=t, tokens=len(PROMPT))["digest"]
                 for w, t in ((p_workers[0], p_table), (d_workers[0], d_table))]
        assert moved[0] == moved[1], "the decode's KV of the prompt differs from the prefill's"
    for w in d_workers:
        w.send(cmd="decode", first=outs[0]["first"], start=len(PROMPT), steps=STEPS, table=d_table)
    decoded = [w.read(60) for w in d_workers]
    for w in p_workers:  # the prefill released the blocks: every decode rank finished with them
        assert w.ask(cmd="wait", request_id=request, within=WAIT_S)["state"] == "done"
        assert w.ask(cmd="held")["held"] == 0
    for other in decoded[1:]:
        assert other["tokens"] == decoded[0]["tokens"]
    first_logits = logits_of(outs[0]["logits"], 1)
    return decoded[0]["tokens"], torch.cat([first_logits, logits_of(decoded[0]["logits"], STEPS)])


def check(pool: Pool, prefill: Side, decode: Side, engine: str, mode: str, push_first: bool = True,
          **bounds: Any) -> None:
    tokens, logits = run_pd(pool, prefill, decode, engine, mode, push_first, **bounds)
    want_tokens, want_logits = reference(prefill)
    assert tokens == want_tokens
    assert torch.equal(logits, want_logits), (logits - want_logits).abs().max()
