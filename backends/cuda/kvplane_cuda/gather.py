"""The cuda backend's ``CopyKernel`` (``kvplane.backend.gather``): a plan's descriptors in one Triton launch.

The plan's three int64 arrays travel as one ``(3, n)`` table (addresses, and lengths in words of the widest size
that divides every address and length), copied to the device on the same stream, then ``copy_descriptors``
runs with one program per descriptor and chunk of ``CHUNK_BYTES``. Triton launches on torch's current stream,
so the launch sits inside the device module's ``stream`` context. On a CPU device (``TRITON_INTERPRET=1``, the
byte tests without a GPU) the table stays in host memory and no stream is involved.
"""

from __future__ import annotations

import contextlib
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


def word_size(plan: CopyPlan) -> int:
    """The widest of 8, 4, 2 and 1 bytes dividing every address and length of ``plan``."""
    bits = int(np.bitwise_or.reduce(np.concatenate([plan.src, plan.dst, plan.length])))
    return min(8, bits & -bits) if bits else 8


def block_words(word: int, max_words: int) -> int:
    """Words per program: ``CHUNK_BYTES`` worth, or fewer for small descriptors (a power of two, >= 16)."""
    return min(CHUNK_BYTES // word, max(16, 1 << max(0, int(max_words - 1).bit_length())))


class TritonCopyKernel:
    """``launch(plan, stream)`` enqueues ``copy_descriptors`` for every descriptor of ``plan`` on ``stream``."""

    name = "triton copy_descriptors"

    def __init__(self, device: torch.device,
                 stream_context: Callable[[Any], AbstractContextManager[Any]] | None = None) -> None:
        self.device = device
        self._stream_context = stream_context

    def launch(self, plan: CopyPlan, stream: Any) -> None:
        import torch

        from kvplane_cuda.copy_kernel import copy_descriptors

        n = len(plan)
        if not n:
            return
        word = word_size(plan)
        words = plan.length // word
        block = block_words(word, int(words.max()))
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
            copy_descriptors[(n, chunks)](table, n, BLOCK=block, WORD=word, num_warps=4)
