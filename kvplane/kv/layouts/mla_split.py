"""vllm-ascend MLA: nope ``(nb, bs, 1, kv_lora_rank)`` and rope ``(nb, bs, 1, rope_dim)`` tensors per layer.

Sparse models (DeepSeek V3.2 on Ascend) pass a third tensor, the indexer keys ``(nb, bs, 1, index_dim)``,
which becomes the ``index`` slot when the layer spec has one.
"""

from kvplane.kv.layouts.base import Layout, TensorSpec

_DIMS = ("block", "token", "head", "row")

MLA_SPLIT = Layout(
    name="mla_split",
    family="mla",
    shape="nope: (nb, bs, 1, kv_lora_rank), rope: (nb, bs, 1, rope_dim)[, index: (nb, bs, 1, index_dim)]",
    engine="vllm-ascend",
    tensors=(
        TensorSpec(_DIMS, (("kv_c",),)),
        TensorSpec(_DIMS, (("k_pe",),)),
        TensorSpec(_DIMS, (("index",),), optional=True),
    ),
)
