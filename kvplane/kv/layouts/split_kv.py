"""vllm-ascend GQA/MHA: a ``(k, v)`` tuple per layer, each ``(nb, bs, heads, head)``."""

from kvplane.kv.layouts.base import Layout, TensorSpec

SPLIT_KV = Layout(
    name="split_kv",
    family="gqa",
    shape="k, v: (nb, bs, heads, head)",
    engine="vllm-ascend",
    tensors=(
        TensorSpec(("block", "token", "head", "row"), (("k",),)),
        TensorSpec(("block", "token", "head", "row"), (("v",),)),
    ),
)
