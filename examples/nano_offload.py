"""kvplane's offload hooks in an engine that is not vLLM (the nano-vllm case): a tiny paged-KV decoder whose
attention forward calls ``wait_for_layer`` before reading a layer's KV and ``save_layer`` after writing it.

The prompt runs once and its full blocks are stored in the host tier, layer by layer. The device blocks are then
wiped (as if the engine had evicted them), and the same prompt runs again: ``lookup`` finds the stored prefix,
``start_load`` copies it back layer by layer, and only the tokens after it are computed. The script checks that the
loaded KV equals the stored KV bit for bit and that the last token's logits match the first run.

    python examples/nano_offload.py            # on $KVPLANE_DEVICE, else the one accelerator, else cpu
"""

from __future__ import annotations

import torch

from kvplane.backend import get_backend
from kvplane.blocks import block_hashes
from kvplane.flows.offload import OffloadConfig, OffloadEngine
from kvplane.kv.binding import allocate_cache
from kvplane.kv.bound import bind
from kvplane.kv.spec import KVSpec

LAYERS, HEADS, HEAD_DIM, BLOCK, VOCAB, NUM_BLOCKS = 4, 2, 16, 16, 97, 32


class Attention(torch.nn.Module):
    def __init__(self, name: str, cache: torch.Tensor, offload: OffloadEngine) -> None:
        super().__init__()
        self.name, self.cache, self.offload = name, cache, offload  # cache: (2, blocks, BLOCK, HEADS, HEAD_DIM)
        self.qkv = torch.nn.Linear(HEADS * HEAD_DIM, 3 * HEADS * HEAD_DIM, bias=False)
        self.out = torch.nn.Linear(HEADS * HEAD_DIM, HEADS * HEAD_DIM, bias=False)

    def forward(self, x: torch.Tensor, start: int, table: list[int]) -> torch.Tensor:
        """``x`` holds tokens ``start ..``; the KV of tokens before ``start`` is already in the cache."""
        q, k, v = self.qkv(x).view(len(x), 3, HEADS, HEAD_DIM).unbind(1)
        self.offload.wait_for_layer(self.name)  # a loaded prefix of this layer is in place; later layers keep copying
        slots = torch.arange(start, start + len(x))
        blocks = torch.tensor(table)[slots // BLOCK]
        self.cache[0, blocks, slots % BLOCK] = k
        self.cache[1, blocks, slots % BLOCK] = v
        self.offload.save_layer(self.name)  # this layer's D2H goes after the writes above
        end = start + len(x)
        ctx = self.cache[:, torch.tensor(table)].flatten(1, 2)[:, :end]  # (2, end, HEADS, HEAD_DIM)
        scores = torch.einsum("qhd,khd->hqk", q, ctx[0]) / HEAD_DIM**0.5
        causal = torch.arange(end)[None, :] <= slots[:, None]
        attn = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        return x + self.out(torch.einsum("hqk,khd->qhd", attn, ctx[1]).flatten(1))


class TinyDecoder(torch.nn.Module):
    def __init__(self, caches: dict[str, torch.Tensor], offload: OffloadEngine) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HEADS * HEAD_DIM)
        self.layers = torch.nn.ModuleList(Attention(name, cache, offload) for name, cache in caches.items())
        self.head = torch.nn.Linear(HEADS * HEAD_DIM, VOCAB, bias=False)

    @torch.no_grad()
    def forward(self, tokens: list[int], start: int, table: list[int]) -> torch.Tensor:
        x = self.embed(torch.tensor(tokens[start:]))
        for layer in self.layers:
            x = layer(x, start, table)
        return self.head(x)[-1]


def run(prompt_len: int = 70) -> dict[str, float]:
    torch.manual_seed(0)
    backend = get_backend()
    spec = KVSpec.gqa(LAYERS, HEADS, HEAD_DIM, tokens_per_block=BLOCK, dtype="float32")
    caches = allocate_cache(spec, "kv_first", NUM_BLOCKS)
    offload = OffloadEngine(bind(backend, spec, caches, "kv_first"), OffloadConfig(host_bytes=16 << 20))
    model = TinyDecoder(caches, offload)
    prompt = torch.randint(0, VOCAB, (prompt_len,)).tolist()
    hashes = block_hashes(prompt, BLOCK)
    try:
        table = list(range(3, 3 + -(-prompt_len // BLOCK)))
        if offload.lookup(hashes):
            raise RuntimeError("a fresh host tier already holds this prompt")
        offload.start_store("first", hashes, table[: len(hashes)])
        first = model(prompt, 0, table)
        offload.wait_for_save()
        stored = [c[:, table[: len(hashes)]].clone() for c in caches.values()]
        offload.wait_idle()
        done_storing, _ = offload.get_finished()  # the engine may now free "first"'s device blocks

        for cache in caches.values():
            cache.zero_()  # the engine evicted the device blocks
        table = list(range(20, 20 + -(-prompt_len // BLOCK)))
        cached = offload.lookup(hashes)
        full = cached // BLOCK
        offload.start_load("second", hashes[:full], table[:full])
        second = model(prompt, cached, table)  # computes only the tokens after the loaded prefix
        offload.wait_idle()
        _, done_loading = offload.get_finished()
        loaded = [c[:, table[:full]] for c in caches.values()]
        same_kv = all(torch.equal(a, b) for a, b in zip(stored, loaded))
        return {"prompt": prompt_len, "loaded_tokens": cached, "kv_equal": float(same_kv),
                "max_logit_diff": float((first - second).abs().max()),
                "reported": float("first" in done_storing and "second" in done_loading)}
    finally:
        offload.close()


if __name__ == "__main__":
    result = run()
    print(f"backend {get_backend().label}: loaded {result['loaded_tokens']} of {result['prompt']} prompt tokens "
          f"from the host tier; KV equal: {bool(result['kv_equal'])}; "
          f"last-token logits differ by {result['max_logit_diff']:.2e}")
