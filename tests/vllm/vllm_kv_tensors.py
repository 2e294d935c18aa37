"""Test support: every attention backend class of the installed vLLM, and its KV tensors built the way vLLM builds them.

Not a test file. Tests import it to get their inputs from vLLM's own code instead of hand-written shapes:

- ``discover()`` lists every backend class found in ``vllm.v1.attention.backends`` and ``...backends.mla`` (modules,
  not sub-packages such as ``mla/prefill``) and in vLLM's backend registry enums, including modules that fail to
  import on this machine (kept as data, with the exception) and classes without a KV cache (Mamba / linear / GDN /
  short-conv state: NOT_KV; bases: ABSTRACT).
- ``attention_backends()`` keeps the KV classes: the cases a KV layer must serve or refuse.
- ``kv_tensor(...)`` builds one layer's KV tensor as vLLM's GPU model runner does; ``layer_kv_caches(...)`` the dict
  ``register_kv_caches`` receives for several layers; ``cross_layer_tensor(...)`` the cross-layer allocation and its
  per-layer views (0.27.1: the tensor handed to ``register_cross_layers_kv_cache``; 0.33.0: the shared int8 backing
  of a block-outermost layout). ``NotUsedByVllm`` says where vLLM itself would not build the requested tensor.
- ``kv_cache_layout("NHD" | "HND")`` selects the layout with vLLM's own mechanism and restores it.
- ``backend_records()`` is the data function (shapes, stride orders, refusals over a parameter grid);
  ``summary_rows()`` one row per class for docs (``python tests/vllm/vllm_kv_tensors.py`` prints them).

Works against vLLM 0.27.1 (``get_kv_cache_shape`` / ``get_kv_cache_stride_order`` on each backend class) and
vLLM 0.33.0 (no per-backend shape: a KV spec adjusted by ``customize_spec`` and one ``KVCacheLayout`` for the whole
cache, views from vLLM's ``allocate_kv_cache``); ``api_generation()`` says which.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import math
import os
import pkgutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

PACKAGES = ("vllm.v1.attention.backends", "vllm.v1.attention.backends.mla")
REGISTRY_ENUMS = ("AttentionBackendEnum", "MambaAttentionBackendEnum")
LAYOUTS = ("NHD", "HND")

# kinds of a discovered class
KV = "kv"  # has a concrete KV shape: build it
NOT_KV = "not_kv"  # Mamba / linear-attention / GDN / short-conv state: vLLM allocates a MambaSpec page, not KV
ABSTRACT = "abstract"  # a base class with no KV shape of its own
IMPORT_FAILED = "import_failed"  # the module does not import on this machine (recorded, with the exception)

STATE_MODULE_WORDS = ("mamba", "linear_attn", "gdn_attn", "short_conv", "recoverssm")


class NotUsedByVllm(Exception):
    """vLLM itself would not build this tensor (e.g. no cross-layer layout for this backend); the message says why
    and cites the vLLM code that decides it."""


@dataclass(frozen=True)
class BackendCase:
    """One backend class as discovered: where it lives, what it is, and why it can or cannot be built."""

    module: str
    qualname: str
    kind: str
    name: str | None = None  # get_name()
    is_mla: bool = False
    error: str | None = None  # the import error (IMPORT_FAILED) or why the class has no KV shape
    source: str = "package"  # "package" (found walking PACKAGES) or "registry" (only in a registry enum)
    cls: Any = field(default=None, compare=False, repr=False)

    @property
    def id(self) -> str:
        """``flash_attn.FlashAttentionBackend``, ``mla.flashmla.FlashMLABackend``; registry-only classes keep their
        module path after ``vllm.`` (two registry modules may hold classes of the same name)."""
        module = self.module.removeprefix(PACKAGES[0] + ".").removeprefix("vllm.")
        return f"{module}.{self.qualname}"


def vllm_version() -> str:
    import vllm

    return str(vllm.__version__)


def api_generation() -> str:
    """``"shape"``: backends define ``get_kv_cache_shape`` (vLLM <= 0.27.x). ``"layout"``: the cache is described by
    the KV spec and one ``KVCacheLayout`` (vLLM 0.33.0: ``vllm/v1/kv_cache_layout.py``)."""
    from vllm.v1.attention.backend import AttentionBackend

    return "shape" if hasattr(AttentionBackend, "get_kv_cache_shape") else "layout"


# ---------------------------------------------------------------------------------------------------------- discovery


def _import_error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _classify(cls: type, module: str) -> tuple[str, str | None]:
    abstract = sorted(getattr(cls, "__abstractmethods__", ()))
    if api_generation() == "layout" and cls.__qualname__.startswith("_"):
        return ABSTRACT, f"private base class; abstract methods {abstract}"
    has_shape = api_generation() == "layout" or "get_kv_cache_shape" not in abstract
    if any(word in module for word in STATE_MODULE_WORDS):
        return NOT_KV, f"state backend (Mamba/linear/GDN/short-conv), abstract methods {abstract}"
    if api_generation() == "shape" and not has_shape:
        return ABSTRACT, f"no concrete get_kv_cache_shape; abstract methods {abstract}"
    return KV, None


def _case(cls: type, module: str, source: str) -> BackendCase:
    kind, why = _classify(cls, module)
    try:
        name: str | None = cls.get_name()
    except (NotImplementedError, TypeError) as exc:
        name, why = None, why or _import_error_text(exc)
    is_mla = bool(getattr(cls, "is_mla", lambda: False)())
    return BackendCase(module, cls.__qualname__, kind, name, is_mla, why, source, cls)


@functools.lru_cache(maxsize=1)
def discover() -> tuple[BackendCase, ...]:
    """Every backend class of the installed vLLM, in module order; nothing skipped silently.

    A module that fails to import is one IMPORT_FAILED case (qualname ``"*"``) with the exception text. Registry
    entries (``vllm/v1/attention/backends/registry.py``) that live outside PACKAGES are added with source="registry"
    so a backend registered elsewhere (``vllm.models.*``) is not missed. Cached: an import that failed once can
    succeed later in the same process (a side import it needed got done by another module), so discovery runs once.
    """
    from vllm.v1.attention.backend import AttentionBackend

    cases: list[BackendCase] = []
    seen: set[tuple[str, str]] = set()
    for pkg_name in PACKAGES:
        pkg = importlib.import_module(pkg_name)
        for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda i: i.name):
            if info.ispkg:
                continue
            mod_name = f"{pkg_name}.{info.name}"
            try:
                mod = importlib.import_module(mod_name)
            except Exception as exc:  # noqa: BLE001 - recorded as data, see the docstring
                cases.append(BackendCase(mod_name, "*", IMPORT_FAILED, error=_import_error_text(exc)))
                continue
            for obj in vars(mod).values():
                if (
                    inspect.isclass(obj)
                    and issubclass(obj, AttentionBackend)
                    and obj is not AttentionBackend
                    and obj.__module__ == mod_name
                ):
                    seen.add((mod_name, obj.__qualname__))
                    cases.append(_case(obj, mod_name, "package"))
    cases.extend(_registry_cases(seen))
    return tuple(cases)


def _registry_cases(seen: set[tuple[str, str]]) -> list[BackendCase]:
    registry = importlib.import_module("vllm.v1.attention.backends.registry")
    out: list[BackendCase] = []
    for enum_name in REGISTRY_ENUMS:
        enum = getattr(registry, enum_name, None)
        if enum is None:
            continue
        for member in enum:
            path = member.value
            if not isinstance(path, str) or "." not in path:
                continue
            mod_name, qualname = path.rsplit(".", 1)
            if (mod_name, qualname) in seen or mod_name.startswith(PACKAGES[0] + "."):
                # inside the walked packages: already a case (or its module is an IMPORT_FAILED case)
                continue
            seen.add((mod_name, qualname))
            try:
                cls = getattr(importlib.import_module(mod_name), qualname)
            except Exception as exc:  # noqa: BLE001 - recorded as data
                out.append(BackendCase(mod_name, qualname, IMPORT_FAILED, error=_import_error_text(exc), source="registry"))
                continue
            out.append(_case(cls, mod_name, "registry"))
    return out


def attention_backends() -> list[BackendCase]:
    """The discovered classes that have a KV cache shape: the cases a KV layout must serve or refuse."""
    return [c for c in discover() if c.kind == KV]


# ------------------------------------------------------------------------------------------------------------ layouts


@contextlib.contextmanager
def kv_cache_layout(layout: str) -> Iterator[None]:
    """Select NHD or HND with vLLM's own mechanism, then restore it.

    vLLM 0.27.1 ``vllm/v1/attention/backends/utils.py``: ``get_kv_cache_layout()`` (line 82) is ``functools.lru_cache``d
    and reads, in order, the module global ``_KV_CACHE_LAYOUT_OVERRIDE`` (line 43, set by ``set_kv_cache_layout``,
    line 112, which also clears the cache), then ``envs.VLLM_KV_CACHE_LAYOUT`` (``vllm/envs.py`` line 1716), then the
    connector's ``get_required_kvcache_layout`` (``kv_connector/utils.py`` line 37, which needs a current VllmConfig),
    default "NHD". The override wins over the environment variable and needs no config, so it is what this uses;
    on exit the previous override is put back and the cache cleared again.

    vLLM 0.33.0 has neither: the engine core resolves one KVCacheLayout (``resolve_kv_cache_layout``,
    ``vllm/v1/attention/backends/utils.py`` line 293) from ``VLLM_KV_CACHE_LAYOUT`` (NHD/HND are aliases of
    LBNHC/LBHNC), so there this sets and restores that variable; ``kv_tensor`` takes the layout as an argument.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}: expected one of {LAYOUTS}")
    if api_generation() == "layout":
        previous_env = os.environ.get("VLLM_KV_CACHE_LAYOUT")
        os.environ["VLLM_KV_CACHE_LAYOUT"] = layout
        try:
            yield
        finally:
            if previous_env is None:
                os.environ.pop("VLLM_KV_CACHE_LAYOUT", None)
            else:
                os.environ["VLLM_KV_CACHE_LAYOUT"] = previous_env
        return
    utils = importlib.import_module("vllm.v1.attention.backends.utils")
    previous = utils._KV_CACHE_LAYOUT_OVERRIDE
    utils.set_kv_cache_layout(layout)
    try:
        if utils.get_kv_cache_layout() != layout:
            raise RuntimeError(f"vLLM's get_kv_cache_layout() ignored set_kv_cache_layout({layout!r})")
        yield
    finally:
        utils.set_kv_cache_layout(previous)



# ------------------------------------------------------------------------------------------------ vLLM 0.27.1 recipe


def cache_torch_dtype(cache_dtype_str: str, model_dtype: torch.dtype = torch.bfloat16) -> torch.dtype:
    """The element dtype vLLM gives the cache: ``get_kv_cache_torch_dtype`` (``vllm/utils/torch_utils.py``; "auto" is
    the model dtype, "fp8"/"fp8_e4m3"/"fp8_ds_mla"/"nvfp4" are uint8 storage)."""
    from vllm.utils.torch_utils import get_kv_cache_torch_dtype

    return get_kv_cache_torch_dtype(cache_dtype_str, model_dtype)


# The DeepSeek V3.2 sparse indexer's cache spec: MLAAttentionSpec(head_size=128 + 128 // 128 * 4, dtype=torch.uint8),
# vllm 0.27.1 vllm/model_executor/models/deepseek_v2.py lines 690-698 (Indexer) and 631-636 (DeepseekV32IndexerCache):
# its dtype is uint8 whatever the cache dtype string.
INDEXER_SPEC = (132, torch.uint8)


def is_indexer(cls: Any) -> bool:
    return "Indexer" in cls.__qualname__


def default_dtype(cls: Any, cache_dtype_str: str, model_dtype: torch.dtype = torch.bfloat16) -> torch.dtype:
    """The dtype of the KV spec vLLM would build for this class: INDEXER_SPEC's for an indexer, else the cache
    dtype."""
    return INDEXER_SPEC[1] if is_indexer(cls) else cache_torch_dtype(cache_dtype_str, model_dtype)


def kv_cache_shape(cls: Any, num_blocks: int, block_size: int, heads: int, head_size: int, cache_dtype_str: str) -> tuple[int, ...]:
    """The backend's logical shape, called as ``gpu_model_runner.py`` lines 7433-7439 call it (0.27.1)."""
    return tuple(cls.get_kv_cache_shape(num_blocks, block_size, heads, head_size, cache_dtype_str=cache_dtype_str))


def stride_order(cls: Any, ndim: int, include_num_layers_dimension: bool = False) -> tuple[int, ...]:
    """The stride order with vLLM's fallback: ``gpu_model_runner.py`` lines 7440-7444 (per layer) and
    ``kv_connector_model_runner_mixin.py`` lines 224-230 (cross-layer): AttributeError / NotImplementedError mean
    the identity; a wrong length is an AssertionError there too (not caught by vLLM either)."""
    try:
        if include_num_layers_dimension:
            order = tuple(cls.get_kv_cache_stride_order(include_num_layers_dimension=True))
        else:
            order = tuple(cls.get_kv_cache_stride_order())
        if len(order) != ndim:
            raise AssertionError(f"{cls.__qualname__}: stride order {order} has {len(order)} dims, shape has {ndim}")
    except (AttributeError, NotImplementedError):
        order = tuple(range(ndim))
    return order


def _inverse(order: Sequence[int]) -> list[int]:
    return [list(order).index(i) for i in range(len(order))]


def kv_tensor(
    case: BackendCase | Any,
    num_blocks: int,
    block_size: int,
    heads: int,
    head_size: int,
    *,
    model_dtype: torch.dtype = torch.bfloat16,
    cache_dtype_str: str = "auto",
    layout: str = "NHD",
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """One layer's KV tensor as vLLM hands it to ``register_kv_caches`` (CPU memory).

    vLLM 0.27.1: ``gpu_model_runner.py`` ``_allocate_kv_cache_tensors`` (line 7312: a zeroed int8 buffer of the
    page size times num_blocks), ``_reshape_kv_cache_tensors`` (line 7364: shape and stride order, lines 7433-7444)
    and ``vllm/v1/worker/gpu/attn_utils.py`` ``_reshape_attention_kv_cache`` (line 211: the unpadded, unpacked
    branch, lines 261-262: ``raw.view(dtype).view(memory_shape)``, then ``.permute(inverse order)``, line 264).
    The result has the logical shape of ``get_kv_cache_shape``; its strides say where bytes are.
    ``dtype`` is the KV spec's dtype when it is not the cache dtype's (the sparse indexer: uint8, see INDEXER_SPEC).
    """
    cls = case.cls if isinstance(case, BackendCase) else case
    dtype = dtype or default_dtype(cls, cache_dtype_str, model_dtype)
    if api_generation() == "layout":
        return _kv_tensor_033(cls, num_blocks, block_size, heads, head_size, dtype, cache_dtype_str, layout)
    with kv_cache_layout(layout):
        shape = kv_cache_shape(cls, num_blocks, block_size, heads, head_size, cache_dtype_str)
        order = stride_order(cls, len(shape))
    memory_shape = tuple(shape[i] for i in order)
    raw = torch.zeros(math.prod(shape) * dtype.itemsize, dtype=torch.int8)
    return raw.view(dtype).view(memory_shape).permute(*_inverse(order))


def uses_cross_layer(case: BackendCase | Any, cache_dtype_str: str = "auto", layout: str = "NHD") -> str | None:
    """None if vLLM would allocate a cross-layer tensor for this backend (given a connector that prefers it and a
    single KV group), else the reason: ``kv_connector_model_runner_mixin.py`` ``use_uniform_kv_cache`` lines 148-162
    (per-token-head quant refused, line 160; ``indexes_kv_by_block_stride``, ``vllm/v1/attention/backend.py`` line 206)."""
    cls = case.cls if isinstance(case, BackendCase) else case
    if api_generation() == "layout":
        supported = cls.supported_kv_cache_layouts()
        wanted = layout_033(layout, cross_layer=True)
        if supported is not None and wanted not in supported:
            return f"{cls.__qualname__}.supported_kv_cache_layouts() is {[x.name for x in supported]}, not {wanted.name}"
        return None
    from vllm.v1.kv_cache_interface import get_kv_quant_mode

    if get_kv_quant_mode(cache_dtype_str).is_per_token_head:
        return f"cache dtype {cache_dtype_str!r} is per-token-head quantised (mixin.py line 160)"
    with kv_cache_layout(layout):
        if not cls.indexes_kv_by_block_stride():
            return (
                f"{cls.__qualname__}.indexes_kv_by_block_stride() is False: no num_layers stride order, or layers "
                "outermost (backend.py line 206; mixin.py line 162)"
            )
    return None


def cross_layer_tensor(
    case: BackendCase | Any,
    num_layers: int,
    num_blocks: int,
    block_size: int,
    heads: int,
    head_size: int,
    *,
    model_dtype: torch.dtype = torch.bfloat16,
    cache_dtype_str: str = "auto",
    layout: str = "NHD",
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``(cross_tensor, per_layer_views)`` as vLLM's ``allocate_uniform_kv_caches`` builds them (0.27.1
    ``kv_connector_model_runner_mixin.py`` lines 165-255): shape ``(num_layers,) + get_kv_cache_shape(...)``
    (line 221), stride order with ``include_num_layers_dimension=True`` (lines 224-230), one int8 buffer viewed as the
    dtype in MEMORY order (lines 236-241): that un-permuted tensor is what ``register_cross_layers_kv_cache`` receives
    (``gpu_model_runner.py`` lines 7559-7569, 7676). ``permute(inverse)[i]`` is layer i's view (lines 244-253), the
    tensors ``register_kv_caches`` receives. Raises NotUsedByVllm where vLLM would not use a cross-layer tensor.
    """
    cls = case.cls if isinstance(case, BackendCase) else case
    dtype = dtype or default_dtype(cls, cache_dtype_str, model_dtype)
    if api_generation() == "layout":
        return _cross_layer_033(cls, num_layers, num_blocks, block_size, heads, head_size, dtype,
                                cache_dtype_str, layout)
    why_not = uses_cross_layer(cls, cache_dtype_str, layout)
    if why_not is not None:
        raise NotUsedByVllm(why_not)
    with kv_cache_layout(layout):
        shape = (num_layers, *kv_cache_shape(cls, num_blocks, block_size, heads, head_size, cache_dtype_str))
        order = stride_order(cls, len(shape), include_num_layers_dimension=True)
    memory_shape = tuple(shape[i] for i in order)
    cross = torch.zeros(math.prod(shape) * dtype.itemsize, dtype=torch.int8).view(dtype).view(memory_shape)
    permuted = cross.permute(*_inverse(order))
    return cross, [permuted[i] for i in range(num_layers)]


def layer_kv_caches(
    case: BackendCase | Any,
    num_layers: int,
    num_blocks: int,
    block_size: int,
    heads: int,
    head_size: int,
    *,
    model_dtype: torch.dtype = torch.bfloat16,
    cache_dtype_str: str = "auto",
    layout: str = "NHD",
    dtype: torch.dtype | None = None,
) -> dict[str, torch.Tensor]:
    """What ``register_kv_caches`` receives for ``num_layers`` same-spec layers without cross-layer blocks, keyed
    ``layer.{i}``. vLLM 0.27.1: one allocation per layer (``_allocate_kv_cache_tensors``, gpu_model_runner.py line
    7312; layers sharing a KVCacheTensor, and the packed ``block_stride`` case of hybrid models, line 7328, are not
    built here). vLLM 0.33.0: views into ONE backing allocation shared by all layers (``allocate_kv_cache``), so no
    per-layer tensor is a whole allocation there."""
    kwargs: dict[str, Any] = dict(model_dtype=model_dtype, cache_dtype_str=cache_dtype_str, layout=layout, dtype=dtype)
    if api_generation() == "layout":
        cls = case.cls if isinstance(case, BackendCase) else case
        dtype = dtype or default_dtype(cls, cache_dtype_str, model_dtype)
        views = _build_033(cls, num_layers, num_blocks, block_size, heads, head_size, dtype, cache_dtype_str, layout,
                           False)[1]
    else:
        views = [kv_tensor(case, num_blocks, block_size, heads, head_size, **kwargs) for _ in range(num_layers)]
    return {f"layer.{i}": v for i, v in enumerate(views)}


def vllm_layouts(case: BackendCase | Any) -> list[str]:
    """The layout names ``kv_tensor`` accepts for this class that vLLM could really pick: 0.27.x "NHD", "HND" (a
    backend may ignore the choice: flex always stores NHD); 0.33 the class's ``supported_kv_cache_layouts()`` in
    preference order, or all six KVCacheLayout names when it accepts any."""
    if api_generation() == "shape":
        return list(LAYOUTS)
    from vllm.v1.kv_cache_layout import KVCacheLayout

    cls = case.cls if isinstance(case, BackendCase) else case
    supported = cls.supported_kv_cache_layouts()
    return [x.name for x in (supported if supported is not None else KVCacheLayout)]


def block_dim(case: BackendCase | Any, cache_dtype_str: str = "auto", heads: int = 2, head_size: int = 128) -> int:
    """Which dimension of the logical tensor indexes blocks: 0 for every backend except ROCm's 0.27.1
    ``(2, nb, bs, heads, head)`` (1). Found by asking vLLM for a distinctive num_blocks; 0.33 views are always
    ``[B, H, N, C]``."""
    if api_generation() == "layout":
        return 0
    cls = case.cls if isinstance(case, BackendCase) else case
    marker = 7919
    shape = kv_cache_shape(cls, marker, 64, heads, head_size, cache_dtype_str)
    if shape.count(marker) != 1:
        raise ValueError(f"{cls.__qualname__}: num_blocks={marker} appears {shape.count(marker)} times in {shape}")
    return shape.index(marker)


def fill_distinct(tensor: torch.Tensor) -> torch.Tensor:
    """Write pseudo-random values 1..251 (exact in bf16, fp16 and the integer dtypes) through the tensor's own,
    possibly permuted, view, so that bytes copied to the wrong place show. Returns the tensor."""
    index = torch.arange(tensor.numel(), dtype=torch.int64).reshape(tensor.shape)
    tensor.copy_((index * 2654435761 % 251 + 1).to(tensor.dtype))
    return tensor


# ------------------------------------------------------------------------------------------------ vLLM 0.33.0 recipe
#
# vLLM 0.33.0 has no get_kv_cache_shape / get_kv_cache_stride_order. A layer's cache is described by its KV spec
# (FullAttentionSpec / MLAAttentionSpec, adjusted by ``backend.customize_spec``: vllm/v1/attention/backend.py line 141)
# and one KVCacheLayout for the whole model (vllm/v1/kv_cache_layout.py: a permutation of [L, B, H, N, C]). Every
# layer is a 4-D ``[B, H, N, C]`` view into ONE backing int8 allocation (vllm/v1/worker/utils.py allocate_kv_cache,
# line 564; vllm/v1/kv_cache_interface.py create_kv_cache_views, line 418); there is no register_cross_layers_kv_cache:
# a block-outermost layout (BLNHC, BLHNC, BHLNC) is what makes a block of every layer one range.

CROSS_LAYOUTS_033 = {"NHD": "BLNHC", "HND": "BHLNC"}  # the 0.27.1 cross-layer memory orders, by their 0.33 names


def layout_033(layout: str, cross_layer: bool) -> Any:
    """The KVCacheLayout for a familiar name: per layer, vLLM's own aliases (``vllm/config/cache.py`` line 26:
    NHD -> LBNHC, HND -> LBHNC); cross-layer, CROSS_LAYOUTS_033; any KVCacheLayout member name passes through."""
    from vllm.config.cache import _layout_from_name

    name = CROSS_LAYOUTS_033.get(layout, layout) if cross_layer else layout
    return _layout_from_name(name)


def spec_033(cls: Any, block_size: int, heads: int, head_size: int, dtype: torch.dtype, cache_dtype_str: str) -> Any:
    """The layer's KV spec as vLLM 0.33.0's attention layers build it, then ``cls.customize_spec`` (the backend's
    packing: ROCm's two head groups, FlashInfer's nvfp4 slots, TurboQuant's slot bytes). MLA:
    ``vllm/model_executor/layers/attention/mla_attention.py`` lines 1372-1399 (one head, 656/352-byte fp8_ds_mla /
    nvfp4_ds_mla rows); the others: ``vllm/model_executor/layers/attention/attention.py`` get_kv_cache_spec
    (line 611). The indexer and the sliding-window MLA cache are MLAAttentionSpec rows too (``deepseek_v2.py``
    DeepseekV32IndexerCache.get_kv_cache_spec, ``sparse_swa.py`` line 120); their model-specific page alignment and
    DeepSeek-V4's packed fp8_ds_mla row width are NOT reproduced here (they come from the model, not the backend)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, get_kv_quant_mode

    mode = get_kv_quant_mode(cache_dtype_str)
    if cls.is_mla() or is_indexer(cls) or heads == 1 and _token_row_name(cls):
        spec = MLAAttentionSpec(
            block_size=block_size, num_kv_heads=1, max_tp_shards=1, head_size=head_size, dtype=dtype,
            cache_dtype_str=cache_dtype_str, kv_quant_mode=mode,
            state_content_bytes={"fp8_ds_mla": 656, "nvfp4_ds_mla": 352}.get(cache_dtype_str),
        )
    else:
        spec = FullAttentionSpec(
            block_size=block_size, num_kv_heads=heads, head_size=head_size,
            head_size_v=getattr(cls, "head_size_v", None) or head_size, dtype=dtype, kv_quant_mode=mode,
        )
    return cls.customize_spec(spec)


def _build_033(cls: Any, num_layers: int, num_blocks: int, block_size: int, heads: int, head_size: int,
               dtype: torch.dtype, cache_dtype_str: str, layout: str, cross_layer: bool,
               ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One KV cache group of ``num_layers`` same-spec layers, planned as ``vllm/v1/core/kv_cache_planning.py``
    get_kv_cache_config_from_groups does (lines 676-724: bytes per block, ``compute_layout_strides`` with the
    interleaved block stride for block-outermost layouts) and allocated by vLLM's own ``allocate_kv_cache``."""
    from vllm.v1.kv_cache_interface import (
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
        compute_layout_strides,
    )
    from vllm.v1.worker.utils import allocate_kv_cache

    kv_layout = layout_033(layout, cross_layer)
    supported = cls.supported_kv_cache_layouts()
    if supported is not None and kv_layout not in supported:
        raise NotUsedByVllm(
            f"{cls.__qualname__}.supported_kv_cache_layouts() is {[x.name for x in supported]}: vLLM never resolves "
            f"{kv_layout.name} for it (vllm/v1/attention/backends/utils.py resolve_kv_cache_layout)"
        )
    spec = spec_033(cls, block_size, heads, head_size, dtype, cache_dtype_str)
    names = [f"layer.{i}" for i in range(num_layers)]
    bytes_per_block = spec.page_size_bytes * num_layers
    interleaved = bytes_per_block if kv_layout.is_block_outermost else None
    layer_stride, block_stride, _, _, _ = compute_layout_strides(
        spec, num_blocks, num_layers, kv_layout, fixed_strides=(None, interleaved, None, None, None)
    )
    tensor = KVCacheTensor(size=bytes_per_block * num_blocks, layers=names, layer_stride=layer_stride,
                           block_stride=block_stride)
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[tensor],
                           kv_cache_groups=[KVCacheGroupSpec(names, spec)])
    caches = allocate_kv_cache(config, torch.device("cpu"), kv_layout)
    views = [caches[n] for n in names]
    backing = torch.empty(0, dtype=torch.int8).set_(views[0].untyped_storage())
    return backing, views


def _token_row_name(cls: Any) -> bool:
    return "SparseSWA" in cls.__qualname__ or "Indexer" in cls.__qualname__ or "KpoolTail" in cls.__qualname__


def _kv_tensor_033(cls: Any, num_blocks: int, block_size: int, heads: int, head_size: int, dtype: torch.dtype,
                   cache_dtype_str: str, layout: str) -> torch.Tensor:
    return _build_033(cls, 1, num_blocks, block_size, heads, head_size, dtype, cache_dtype_str, layout, False)[1][0]


def _cross_layer_033(cls: Any, num_layers: int, num_blocks: int, block_size: int, heads: int, head_size: int,
                     dtype: torch.dtype, cache_dtype_str: str, layout: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    return _build_033(cls, num_layers, num_blocks, block_size, heads, head_size, dtype, cache_dtype_str, layout, True)


# ------------------------------------------------------------------------------------------------------ data function

GQA_HEADS = (1, 2, 8)
GQA_HEAD_SIZES = (64, 128, 80)  # 80: not a multiple of 16
BLOCK_SIZES = (16, 32, 64)
BASE_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
MLA_HEAD_SIZES = (576, 512)  # kv_lora_rank + rope (DeepSeek V2/V3); 512 is sparse_swa's semantic head_dim
RECORD_NUM_BLOCKS = 4


@dataclass(frozen=True)
class ShapeRecord:
    """What one backend class says for one parameter set (0.27.1 API); ``error`` is set instead of the shape when
    vLLM's own function raises."""

    case_id: str
    block_size: int
    heads: int
    head_size: int
    cache_dtype_str: str
    accepted: bool  # supports_kv_cache_dtype / supports_head_size / supports_block_size, as vLLM's selector asks
    shape: tuple[int, ...] | None = None
    dtype: str | None = None
    order_nhd: tuple[int, ...] | None = None
    order_hnd: tuple[int, ...] | None = None
    cross_order_nhd: tuple[int, ...] | None = None
    cross_order_hnd: tuple[int, ...] | None = None
    cross_layer: str | None = None  # None: vLLM would use a cross-layer tensor (NHD); else the reason it would not
    error: str | None = None


def accepted(cls: Any, block_size: int, head_size: int, cache_dtype_str: str) -> bool:
    """vLLM's own supports_* answers. The indexer's head-size list is the attention head's (32/64/128), not its
    cache width (INDEXER_SPEC), so the head size is not asked there."""
    try:
        return bool(
            cls.supports_kv_cache_dtype(cache_dtype_str)
            and (is_indexer(cls) or cls.supports_head_size(head_size))
            and cls.supports_block_size(block_size)
        )
    except Exception:  # noqa: BLE001 - a support query that cannot run here is "not accepted"
        return False


def cache_dtypes_for(case: BackendCase) -> tuple[str, ...]:
    """auto/fp8/fp8_e4m3 (and fp8_ds_mla for MLA-like classes: sparse_swa's 584-byte rows are only reachable with it,
    though it does not list it) plus every cache dtype the class itself lists (nvfp4, turboquant_*, ...)."""
    own = tuple(str(d) for d in getattr(case.cls, "supported_kv_cache_dtypes", ()) or ())
    mla = ("fp8_ds_mla",) if case.is_mla or _is_token_row(case) else ()
    return tuple(dict.fromkeys(BASE_CACHE_DTYPES + mla + own))


def parameter_grid(case: BackendCase) -> list[tuple[int, int, int, str]]:
    """(block_size, heads, head_size, cache_dtype_str) tuples for one case: MLA-style classes (``is_mla`` or a 3-D
    shape) get one head and MLA widths, the indexer its spec's width, the others GQA_HEADS x GQA_HEAD_SIZES; block
    sizes are BLOCK_SIZES plus the fixed kernel block sizes the class lists (128, 256, ...), head sizes also the
    ones it lists."""
    cls = case.cls
    own_heads = [h for h in _listed(cls, "get_supported_head_sizes") if isinstance(h, int)]
    if is_indexer(cls):
        heads_sizes = [(1, INDEXER_SPEC[0])]
    elif case.is_mla or _is_token_row(case):
        heads_sizes = [(1, h) for h in dict.fromkeys(MLA_HEAD_SIZES + tuple(own_heads))]
    else:
        sizes = dict.fromkeys(GQA_HEAD_SIZES + tuple(h for h in own_heads if h in (96, 256)))
        heads_sizes = [(h, d) for h in GQA_HEADS for d in sizes]
    own_blocks = [b for b in _listed(cls, "get_supported_kernel_block_sizes") if isinstance(b, int) and b > 1]
    blocks = dict.fromkeys(BLOCK_SIZES + tuple(own_blocks))
    return [(bs, h, d, c) for bs in blocks for h, d in heads_sizes for c in cache_dtypes_for(case)]


def _listed(cls: Any, method: str) -> list[Any]:
    try:
        return list(getattr(cls, method)())
    except Exception:  # noqa: BLE001 - a query that cannot run on this machine lists nothing
        return []


def _is_token_row(case: BackendCase) -> bool:
    try:
        return len(kv_cache_shape(case.cls, 2, 64, 1, 128, "auto")) == 3
    except Exception:  # noqa: BLE001
        return False


def is_row_cache(case: BackendCase) -> bool:
    """One row per token, no head dimension of its own: MLA latents, the sparse indexer, the sliding-window MLA
    cache (0.27.1 ``(nb, bs, width)``; 0.33 ``(nb, 1, bs, width)``)."""
    return bool(case.is_mla or is_indexer(case.cls) or _token_row_name(case.cls) or _is_token_row(case))


def typical_params(case: BackendCase) -> tuple[int, int]:
    """(heads, head_size) that vLLM builds for this class in practice: (1, 132) for the indexer, (1, 576) for
    MLA-like row caches (512 where the class only lists 512), else (2, 64)."""
    if is_indexer(case.cls):
        return 1, INDEXER_SPEC[0]
    if is_row_cache(case):
        listed = [h for h in _listed(case.cls, "get_supported_head_sizes") if h in (576, 512)]
        return 1, 576 if not listed or 576 in listed else listed[0]
    return 2, 64


def _orders(cls: Any, ndim: int) -> dict[str, tuple[int, ...] | None]:
    out: dict[str, tuple[int, ...] | None] = {}
    for layout in LAYOUTS:
        with kv_cache_layout(layout):
            out[f"order_{layout.lower()}"] = stride_order(cls, ndim)
            out[f"cross_order_{layout.lower()}"] = stride_order(cls, ndim + 1, include_num_layers_dimension=True)
    return out


def backend_records(cases: Sequence[BackendCase] | None = None) -> list[ShapeRecord]:
    """Shapes, stride orders (NHD, HND, cross-layer) and errors for every KV case over its parameter grid (0.27.1
    API; under the 0.33 layout API the shape comes from the KV spec: see ``kv_tensor``)."""
    records: list[ShapeRecord] = []
    for case in cases if cases is not None else attention_backends():
        for bs, heads, head, cdt in parameter_grid(case):
            base: dict[str, Any] = dict(
                case_id=case.id, block_size=bs, heads=heads, head_size=head, cache_dtype_str=cdt,
                accepted=accepted(case.cls, bs, head, cdt),
            )
            try:
                shape = kv_cache_shape(case.cls, RECORD_NUM_BLOCKS, bs, heads, head, cdt)
                dtype = str(default_dtype(case.cls, cdt)).removeprefix("torch.")
                orders = _orders(case.cls, len(shape))
                cross = uses_cross_layer(case, cdt, "NHD")
            except Exception as exc:  # noqa: BLE001 - vLLM's refusal is the datum
                records.append(ShapeRecord(**base, error=_import_error_text(exc)))
                continue
            records.append(ShapeRecord(**base, shape=shape, dtype=dtype, cross_layer=cross, **orders))
    return records


# ------------------------------------------------------------------------------------------------------ summary table

_SYMBOLS = {7: "nb", 32: "bs", 3: "heads", 64: "head", 128: "2*head"}


def _symbolic(shape: Sequence[int], layers: int | None = None) -> str:
    symbols = {**_SYMBOLS, **({layers: "L"} if layers else {})}
    return "(" + ", ".join(symbols.get(int(x), str(int(x))) for x in shape) + ")"


def summary_rows() -> list[dict[str, str]]:
    """One row per discovered class, for docs and reports: the logical shape in symbols (nb=7, bs=32, heads=3,
    head=64 are substituted back; MLA-like classes get heads=1 and their first listed head size), the memory order
    per layer for NHD/HND and cross-layer, and the element dtype for "auto" (bf16 model) and "fp8"."""
    rows: list[dict[str, str]] = []
    for case in discover():
        row = {"id": case.id, "name": case.name or "", "kind": case.kind, "note": (case.error or "")[:160]}
        if case.kind == KV:
            row.update(_describe(case))
        rows.append(row)
    return rows


def _describe(case: BackendCase) -> dict[str, str]:
    cls = case.cls
    heads, head = typical_params(case)
    heads = 3 if heads == 2 else heads  # 3 heads: a symbol of its own in the printed shapes
    cdt = "auto" if accepted(cls, 32, head, "auto") or not cls.supported_kv_cache_dtypes else cls.supported_kv_cache_dtypes[0]
    out: dict[str, str] = {"cache_dtype": cdt}
    if api_generation() == "layout":
        supported = cls.supported_kv_cache_layouts()
        out["layouts"] = "any" if supported is None else ",".join(x.name for x in supported)
    for layout in LAYOUTS:
        try:
            t = kv_tensor(case, 7, 32, heads, head, cache_dtype_str=cdt, layout=layout)
            order = sorted(range(t.dim()), key=lambda d: -t.stride(d))
            out["logical"] = _symbolic(t.shape)
            out[layout] = _symbolic([t.shape[d] for d in order])
            out["dtype"] = str(t.dtype).removeprefix("torch.")
        except Exception as exc:  # noqa: BLE001 - the refusal is the datum
            out[layout] = f"refused: {str(exc)[:90]}"
        try:
            cross, views = cross_layer_tensor(case, 5, 7, 32, heads, head, cache_dtype_str=cdt, layout=layout)
            if api_generation() == "shape":
                out[f"cross_{layout}"] = _symbolic(cross.shape, layers=5)
            else:  # one int8 backing: name the layout and the per-layer view's memory order
                v = views[0]
                order = sorted(range(v.dim()), key=lambda d: -v.stride(d))
                out[f"cross_{layout}"] = (f"{layout_033(layout, True).name}: layer view memory "
                                          f"{_symbolic([v.shape[d] for d in order])}, block stride {v.stride(0)}")
        except Exception as exc:  # noqa: BLE001
            out[f"cross_{layout}"] = f"none: {str(exc)[:90]}"
    return out


if __name__ == "__main__":
    print(f"vLLM {vllm_version()} ({api_generation()} API)")
    for r in summary_rows():
        print(" | ".join(f"{k}={v}" for k, v in r.items()))
