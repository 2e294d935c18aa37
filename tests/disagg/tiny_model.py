"""A tiny deterministic decoder in plain torch with a paged KV cache: the end-to-end model of the P/D tests.

Random weights from a seed (every process builds the same model), float32, one CPU thread, so a run is
reproducible bit for bit. Two attention variants: GQA (``k``/``v`` per KV head) and DeepSeek-style MLA (a
compressed ``kv_c`` plus ``k_pe`` per token, expanded per head at attention time). The KV cache is whatever
engine layout the test picks (vLLM's fused GQA, split k/v, HND, fused or split MLA), addressed through a
block table per KV-cache group, as an engine would.

Tensor parallelism: every rank computes the full projections (replicated weights) but keeps only its KV
heads in its cache and attends with its query heads; head outputs are all-gathered and concatenated before the
output projection. Attention runs head by head, so a TP run does exactly the arithmetic of a single-process
run, and logits compare bit for bit. MLA keeps its cache replicated on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from kvref import split_choice

from kvplane.kv.layouts import LayerValue
from kvplane.kv.spec import KVSpec

VOCAB, HIDDEN, LAYERS, Q_HEADS, KV_HEADS, HEAD_DIM = 64, 32, 2, 4, 2, 8
KV_LORA, ROPE = 16, 4
Gather = Callable[[torch.Tensor], torch.Tensor]  # concatenates head outputs of all TP ranks along dim 1


@dataclass(frozen=True)
class Shape:
    family: str  # "gqa" or "mla"
    block: int = 16  # tokens per block (group 0)
    block_1: int = 0  # tokens per block of group 1 in a two-group (hybrid) model; 0: one group
    tp: int = 1
    rank: int = 0

    def spec(self) -> KVSpec:
        groups = {"layer_groups": [0, 1], "group_tokens_per_block": {0: self.block, 1: self.block_1}} \
            if self.block_1 else {}
        if self.family == "gqa":
            return KVSpec.gqa(LAYERS, KV_HEADS // self.tp, HEAD_DIM, dtype="float32", tokens_per_block=self.block,
                              **groups)  # type: ignore[arg-type]
        return KVSpec.mla(LAYERS, kv_lora_rank=KV_LORA, rope_dim=ROPE, dtype="float32",
                          tokens_per_block=self.block, **groups)  # type: ignore[arg-type]


def slot_views(layout: str, value: LayerValue, kv_lora: int = KV_LORA) -> dict[str, torch.Tensor]:
    """Per slot, a ``(blocks, tokens_per_block, heads, dim)`` view of an engine layout's tensors (writes go
    through to the cache)."""
    layout = split_choice(layout)[0]
    if layout == "packed_kv":  # logical (nb, heads, bs, 2*dim), whatever the memory order
        rows = value.permute(0, 2, 1, 3)  # type: ignore[union-attr]
        d = rows.shape[-1] // 2
        return {"k": rows[..., :d], "v": rows[..., d:]}
    if layout in ("kv_first", "split_kv"):
        return {"k": value[0], "v": value[1]}  # type: ignore[index]
    if layout == "mla_fused":
        rows = value.unsqueeze(2)  # type: ignore[union-attr]
        return {"kv_c": rows[..., :kv_lora], "k_pe": rows[..., kv_lora:]}
    if layout == "mla_split":
        return {"kv_c": value[0], "k_pe": value[1]}  # type: ignore[index]
    raise ValueError(f"no views for layout {layout!r}")


class TinyDecoder:
    def __init__(self, shape: Shape, layout: str, cache: dict[str, LayerValue], seed: int = 7) -> None:
        torch.set_num_threads(1)
        self.shape, self.layout, self.cache, self.spec = shape, layout, cache, shape.spec()
        g = torch.Generator().manual_seed(seed)

        def w(*dims: int) -> torch.Tensor:
            return torch.randn(*dims, generator=g) / dims[0] ** 0.5

        self.embed, self.pos = w(VOCAB, HIDDEN), w(512, HIDDEN)
        self.layers = []
        for _ in range(LAYERS):
            if shape.family == "gqa":
                p = {"q": w(HIDDEN, Q_HEADS * HEAD_DIM), "k": w(HIDDEN, KV_HEADS * HEAD_DIM),
                     "v": w(HIDDEN, KV_HEADS * HEAD_DIM)}
            else:
                p = {"q": w(HIDDEN, Q_HEADS * (HEAD_DIM + ROPE)), "kv_c": w(HIDDEN, KV_LORA), "k_pe": w(HIDDEN, ROPE),
                     "uk": w(KV_LORA, Q_HEADS * HEAD_DIM), "uv": w(KV_LORA, Q_HEADS * HEAD_DIM)}
            p["o"], p["mlp"] = w(Q_HEADS * HEAD_DIM, HIDDEN), w(HIDDEN, HIDDEN)
            self.layers.append(p)
        self.head = w(HIDDEN, VOCAB)

    # -- the forward -------------------------------------------------------------------------------------
    def forward(
        self,
        tokens: list[int],
        start: int,
        block_table: dict[int, list[int]],
        gather: Gather | None = None,
        after_layer: Callable[[str], None] | None = None,
        before_layer: Callable[[str], None] | None = None,
    ) -> torch.Tensor:
        """Logits for ``tokens`` at positions ``start...``; their KV is written into the cache first."""
        pos = torch.arange(start, start + len(tokens))
        x = self.embed[torch.tensor(tokens)] + self.pos[pos]
        for i, (name, p) in enumerate(zip(self.spec.layer_names, self.layers)):
            if before_layer is not None:
                before_layer(name)
            ids = block_table[self.spec.layer(name).group_id]
            heads_out = self._attend(i, name, p, x, pos, ids)
            if gather is not None and self.shape.tp > 1:
                heads_out = gather(heads_out)
            x = x + heads_out.reshape(len(tokens), -1) @ p["o"]
            x = x + torch.tanh(x @ p["mlp"])
            if after_layer is not None:
                after_layer(name)
        return x @ self.head

    def _attend(self, i: int, name: str, p: dict[str, torch.Tensor], x: torch.Tensor, pos: torch.Tensor,
                ids: list[int]) -> torch.Tensor:
        views = slot_views(self.layout, self.cache[name])
        bs = self.spec.group(self.spec.layer(name).group_id).tokens_per_block
        table = torch.tensor(ids)
        n = int(pos[-1]) + 1

        def at(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return table[positions // bs], positions % bs

        write_at, read_at = at(pos), at(torch.arange(n))
        q_per_rank = Q_HEADS // self.shape.tp
        q_heads = range(self.shape.rank * q_per_rank, (self.shape.rank + 1) * q_per_rank)
        outs = []
        if self.shape.family == "gqa":
            kv_per_rank = KV_HEADS // self.shape.tp
            k_new = (x @ p["k"]).reshape(len(x), KV_HEADS, HEAD_DIM)
            v_new = (x @ p["v"]).reshape(len(x), KV_HEADS, HEAD_DIM)
            lo = self.shape.rank * kv_per_rank
            views["k"][write_at] = k_new[:, lo : lo + kv_per_rank]
            views["v"][write_at] = v_new[:, lo : lo + kv_per_rank]
            keys, values = views["k"][read_at], views["v"][read_at]  # (n, local kv heads, dim)
            q = (x @ p["q"]).reshape(len(x), Q_HEADS, HEAD_DIM)
            for h in q_heads:
                kv = h // (Q_HEADS // KV_HEADS) - lo
                outs.append(self._softmax_attend(q[:, h], keys[:, kv], values[:, kv], pos))
        else:
            views["kv_c"][write_at] = (x @ p["kv_c"])[:, None]
            views["k_pe"][write_at] = (x @ p["k_pe"])[:, None]
            kv_c, k_pe = views["kv_c"][read_at][:, 0], views["k_pe"][read_at][:, 0]
            q = (x @ p["q"]).reshape(len(x), Q_HEADS, HEAD_DIM + ROPE)
            for h in q_heads:
                k_h = torch.cat([kv_c @ p["uk"][:, h * HEAD_DIM : (h + 1) * HEAD_DIM], k_pe], dim=1)
                v_h = kv_c @ p["uv"][:, h * HEAD_DIM : (h + 1) * HEAD_DIM]
                outs.append(self._softmax_attend(q[:, h], k_h, v_h, pos))
        return torch.stack(outs, dim=1)  # (tokens, local q heads, dim)

    @staticmethod
    def _softmax_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        scores = q @ k.T / k.shape[1] ** 0.5
        causal = torch.arange(k.shape[0])[None, :] > pos[:, None]
        return torch.softmax(scores.masked_fill(causal, float("-inf")), dim=-1) @ v

    # -- generation --------------------------------------------------------------------------------------
    def decode(self, first: int, start: int, steps: int, block_table: dict[int, list[int]],
               gather: Gather | None = None) -> tuple[list[int], list[torch.Tensor]]:
        """Greedy decoding from token ``first`` at position ``start``: tokens and each step's logits."""
        tokens, logits, token = [], [], first
        for step in range(steps):
            out = self.forward([token], start + step, block_table, gather)[-1]
            logits.append(out)
            token = int(out.argmax())
            tokens.append(token)
        return tokens, logits
