"""vLLM 0.27+ GQA/MHA: one tensor per layer, K and V packed in the row: logical ``(nb, heads, bs, 2*head)``.

K is the first ``head`` elements of each row, V the rest. vLLM allocates it NHD by default (memory
``(nb, bs, heads, 2*head)``) or HND (``(nb, heads, bs, 2*head)``) and hands connectors the logical view; the
strides say which. Allocated by FlashAttention, FlashInfer, Triton, FlexAttention, ROCm AITER FA and the CPU
backend; a cross-layer tensor is this shape with a layer dim in front.
"""

from kvplane.kv.layouts.base import Layout, TensorSpec

PACKED_KV = Layout(
    name="packed_kv",
    family="gqa",
    shape="(nb, heads, bs, 2*head)",
    engine="vLLM 0.27+ (flash_attn, flashinfer, triton_attn, flex_attention, rocm_aiter_fa, cpu_attn)",
    tensors=(TensorSpec(("block", "head", "token", "row"), (("k", "v"),)),),
)
