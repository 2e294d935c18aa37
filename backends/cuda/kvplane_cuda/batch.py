"""``cudaMemcpyBatchAsync``: a whole plan in one runtime call where the CUDA runtime has it (12.8+).

Written against the CUDA 12.8 / 13.0 runtime headers; the 13.x ABI ran on an H200 (CUDA 13.0, the conformance
suite, docs/results/cuda-h200.md), the 12.8-12.9 one only through the memcpy-backed stand-ins of
``kvplane/_native/async_copy.c`` (same signatures). The batch is called from C with
the plan's int64 arrays as they are. cuda-python's ``cuMemcpyBatchAsync`` binding was not used: it takes a
Python list of ``CUdeviceptr`` objects (one Python object per descriptor) and, as a driver call, needs the
context current on the calling thread; the runtime function in the ``libcudart`` torch has loaded needs neither.

ABI: 12.8-12.9 ``(dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, failIdx, stream)``; 13.x drops
``failIdx``. The batch refuses the legacy default stream, so plans on it take the ``cudaMemcpyAsync`` loop,
as do plans whose batch the driver refuses (``CopyFunction.fallback``).
"""

from __future__ import annotations

import ctypes

from kvplane.backend.vendor_copy import CopyFunction, load_library, symbol_address

BATCH_SYMBOL = "cudaMemcpyBatchAsync"
FIRST_RUNTIME_WITH_BATCH = 12080


def runtime_version(library: ctypes.CDLL) -> int | None:
    """``cudaRuntimeGetVersion`` (e.g. 12080 for 12.8), or None when it cannot be read."""
    version = ctypes.c_int(0)
    try:
        rc = library.cudaRuntimeGetVersion(ctypes.byref(version))
    except AttributeError:
        return None
    return int(version.value) if rc == 0 else None


def batch_signature(version: int | None) -> str | None:
    """The ``vendor_copy`` signature of ``cudaMemcpyBatchAsync`` in this runtime, None before 12.8."""
    if version is None or version < FIRST_RUNTIME_WITH_BATCH:
        return None
    return "cuda_batch13" if version >= 13000 else "cuda_batch12"


def with_batch(loop: CopyFunction, install_hint: str) -> CopyFunction:
    """``cudaMemcpyBatchAsync`` falling back to ``loop`` (``cudaMemcpyAsync``), or ``loop`` where there is none."""
    library, name = load_library((loop.library,), install_hint)
    signature = batch_signature(runtime_version(library))
    address = symbol_address(library, BATCH_SYMBOL) if signature is not None else None
    if signature is None or address is None:
        return loop
    return CopyFunction(address, signature, BATCH_SYMBOL, name, fallback=loop)
