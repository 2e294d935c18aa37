"""vLLM HPC attention (``hpc_attn.py``): one tensor per layer ``(nb, 2, bs, heads, head)``: K then V inside a block.

K and V are two regions whose blocks interleave: block i of K is followed by block i of V.
"""

from kvplane.kv.layouts.base import Layout, TensorSpec

BLOCK_KV = Layout(
    name="block_kv",
    family="gqa",
    shape="(nb, 2, bs, heads, head)",
    engine="vLLM HPC attention (hpc_attn)",
    tensors=(TensorSpec(("block", "kv", "token", "head", "row"), (("k",), ("v",))),),
)
