"""vLLM 0.33 MLA: every layer a ``[B, H, N, C]`` view with one head, ``(nb, 1, bs, kv_lora_rank + rope_dim)``.

vLLM 0.33 describes one cache layout for all layers (``KVCacheLayout``) and views each layer 4-D; an MLA row
holds ``kv_c`` then ``k_pe`` as in vLLM 0.27's ``(nb, bs, 576)``, behind a head dim of size 1.
"""

from kvplane.kv.layouts.base import Layout, TensorSpec

MLA_HEADS = Layout(
    name="mla_heads",
    family="mla",
    shape="(nb, 1, bs, kv_lora_rank + rope_dim)",
    engine="vLLM 0.33 MLA backends ([B, H, N, C] views)",
    tensors=(TensorSpec(("block", "head", "token", "row"), (("kv_c", "k_pe"),)),),
)
