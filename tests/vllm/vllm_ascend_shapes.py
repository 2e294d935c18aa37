"""Test support: the KV caches vllm-ascend hands to ``register_kv_caches``, read from its source, and a CPU builder that
allocates them the way its NPU model runner does.

Not a test file. vllm-ascend cannot be installed or mostly even imported here (its attention modules import
``torch_npu``), so each backend's ``get_kv_cache_shape`` is transcribed into ``ASCEND_BACKENDS`` with the file,
line and function it came from. The one module that imports without torch_npu (``vllm_ascend/attention/indexer.py``)
is also called for real by the test when a vllm-ascend source tree is given (``VLLM_ASCEND_SRC``).

Source: github.com/vllm-project/vllm-ascend main at ``SOURCE_COMMIT`` (its ``.github/vllm-release-tag.commit`` says
``v0.27.1``: the vLLM this project pins). PyPI has no vllm-ascend for vLLM 0.27.1 or 0.33.0: its newest release is
0.23.0.post1, an sdist whose build needs ``triton-ascend==3.2.2`` (``pip download`` fails preparing it), so the tag
``v0.23.0`` of the same repository (``V0230_COMMIT``) is the comparison point; differences are noted per entry.

What vllm-ascend's ``NPUModelRunner`` does (``vllm_ascend/worker/model_runner_v1.py`` at SOURCE_COMMIT):
- ``_allocate_kv_cache_tensors`` (line 3863): for each attention layer, K and V (MLA: nope and rope) are TWO separate
  int8 allocations of ``KVCacheTensor.size / split_factor`` bytes (``calc_split_factor``, ``vllm_ascend/utils.py``
  line 1392: ``total / part`` over ``[k_dim, v_dim]``), lines 4006-4051. With a KV connector configured each is
  allocated 2 MiB larger and sliced to a 2 MiB-aligned address (``_allocate_int8_cache_tensor``, line 3785, and
  ``_align_memory``, line 3686): the tensors are views that do NOT start at their storage's offset 0.
- ``_reshape_kv_cache_tensors`` (line 4104): ``k = raw_k.view(dtype).view(kv_cache_shape[1:])`` (GQA, line 4361: the
  backend's ``(2, nb, bs, h, d)`` minus its leading 2) or MLA ``(nb, bs, h, kv_lora_rank)`` /
  ``(nb, bs, h, qk_rope_head_dim)`` (lines 4367-4388); handed over as ``(k, v)`` (line 4410), or ``(k,)`` for the
  sparse C8 MLA cache.
- The SFA indexer (DeepSeek V3.2) is its own layer with ``AscendSFAIndexerCacheSpec``
  (``vllm_ascend/core/kv_cache_interface.py`` line 119; built at model_runner_v1.py line 4736): ``(k,)`` or
  ``(k, scale)``, both views of ONE aligned allocation (``_allocate_sparse_c8_indexer_tensors``, line 3808), reshaped
  at line 4208.
- Block size 128 by default (``vllm_ascend/utils.py`` ``refresh_block_size``, line 1162: lines 1173-1174 and 1194-1198; the
  backends' ``get_supported_kernel_block_sizes`` return ``[128]``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

SOURCE_REPO = "github.com/vllm-project/vllm-ascend"
SOURCE_COMMIT = "182b75ea84ff13ece27b57391331ef8935410aea"  # main, 2026-08-22; .github/vllm-release-tag.commit: v0.27.1
V0230_COMMIT = "5cb98caaadeff42b5b62b996e34bb2aaa29d20fd"  # tag v0.23.0 (vLLM 0.23.0), the last PyPI release's source
ALIGNMENT = 2 * 1024 * 1024  # model_runner_v1.py line 3882: "prefill disaggregation need ... aligned with 2M"
DEFAULT_BLOCK_SIZE = 128

# kinds of what a layer hands to register_kv_caches
GQA_KV = "gqa_k_v"  # (k, v): two allocations, each (nb, bs, heads, head)
MLA_NOPE_ROPE = "mla_nope_rope"  # (nope, rope): two allocations, (nb, bs, 1, kv_lora_rank) and (nb, bs, 1, rope_dim)
MLA_C8 = "mla_c8_k"  # (k,): sparse C8 MLA, one allocation (nb, bs, 1, head)
INDEXER = "indexer_k_scale"  # (k,) or (k, scale): one allocation
NPU_FORMAT = "npu_private_format"  # torch_npu.empty_with_format (310P NZ): no host-visible row layout
STRIDED_PAGES = "strided_pages"  # DeepSeek-V4 compressed caches: as_strided views sharing one page (_adjust_kv_layout)
STATE = "state"  # Mamba-style state lists: not KV


@dataclass(frozen=True)
class AscendBackend:
    """One vllm-ascend backend class and what its ``get_kv_cache_shape`` returns, transcribed from its source."""

    module: str
    qualname: str
    name: str  # get_name()
    source: str  # "file:line function" at SOURCE_COMMIT
    shape: Callable[[int, int, int, int], tuple[int, ...]]  # (num_blocks, block_size, heads, head_size) -> shape
    handed: str  # the kind of tuple register_kv_caches receives (GQA_KV, MLA_NOPE_ROPE, ...)
    imports_without_torch_npu: bool
    note: str = ""

    @property
    def id(self) -> str:
        return f"{self.module.removeprefix('vllm_ascend.')}.{self.qualname}"


ASCEND_BACKENDS: tuple[AscendBackend, ...] = (
    AscendBackend(
        "vllm_ascend.attention.attention_v1", "AscendAttentionBackend", "CUSTOM",
        "vllm_ascend/attention/attention_v1.py:110 AscendAttentionBackend.get_kv_cache_shape",
        lambda nb, bs, h, d: (2, nb, bs, h, d), GQA_KV, False,
        "imports torch_npu (line 23); the runner uses shape[1:] for K and for V, two allocations; same in v0.23.0",
    ),
    AscendBackend(
        "vllm_ascend.attention.fa3_v1", "AscendFABackend", "FLASH_ATTN_NPU_V3",
        "vllm_ascend/attention/fa3_v1.py:28 AscendFABackend.get_kv_cache_shape",
        lambda nb, bs, h, d: (2, nb, bs, h, d), GQA_KV, False,
        "imports flash_attn_npu_v3; allocated like AscendAttentionBackend",
    ),
    AscendBackend(
        "vllm_ascend._310p.attention.attention_v1", "AscendAttentionBackend310", "CUSTOM",
        "vllm_ascend/_310p/attention/attention_v1.py:56 AscendAttentionBackend310.get_kv_cache_shape",
        lambda nb, bs, h, d: (2, nb, (h * d) // 16, bs, 16), NPU_FORMAT, False,
        "310P: K and V each torch_npu.empty_with_format(shape[1:], acl_format) (_310p/model_runner_310p.py "
        "lines 777-797): the NZ fractal format, not a row-major host layout",
    ),
    AscendBackend(
        "vllm_ascend.attention.mla_v1", "AscendMLABackend", "ASCEND_MLA",
        "vllm_ascend/attention/mla_v1.py:88 AscendMLABackend.get_kv_cache_shape",
        lambda nb, bs, h, d: (nb, bs, h, d), MLA_NOPE_ROPE, False,
        "d = kv_lora_rank + qk_rope_head_dim (576); split into nope 512 / rope 64 (_get_attention_kv_cache_dims, "
        "model_runner_v1.py line 3760)",
    ),
    AscendBackend(
        "vllm_ascend.attention.sfa_v1", "AscendSFABackend", "ASCEND_SFA",
        "vllm_ascend/attention/sfa_v1.py:121 AscendSFABackend.get_kv_cache_shape",
        lambda nb, bs, h, d: (nb, bs, h, d), MLA_NOPE_ROPE, False,
        "DeepSeek V3.2 sparse MLA: (nope, rope), or (k,) with sparse C8 (MLA_C8); the indexer is a separate layer. "
        "v0.23.0 handed (k, v, dsa_k[, dsa_k_scale]) 3- and 4-tuples from the same layer "
        "(v0.23.0 model_runner_v1.py lines 4667-4674)",
    ),
    AscendBackend(
        "vllm_ascend.attention.indexer", "AscendSFAIndexerBackend", "ASCEND_SFA_INDEXER",
        "vllm_ascend/attention/indexer.py:47 AscendSFAIndexerBackend.get_kv_cache_shape",
        lambda nb, bs, h, d: (nb, bs, h, d), INDEXER, True,
        "imports without torch_npu: the test calls it. head = index_head_dim (128), heads = 1; the C8 variant adds "
        "a (nb, bs, 1, scale_dim=1) scale view in the same allocation",
    ),
    AscendBackend(
        "vllm_ascend.attention.dsa_v1", "AscendDSABackend", "ASCEND_DSA",
        "vllm_ascend/attention/dsa_v1.py:100 AscendDSABackend.get_kv_cache_shape (also its C4/C128/SWA/State "
        "subclasses, lines 128-172)",
        lambda nb, bs, h, d: (nb, bs, h, d), STRIDED_PAGES, False,
        "DeepSeek V4 compressed caches (use_compress): 1-3 torch.as_strided views sharing one page of "
        "page_size_bytes (_adjust_kv_layout, model_runner_v1.py line 4071, used at lines 4133-4183)",
    ),
    AscendBackend(
        "vllm_ascend.models.minimax_m3.msa_m3", "AscendMiniMaxM3IndexerBackend", "?",
        "vllm_ascend/models/minimax_m3/msa_m3.py:142 AscendMiniMaxM3IndexerBackend.get_kv_cache_shape",
        lambda nb, bs, h, d: (nb, bs, d), INDEXER, False,
        "heads are dropped (del num_kv_heads); spec is AscendSFAIndexerCacheSpec (line 180)",
    ),
    AscendBackend(
        "vllm_ascend.models.minimax_m3.msa_m3", "AscendMiniMaxM3SparseBackend", "?",
        "vllm_ascend/models/minimax_m3/msa_m3.py:554 AscendMiniMaxM3SparseBackend.get_kv_cache_shape",
        lambda nb, bs, h, d: (2, nb, bs, h, d), GQA_KV, False,
        "like AscendAttentionBackend",
    ),
)


def _allocate_int8(numel: int, kv_transfer: bool) -> torch.Tensor:
    """``_allocate_int8_cache_tensor`` (model_runner_v1.py line 3785) on CPU: with a KV connector, ``numel + 2 MiB``
    zeroed bytes sliced from the first 2 MiB-aligned address (``_align_memory``, line 3686)."""
    if not kv_transfer:
        return torch.zeros(numel, dtype=torch.int8)
    raw = torch.zeros(numel + ALIGNMENT, dtype=torch.int8)
    offset = (-raw.data_ptr()) % ALIGNMENT
    return raw[offset : offset + numel]


def ascend_kv_caches(
    backend: AscendBackend,
    num_blocks: int,
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    heads: int = 8,
    head_size: int = 128,
    head_size_v: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
    kv_lora_rank: int = 512,
    rope_dim: int = 64,
    scale_dim: int = 0,
    scale_dtype: torch.dtype = torch.float32,
    kv_transfer: bool = True,
) -> tuple[torch.Tensor, ...]:
    """The tuple one layer hands to ``register_kv_caches``, allocated on CPU as vllm-ascend allocates it on the NPU.

    GQA_KV: ``KVCacheTensor.size`` is the FullAttentionSpec page (``bs * h * (d + d_v) * itemsize``) times num_blocks;
    K gets ``size / (total / d)`` bytes and V ``size / (total / d_v)`` (lines 4010-4023), two allocations, viewed as
    ``shape[1:]`` (line 4361) and ``(*shape[1:-1], d_v)`` (lines 4362-4365). MLA_NOPE_ROPE: head_size is
    ``kv_lora_rank + rope_dim``, split the same way into ``(nb, bs, 1, kv_lora_rank)`` / ``(nb, bs, 1, rope_dim)``
    (lines 4367-4388). MLA_C8: one allocation of the whole size, ``(nb, bs, 1, head_size)`` int8 (lines 4006-4007,
    4376-4384). INDEXER: ``(nb, bs, 1, head)`` then, with ``scale_dim``, a scale view of the same allocation starting
    at the next ``scale_dtype``-aligned byte (``_allocate_sparse_c8_indexer_tensors``, lines 3808-3861; line 4208).
    NPU_FORMAT / STRIDED_PAGES / STATE raise ValueError: kvplane has no host-visible layout for them to build.
    The split sizes use vllm-ascend's float arithmetic (``int(size // (total / part))``): with ``head_size_v !=
    head_size`` it can land one byte short (e.g. 192/128 gives an odd byte count, which then fails to view as bf16),
    as it would there.
    """
    nb, bs = num_blocks, block_size
    if backend.handed == GQA_KV:
        d_v = head_size_v or head_size
        size = nb * bs * heads * (head_size + d_v) * dtype.itemsize
        shape = backend.shape(nb, bs, heads, head_size)
        k_bytes = int(size // ((head_size + d_v) / head_size))
        v_bytes = int(size // ((head_size + d_v) / d_v))
        k = _allocate_int8(k_bytes, kv_transfer).view(dtype).view(shape[1:])
        v = _allocate_int8(v_bytes, kv_transfer).view(dtype).view(*shape[1:-1], d_v)
        return k, v
    if backend.handed == MLA_NOPE_ROPE:
        d = kv_lora_rank + rope_dim
        size = nb * bs * 1 * d * dtype.itemsize
        nb_, bs_, h_, _ = backend.shape(nb, bs, 1, d)
        nope = _allocate_int8(int(size // (d / kv_lora_rank)), kv_transfer).view(dtype).view(nb_, bs_, h_, kv_lora_rank)
        rope = _allocate_int8(int(size // (d / rope_dim)), kv_transfer).view(dtype).view(nb_, bs_, h_, rope_dim)
        return nope, rope
    if backend.handed == MLA_C8:
        shape = backend.shape(nb, bs, 1, head_size)
        return (_allocate_int8(math.prod(shape), kv_transfer).view(shape),)
    if backend.handed == INDEXER:
        shape = backend.shape(nb, bs, 1, head_size)
        k_bytes = math.prod(shape) * dtype.itemsize
        if not scale_dim:
            return (_allocate_int8(k_bytes, kv_transfer).view(dtype).view(shape),)
        scale_shape = backend.shape(nb, bs, 1, scale_dim)
        scale_bytes = math.prod(scale_shape) * scale_dtype.itemsize
        scale_offset = -(-k_bytes // scale_dtype.itemsize) * scale_dtype.itemsize
        raw = _allocate_int8(scale_offset + scale_bytes, kv_transfer)
        k = raw[:k_bytes].view(dtype).view(shape)
        scale = raw[scale_offset : scale_offset + scale_bytes].view(scale_dtype).view(scale_shape)
        return k, scale
    raise ValueError(
        f"{backend.id}: vllm-ascend hands {backend.handed} caches ({backend.note}); there is no host row layout to "
        "build on CPU"
    )
