"""The sparse-attention indexer's key cache (vLLM ``mla/indexer.py``): ``(nb, bs, index_dim)`` per layer."""

from kvplane.kv.layouts.base import Layout, TensorSpec

INDEX = Layout(
    name="index",
    family="index",
    shape="(nb, bs, index_dim)",
    engine="vLLM sparse MLA indexer (mla/indexer.py)",
    tensors=(TensorSpec(("block", "token", "row"), (("index",),)),),
)
