"""The toy vendor's copy function, C-callable: ``toy_copy_plan`` with kvplane's ``plan`` signature.

Its "vendor API" copies one descriptor as ``toy_memcpy(dst, src, n)`` with the direction checked up front, a
convention none of kvplane's listed signatures has; so the package loops over the plan itself. Here the loop is
a ``ctypes`` callback (a real package would compile it); kvplane's native loop calls it by address.
"""

from __future__ import annotations

import ctypes
from typing import Any

KINDS = {"h2d": 1, "d2h": 2, "d2d": 3}
INVALID = 22  # what the toy runtime returns for a refused descriptor
Int64s = ctypes.POINTER(ctypes.c_int64)
PLAN = ctypes.CFUNCTYPE(ctypes.c_int64, Int64s, Int64s, Int64s, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p,
                        ctypes.POINTER(ctypes.c_int))
calls: list[int] = []  # descriptors per call, so tests can see the function ran


@PLAN
def toy_copy_plan(src: Any, dst: Any, length: Any, n: int, kind: int, stream: Any, code: Any) -> int:
    calls.append(n)
    for i in range(n):
        if kind not in KINDS.values() or not src[i] or not dst[i]:
            code[0] = INVALID
            return i
        ctypes.memmove(dst[i], src[i], length[i])
    return -1


def address() -> int:
    value = ctypes.cast(toy_copy_plan, ctypes.c_void_p).value
    assert value is not None
    return int(value)
