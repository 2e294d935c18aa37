"""The C loop that enqueues plans through a vendor async memcpy, driven by its memcpy-backed stand-ins.

Each vendor signature (cudaMemcpyAsync, aclrtMemcpyAsync, cnrtMemcpyAsync_V2, cudaMemcpyBatchAsync of CUDA
12.8 and 13) is called with its own argument order, so a swapped argument shows up as wrong bytes or an error.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from kvplane_cuda.batch import batch_signature, with_batch

from kvplane.backend.vendor_copy import (
    SIGNATURES,
    CopyFailure,
    CopyFunction,
    copy_error,
    emulated_copy_function,
    enqueue,
    load_copy_function,
    native,
)
from kvplane.descriptors import CopyPlan
from kvplane.errors import BackendError

I64 = np.int64
KINDS = {"cuda": 4, "acl": 2, "cnrt": 2, "cuda_batch12": 0, "cuda_batch13": 0, "plan": 2}


def plan_of(src: np.ndarray, dst: np.ndarray, descs: list[tuple[int, int, int]]) -> CopyPlan:
    return CopyPlan(
        np.array([src.ctypes.data + s for s, _, _ in descs], I64),
        np.array([dst.ctypes.data + d for _, d, _ in descs], I64),
        np.array([n for _, _, n in descs], I64),
    )


def expected(src: np.ndarray, dst: np.ndarray, descs: list[tuple[int, int, int]]) -> np.ndarray:
    out = dst.copy()
    for s, d, n in descs:
        out[d : d + n] = src[s : s + n]
    return out


@pytest.fixture
def src() -> np.ndarray:
    return np.random.default_rng(3).integers(0, 256, 1 << 16, dtype=np.uint8)


@pytest.mark.parametrize("signature", SIGNATURES)
def test_every_vendor_signature_copies_scattered_descriptors_byte_exactly(src: np.ndarray, signature: str) -> None:
    rng = np.random.default_rng(len(signature))
    order = rng.permutation(64)
    descs = [(1024 * int(i), 1024 * j + 7, 1000) for j, i in enumerate(order)]
    dst = np.zeros(src.size + 4096, np.uint8)
    want = expected(src, dst, descs)
    function = emulated_copy_function(signature, "memcpy")
    assert enqueue(function, plan_of(src, dst, descs), KINDS[signature], 0x1000) is None
    np.testing.assert_array_equal(dst, want)


@pytest.mark.parametrize("signature", ["cuda", "acl", "cnrt", "plan"])
def test_the_loop_stops_at_the_first_failing_descriptor_and_names_it(src: np.ndarray, signature: str) -> None:
    dst = np.zeros(4096, np.uint8)
    plan = plan_of(src, dst, [(0, 0, 100), (200, 200, 100), (400, 400, 100)])
    bad = CopyPlan(plan.src.copy(), plan.dst.copy(), plan.length)
    bad.src[1] = 0  # a null source: the stand-ins refuse it as the vendors do
    failure = enqueue(emulated_copy_function(signature, "memcpy"), bad, KINDS[signature], 0)
    assert failure == CopyFailure(index=1, code=1)
    np.testing.assert_array_equal(dst[:100], src[:100])  # before it: enqueued
    assert not dst[200:].any()  # it and after it: not


def test_cuda_12_batch_names_the_failing_copy_and_cuda_13_names_none(src: np.ndarray) -> None:
    dst = np.zeros(4096, np.uint8)
    plan = plan_of(src, dst, [(0, 0, 100), (200, 200, 100), (400, 400, 100)])
    bad = CopyPlan(plan.src, plan.dst.copy(), plan.length)
    bad.dst[2] = 0
    assert enqueue(emulated_copy_function("cuda_batch12", "b"), bad, 0, 0) == CopyFailure(2, 1)
    assert enqueue(emulated_copy_function("cuda_batch13", "b"), bad, 0, 0) == CopyFailure(None, 1)
    assert not dst.any()  # a batch is validated before any byte moves


def test_the_acl_stand_in_checks_dest_max_equals_the_copied_length(src: np.ndarray) -> None:
    # the loop passes destMax = count; a count above destMax would be refused, so a pass here means they match
    dst = np.zeros(8192, np.uint8)
    assert enqueue(emulated_copy_function("acl", "aclrtMemcpyAsync"), plan_of(src, dst, [(0, 0, 8192)]), 3, 0) is None
    np.testing.assert_array_equal(dst, src[:8192])


def test_the_error_names_the_backend_function_descriptor_bytes_and_code(src: np.ndarray) -> None:
    dst = np.zeros(64, np.uint8)
    plan = plan_of(src, dst, [(0, 0, 8), (8, 8, 8)])
    function = CopyFunction(1, "acl", "aclrtMemcpyAsync", "libascendcl.so")
    message = str(copy_error("npu", function, plan, CopyFailure(1, 507011)))
    assert message.startswith("npu: aclrtMemcpyAsync (libascendcl.so) returned error 507011 for descriptor 1 of 2")
    assert f"src={int(plan.src[1]):#x}" in message and "length=8" in message
    assert "descriptors before it were enqueued" in message
    batch = str(copy_error("cuda", function, plan, CopyFailure(None, 36)))
    assert "for the batch of 2 descriptors; none of them is known to have been enqueued" in batch


def test_bad_arguments_are_refused_before_any_call() -> None:
    z = np.zeros(1, I64)
    address = native().emulated_function("cuda")
    with pytest.raises(ValueError, match=r"signature='hip' is unknown"):
        native().copy_batch_async(address, "hip", z, z, z, 0, 0)
    with pytest.raises(ValueError, match=r"fn_ptr is 0"):
        native().copy_batch_async(0, "cuda", z, z, z, 0, 0)
    with pytest.raises(ValueError, match=r"equal lengths, got 1, 2, 1"):
        native().copy_batch_async(address, "cuda", z, np.zeros(2, I64), z, 0, 0)
    with pytest.raises(TypeError, match=r"src must be an int64 array"):
        native().copy_batch_async(address, "cuda", np.zeros(1, np.int32), z, z, 0, 0)
    with pytest.raises(BackendError, match=r"signature='hip' is unknown"):
        CopyFunction(address, "hip", "hipMemcpyAsync", "libamdhip64.so")


def test_a_missing_library_or_symbol_is_a_backend_error_with_the_install_hint() -> None:
    with pytest.raises(BackendError, match=r"none of \['libkvplane_no_such_runtime.so'\] loads .*; install it"):
        load_copy_function(["libkvplane_no_such_runtime.so"], "x", "cuda", "install it")
    with pytest.raises(BackendError, match=r"libc.so.6 does not export kvplaneNoSuchMemcpy; install it"):
        load_copy_function(["libc.so.6"], "kvplaneNoSuchMemcpy", "cuda", "install it")
    found = load_copy_function(["libkvplane_no_such_runtime.so", "libc.so.6"], "memcpy", "cuda", "")
    assert found.library == "libc.so.6" and found.address > 0


@pytest.mark.parametrize(
    ("version", "signature"),
    [(None, None), (12060, None), (12080, "cuda_batch12"), (12090, "cuda_batch12"), (13000, "cuda_batch13")],
)
def test_cuda_batch_abi_follows_the_runtime_version(version: int | None, signature: str | None) -> None:
    assert batch_signature(version) == signature


def test_a_runtime_without_the_batch_api_keeps_the_loop() -> None:
    loop = CopyFunction(1, "cuda", "cudaMemcpyAsync", "libc.so.6")  # libc has no cudaRuntimeGetVersion
    assert with_batch(loop, "") is loop


def test_a_ctypes_stand_in_sees_the_arguments_in_vendor_order(src: np.ndarray) -> None:
    seen: list[tuple[int, int, int, int, int]] = []
    prototype = ctypes.CFUNCTYPE(
        ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_int
    )

    @prototype
    def cnrt(dst: int, source: int, n: int, queue: int, direction: int) -> int:
        seen.append((dst, source, n, queue, direction))
        return 0

    dst = np.zeros(64, np.uint8)
    plan = plan_of(src, dst, [(0, 8, 16)])
    address = ctypes.cast(cnrt, ctypes.c_void_p).value
    assert address is not None
    assert enqueue(CopyFunction(address, "cnrt", "cnrtMemcpyAsync_V2", "test"), plan, 2, 0xABC0) is None
    assert seen == [(int(plan.dst[0]), int(plan.src[0]), 16, 0xABC0, 2)]


PLAN = ctypes.CFUNCTYPE(ctypes.c_int64, *[ctypes.POINTER(ctypes.c_int64)] * 3, ctypes.c_int64, ctypes.c_int,
                        ctypes.c_void_p, ctypes.POINTER(ctypes.c_int))


def test_a_backend_package_brings_its_own_convention_as_a_plan_function(src: np.ndarray) -> None:
    seen: list[tuple[int, int, int]] = []

    @PLAN
    def own_loop(s: ctypes.Array, d: ctypes.Array, n: ctypes.Array, count: int, kind: int, stream: int,
                 code: ctypes.Array) -> int:
        seen.append((count, kind, stream))
        for i in range(count):
            if i == 2:
                code[0] = 700  # the vendor's own error code comes back as it is
                return i
            ctypes.memmove(d[i], s[i], n[i])
        return -1

    dst = np.zeros(4096, np.uint8)
    address = ctypes.cast(own_loop, ctypes.c_void_p).value
    assert address is not None
    function = CopyFunction(address, "plan", "own_loop", "a backend package")
    plan = plan_of(src, dst, [(0, 0, 100), (200, 200, 100), (400, 400, 100)])
    assert enqueue(function, plan, 5, 0x77) == CopyFailure(index=2, code=700)
    assert seen == [(3, 5, 0x77)]  # one call for the whole plan, with the kind and the stream handle
    np.testing.assert_array_equal(dst[:300], expected(src, dst, [(0, 0, 100), (200, 200, 100)])[:300])
