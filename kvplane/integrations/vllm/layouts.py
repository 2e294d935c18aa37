"""Which kvplane layout serves a vLLM attention backend, read from the backend's own shape function.

vLLM's model runner allocates each layer's KV with ``attn_backend.get_kv_cache_shape(...)`` (the logical shape)
permuted by ``get_kv_cache_stride_order()`` (the memory order), and hands connectors the logical view. Calling
the shape function with sizes that cannot be mistaken for one another shows which logical dimension holds the
blocks, tokens, heads, the K/V split and the row, and whether K and V share a row. That is matched against
kvplane's layout specs: no table of backend names, so a backend a later vLLM adds is served when its shape is
one kvplane knows, and refused, naming the class, shape and dtype, when it is not (quantised formats with
inline scales, FlashInfer's nvfp4 cache, sparse FP8 MLA rows). The strides of the real tensor then say NHD or
HND; this module only decides the logical layout. vLLM itself is never imported here.
"""

from __future__ import annotations

from typing import Any

from kvplane.errors import LayoutError
from kvplane.kv.layouts import LAYOUTS, Layout, TensorSpec

PROBE_BLOCKS = 1237  # a prime no block size, head count or head size equals
PROBE_HEADS = (3, 5, 7, 11, 13)
PROBE_BLOCK_SIZES = (16, 32, 64, 128, 256, 48, 80, 112)


def backend_name(backend: Any) -> str:
    return f"{getattr(backend, '__module__', '?')}.{getattr(backend, '__qualname__', repr(backend))}"


def _shape(backend: Any, block_size: int, heads: int, head_size: int, cache_dtype: str) -> tuple[int, ...] | None:
    try:
        return tuple(int(n) for n in backend.get_kv_cache_shape(
            PROBE_BLOCKS, block_size, heads, head_size, cache_dtype_str=cache_dtype))
    except (ValueError, AssertionError, NotImplementedError, KeyError):
        return None  # this block size (or dtype) is not one the backend accepts: try another


def probe_shape(
    backend: Any, family: str, head_size: int, block_size: int, cache_dtype: str = "auto"
) -> tuple[tuple[int, ...], int, int]:
    """The backend's logical shape for distinct probe sizes: ``(shape, block_size, heads)`` used."""
    heads_options = (1,) if family in ("mla", "index") else PROBE_HEADS
    sizes = (block_size, *(b for b in PROBE_BLOCK_SIZES if b != block_size))
    for bs in sizes:
        for heads in heads_options:
            taken = {PROBE_BLOCKS, 2, heads, head_size, 2 * head_size}
            if bs in taken or (heads != 1 and heads in {bs, head_size, 2 * head_size, 2}):
                continue
            shape = _shape(backend, bs, heads, head_size, cache_dtype)
            if shape is not None:
                return shape, bs, heads
    served = "; ".join(f"{lay.name} {lay.shape}" for lay in LAYOUTS.values() if lay.family == family)
    raise LayoutError(
        f"vLLM attention backend {backend_name(backend)}: get_kv_cache_shape refused every probe (block sizes "
        f"{sizes}, head_size={head_size}, {family} KV, cache_dtype={cache_dtype!r}), so kvplane cannot read its KV "
        f"layout; kvplane serves {served}. Run this model with an attention backend that allocates one of those"
    )


def _dims(shape: tuple[int, ...], bs: int, heads: int, head_size: int, family: str) -> TensorSpec | None:
    """The tensor spec the probed shape spells, or ``None`` when some dimension means nothing kvplane knows."""
    slots = ("kv_c", "k_pe") if family == "mla" else ("k", "v")
    roles = {PROBE_BLOCKS: "block", bs: "token", 2: "kv"}
    if heads != 1:
        roles[heads] = "head"
    dims: list[str] = []
    packed = False
    for i, n in enumerate(shape):
        if i == len(shape) - 1 and n in (head_size, 2 * head_size):
            dims.append("row")
            packed = family == "gqa" and n == 2 * head_size
        elif n in roles and roles[n] not in dims:
            dims.append(roles[n])
        elif n == 1 and family in ("mla", "index") and "head" not in dims:
            dims.append("head")
        else:
            return None
    if family == "mla":
        rows: tuple[tuple[str, ...], ...] = ((slots[0], slots[1]),)
    elif family == "index":
        rows = (("index",),)
    elif packed:
        rows = ((slots[0], slots[1]),)
    else:
        rows = ((slots[0],), (slots[1],)) if "kv" in dims else ()
    if not rows:
        return None
    try:
        return TensorSpec(tuple(dims), rows)
    except LayoutError:
        return None


def layout_for_backend(
    backend: Any, family: str, head_size: int, block_size: int, dtype: str, cache_dtype: str = "auto"
) -> Layout:
    """The kvplane layout of the tensors ``backend`` allocates; ``LayoutError`` naming what is served otherwise.

    ``head_size`` is vLLM's (for MLA the whole row, kv_lora_rank + rope dim); ``dtype`` is the cache tensor's.
    """
    shape, bs, heads = probe_shape(backend, family, head_size, block_size, cache_dtype)
    spec = _dims(shape, bs, heads, head_size, family)
    for layout in LAYOUTS.values():
        if spec is not None and layout.family == family and layout.tensors == (spec,):
            return layout
    served = "; ".join(f"{lay.name} {lay.shape}" for lay in LAYOUTS.values() if lay.family == family)
    raise LayoutError(
        f"vLLM attention backend {backend_name(backend)} allocates {family} KV of logical shape {shape} for "
        f"num_blocks={PROBE_BLOCKS}, block_size={bs}, num_kv_heads={heads}, head_size={head_size}, dtype={dtype}, "
        f"cache_dtype={cache_dtype!r}; kvplane serves {served}. Run this model with an attention backend that "
        f"allocates one of those (FLASH_ATTN, FLASHINFER, TRITON_ATTN; an MLA backend with a bf16 cache) or "
        f"without the kvplane connector"
    )


def cross_layer_logical(kv_cache: Any, backend: Any) -> Any:
    """vLLM's cross-layer tensor (passed in memory order) viewed in its logical shape, layers first.

    ``allocate_uniform_kv_caches`` allocates ``(num_layers, *get_kv_cache_shape(...))`` permuted by
    ``get_kv_cache_stride_order(include_num_layers_dimension=True)`` and passes that memory-order tensor.
    """
    try:
        order = tuple(backend.get_kv_cache_stride_order(include_num_layers_dimension=True))
    except (AttributeError, NotImplementedError):
        order = tuple(range(kv_cache.dim()))
    if sorted(order) != list(range(kv_cache.dim())):
        raise LayoutError(
            f"vLLM attention backend {backend_name(backend)}: stride order {order} does not permute the "
            f"{kv_cache.dim()}-dim cross-layer tensor of shape {tuple(kv_cache.shape)}"
        )
    return kv_cache.permute(*[order.index(i) for i in range(len(order))])
