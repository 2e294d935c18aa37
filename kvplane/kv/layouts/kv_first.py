"""vLLM ROCm attention (``rocm_attn.py``): one tensor per layer ``(2, nb, bs, heads, head)``; index 0 is K, 1 is V.

K and V are two regions of the same allocation, each token-major.
"""

from kvplane.kv.layouts.base import Layout, TensorSpec

KV_FIRST = Layout(
    name="kv_first",
    family="gqa",
    shape="(2, nb, bs, heads, head)",
    engine="vLLM ROCm attention (rocm_attn)",
    tensors=(TensorSpec(("kv", "block", "token", "head", "row"), (("k",), ("v",))),),
)
