"""The cuda backend's copy kernel: every descriptor of a plan copied by one Triton launch.

Program ``(i, c)`` copies chunk ``c`` of descriptor ``i``: ``BLOCK`` words of ``WORD`` bytes from
``table[0, i]`` to ``table[1, i]``, of ``table[2, i]`` words in all; ``ALIGNED16`` tells the compiler every
address is a multiple of 16 bytes. Addresses are raw and may be device memory or pinned host memory (unified
addressing makes both reachable from a kernel). This module imports Triton, so it is imported only when a copy
kernel is wanted; under ``TRITON_INTERPRET=1`` the same kernel runs on CPU tensors, which is how its bytes are
tested on machines without a GPU.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit  # type: ignore[untyped-decorator]
def copy_descriptors(table, count, BLOCK: tl.constexpr, WORD: tl.constexpr,  # type: ignore[no-untyped-def]
                     ALIGNED16: tl.constexpr = False):
    i = tl.program_id(0)
    chunk = tl.program_id(1).to(tl.int64)
    src = tl.load(table + i)
    dst = tl.load(table + count + i)
    if ALIGNED16:  # every address is a multiple of 16: the compiler may use 16-byte loads and stores
        src = tl.multiple_of(src, 16)
        dst = tl.multiple_of(dst, 16)
    words = tl.load(table + 2 * count + i)
    offsets = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < words
    if WORD == 8:
        s = src.to(tl.pointer_type(tl.int64))
        d = dst.to(tl.pointer_type(tl.int64))
    elif WORD == 4:
        s = src.to(tl.pointer_type(tl.int32))
        d = dst.to(tl.pointer_type(tl.int32))
    elif WORD == 2:
        s = src.to(tl.pointer_type(tl.int16))
        d = dst.to(tl.pointer_type(tl.int16))
    else:
        s = src.to(tl.pointer_type(tl.int8))
        d = dst.to(tl.pointer_type(tl.int8))
    tl.store(d + offsets, tl.load(s + offsets, mask=mask), mask=mask)
