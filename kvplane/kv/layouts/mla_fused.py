"""vLLM MLA: one tensor per layer, ``(nb, bs, kv_lora_rank + rope_dim)`` (512 + 64 = 576 for DeepSeek).

Each token row holds ``kv_c`` then ``k_pe``; the region is the fused slot ``kv_c+k_pe``. Moving it to a split
layout needs staging and a re-layout (the planner's job).
"""

from kvplane.kv.layouts.base import Layout, TensorSpec

FUSED_SLOT = "kv_c+k_pe"

MLA_FUSED = Layout(
    name="mla_fused",
    family="mla",
    shape="(nb, bs, kv_lora_rank + rope_dim)",
    engine="vLLM MLA backends (mla/*.py, bf16 caches)",
    tensors=(TensorSpec(("block", "token", "row"), (("kv_c", "k_pe"),)),),
)
