"""The cuda backend's ``CopyKernel`` (``kvplane.backend.gather``): a plan's descriptors in one Triton launch.

The plan's three int64 arrays travel as one ``(3, n)`` table (addresses, and lengths in words of the widest size
that divides every address and length), copied to the device on the same stream, then ``copy_descriptors``
runs with one program per descriptor and chunk of ``CHUNK_BYTES``. Triton launches on torch's current stream,
so the launch sits inside the device module's ``stream`` context. On a CPU device (``TRITON_INTERPRET=1``, the
byte tests without a GPU) the table stays in host memory and no stream is involved.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import numpy as np

from kvplane.descriptors import CopyPlan
from kvplane.errors import BackendError

if TYPE_CHECKING:
    import torch

CHUNK_BYTES = 8 << 10  # bytes one program copies: 1024 int64 words, 8 per thread of 4 warps
MAX_CHUNKS = 65535  # the grid's second axis
# tuning knobs for the GPU run's variants (docs/gpu.md), read once per kernel: bytes per program (a power of
# two), and whether 16-byte-aligned plans tell the compiler so (1) or not (0)
CHUNK_ENV, HINT_ENV = "KVPLANE_COPY_KERNEL_CHUNK", "KVPLANE_COPY_KERNEL_HINT16"


def word_size(plan: CopyPlan) -> int:
    """The widest of 8, 4, 2 and 1 bytes dividing every address and length of ``plan``."""
    bits = int(np.bitwise_or.reduce(np.concatenate([plan.src, plan.dst, plan.length])))
    return min(8, bits & -bits) if bits else 8


def block_words(word: int, max_words: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Words per program: ``chunk_bytes`` worth, or fewer for small descriptors (a power of two, >= 16)."""
    return min(max(16, chunk_bytes // word), max(16, 1 << max(0, int(max_words - 1).bit_length())))


def aligned16(plan: CopyPlan) -> bool:
    return not int(np.bitwise_or.reduce(np.concatenate([plan.src, plan.dst, plan.length]))) % 16


class TritonCopyKernel:
    """``launch(plan, stream)`` enqueues ``copy_descriptors`` for every descriptor of ``plan`` on ``stream``."""

    name = "triton copy_descriptors"

    def __init__(self, device: torch.device,
                 stream_context: Callable[[Any], AbstractContextManager[Any]] | None = None) -> None:
        self.device = device
        self._stream_context = stream_context
        chunk = int(os.environ.get(CHUNK_ENV) or CHUNK_BYTES)
        if chunk < 16 or chunk & (chunk - 1):
            raise BackendError(f"{CHUNK_ENV}={chunk}: bytes per program must be a power of two >= 16, e.g. 8192")
        self.chunk_bytes = chunk
        self.hint16 = os.environ.get(HINT_ENV, "1") != "0"

    def launch(self, plan: CopyPlan, stream: Any) -> None:
        import torch

        from kvplane_cuda.copy_kernel import copy_descriptors

        n = len(plan)
        if not n:
            return
        word = word_size(plan)
        words = plan.length // word
        block = block_words(word, int(words.max()), self.chunk_bytes)
        chunks = -(-int(words.max()) // block)
        if chunks > MAX_CHUNKS:
            raise BackendError(f"copy kernel: a descriptor of {int(plan.length.max())} B needs {chunks} programs, "
                               f"the grid allows {MAX_CHUNKS}; move descriptors this large by DMA (route='dma')")
        table = torch.from_numpy(np.ascontiguousarray(np.stack([plan.src, plan.dst, words])))
        on_device = self.device.type != "cpu"
        context = self._stream_context(stream) if on_device and self._stream_context else contextlib.nullcontext()
        with context:
            if on_device:  # pinned, so the copy is async; torch keeps the pinned block until the copy is done
                table = table.pin_memory().to(self.device, non_blocking=True)
            hint = self.hint16 and word == 8 and aligned16(plan)
            try:
                copy_descriptors[(n, chunks)](table, n, BLOCK=block, WORD=word, ALIGNED16=hint, num_warps=4)
            except Exception:  # a Triton that cannot compile the hint: the plain kernel, from now on
                if not hint:
                    raise
                self.hint16 = False
                copy_descriptors[(n, chunks)](table, n, BLOCK=block, WORD=word, ALIGNED16=False, num_warps=4)
