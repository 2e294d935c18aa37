"""Model shapes the bench and the conformance suite use (bf16 KV bytes per token in the comments)."""

from __future__ import annotations

from collections.abc import Callable

from kvplane.kv.spec import KVSpec

# Qwen3-0.6B: 28 layers x (k + v) x 8 heads x 128 = 114,688 B/token; 10k tokens = 1.15 GB.
# DeepSeek-V3 MLA: 61 layers x 576 = 70,272 B/token; 10k tokens = 0.70 GB.
MODELS: dict[str, Callable[[int], KVSpec]] = {
    "qwen3-0.6b": lambda block_tokens: KVSpec.gqa(28, 8, 128, tokens_per_block=block_tokens),
    "deepseek-v3": lambda block_tokens: KVSpec.mla(61, tokens_per_block=block_tokens),
}


def model_spec(name: str, block_tokens: int) -> KVSpec:
    return MODELS[name](block_tokens)
