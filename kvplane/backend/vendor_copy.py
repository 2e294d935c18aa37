"""A vendor's async memcpy as a raw function address, and a ``CopyPlan`` enqueued through it in C.

``AcceleratorBackend._execute`` resolves its device's function once (``load_copy_function``: the library
already loaded by the device package, the symbol, the signature), then ``enqueue`` hands the plan's three
int64 arrays to ``kvplane/_native/async_copy.c``, which loops over the descriptors in C, GIL released, and stops
at the first non-zero return. Emulated devices get a memcpy-backed stand-in with the same signature from
``emulated_copy_function`` instead of the vendor library, so the same C loop runs in CI.

Signatures (checked against the vendors' documentation, see docs/backends.md):

- ``cuda``: ``cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t n, cudaMemcpyKind kind, cudaStream_t s)``
- ``acl``: ``aclError aclrtMemcpyAsync(void *dst, size_t destMax, const void *src, size_t n, aclrtMemcpyKind kind,
  aclrtStream s)``
- ``cnrt``: ``cnrtRet_t cnrtMemcpyAsync_V2(void *dst, void *src, size_t n, cnrtQueue_t q, cnrtMemTransDir_t dir)``
- ``cuda_batch12`` / ``cuda_batch13``: ``cudaMemcpyBatchAsync`` of CUDA 12.8-12.9 (with ``failIdx``) / 13.x
  (without); one call for the whole plan.
- ``plan``: ``int64_t fn(const int64_t *src, const int64_t *dst, const int64_t *len, int64_t n, int kind,
  void *stream, int *code)``, a backend package's own loop over the descriptors: -1 when all were enqueued, else
  the index of the first that failed (``n`` when it names none) with the vendor's code in ``*code``. A vendor
  whose calling convention is none of the above (Intel's SYCL queue memcpy, a future NPU's) is reached this
  way: the backend package ships the function (C, or a ``ctypes`` callback) and returns it from
  ``AcceleratorBackend.load_copy_function``; this list does not grow for it (docs/backends.md).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

from kvplane._native import optional
from kvplane.descriptors import CopyPlan
from kvplane.errors import BackendError

SIGNATURES = ("cuda", "acl", "cnrt", "cuda_batch12", "cuda_batch13", "plan")

_native, _IMPORT_ERROR = optional("_async_copy")

_libraries: dict[str, ctypes.CDLL] = {}  # loaded once, kept for the life of the process


@dataclass(frozen=True)
class CopyFunction:
    """A vendor async-memcpy entry point: where it is, how to call it, and what to call it in messages."""

    address: int
    signature: str
    symbol: str
    library: str  # the library it came from, or "emulated"
    fallback: CopyFunction | None = None  # a batched function's per-descriptor loop, for drivers that refuse it

    def __post_init__(self) -> None:
        if self.signature not in SIGNATURES:
            raise BackendError(f"copy function signature={self.signature!r} is unknown; use one of {SIGNATURES}")

    def describe(self) -> str:
        return f"{self.symbol} ({self.library})"


@dataclass(frozen=True)
class CopyFailure:
    """The vendor function returned ``code`` for descriptor ``index`` (``None``: a batch call named none)."""

    index: int | None
    code: int


def native() -> ModuleType:
    if _native is None:
        raise BackendError(
            f"kvplane's native async-copy loop is not built ({_IMPORT_ERROR}); reinstall with `pip install -e .` "
            f"on a machine with a C compiler"
        )
    return _native


def load_library(names: Sequence[str], install_hint: str) -> tuple[ctypes.CDLL, str]:
    """The first of ``names`` that loads (a library the device package already loaded is found by name)."""
    errors = []
    for name in names:
        if name in _libraries:
            return _libraries[name], name
        try:
            _libraries[name] = ctypes.CDLL(name)
            return _libraries[name], name
        except OSError as e:
            errors.append(f"{name}: {e}")
    raise BackendError(f"none of {list(names)} loads ({'; '.join(errors)}); {install_hint}")


def symbol_address(library: ctypes.CDLL, symbol: str) -> int | None:
    """The address of ``symbol`` in ``library``, or None when the library does not export it."""
    try:
        function = getattr(library, symbol)
    except AttributeError:
        return None
    address = ctypes.cast(function, ctypes.c_void_p).value
    return int(address) if address else None


def load_copy_function(libraries: Sequence[str], symbol: str, signature: str, install_hint: str) -> CopyFunction:
    library, name = load_library(libraries, install_hint)
    address = symbol_address(library, symbol)
    if address is None:
        raise BackendError(f"{name} does not export {symbol}; {install_hint}")
    return CopyFunction(address, signature, symbol, name)


def emulated_copy_function(signature: str, symbol: str) -> CopyFunction:
    """A memcpy-backed stand-in with the vendor ``signature``, for emulated devices and tests."""
    return CopyFunction(int(native().emulated_function(signature)), signature, symbol, "emulated")


def enqueue(function: CopyFunction, plan: CopyPlan, kind: int, stream_handle: int) -> CopyFailure | None:
    """Enqueue every descriptor of ``plan`` on the stream; the first failure, or None when all were accepted."""
    failed = native().copy_batch_async(
        function.address, function.signature, plan.src, plan.dst, plan.length, kind, stream_handle
    )
    if failed is None:
        return None
    index, code = int(failed[0]), int(failed[1])
    return CopyFailure(index if index < len(plan) else None, code)


def copy_error(label: str, function: CopyFunction, plan: CopyPlan, failure: CopyFailure) -> BackendError:
    """The error for a plan the vendor function refused, naming the descriptor, its bytes and the code."""
    if failure.index is None:
        where, enqueued = f"the batch of {len(plan)} descriptors", "none of them is known to have been enqueued"
    else:
        i = failure.index
        where = (
            f"descriptor {i} of {len(plan)} (src={int(plan.src[i]):#x}, dst={int(plan.dst[i]):#x}, "
            f"length={int(plan.length[i])})"
        )
        enqueued = "the descriptors before it were enqueued"
    return BackendError(
        f"{label}: {function.describe()} returned error {failure.code} for {where}; {enqueued}. Check that every "
        f"address lies in this device's memory or pinned host memory and that direction= matches the memories"
    )
