"""The cuda backend's ``CopyKernel`` (``kvplane.backend.gather``): a plan's descriptors in one Triton launch.

The plan's three int64 arrays travel as one ``(3, n)`` table (addresses, and lengths in words of the widest size
that divides every address and length), written into a pinned ring buffer (``PinnedTables``) and copied to the
device on the same stream, then ``copy_descriptors``
runs with one program per descriptor and chunk of ``CHUNK_BYTES``. Triton launches on torch's current stream,
so the launch sits inside the device module's ``stream`` context. On a CPU device (``TRITON_INTERPRET=1``, the
byte tests without a GPU) the table stays in host memory and no stream is involved.
"""

from __future__ import annotations

import contextlib
import os
import threading
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


def alignment(plan: CopyPlan) -> int:
    """The largest power of two dividing every address and length of ``plan`` (capped at 16)."""
    bits = int(np.bitwise_or.reduce(np.concatenate([plan.src, plan.dst, plan.length])))
    return min(16, bits & -bits) if bits else 16


def block_words(word: int, max_words: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Words per program: ``chunk_bytes`` worth, or fewer for small descriptors (a power of two, >= 16)."""
    return min(max(16, chunk_bytes // word), max(16, 1 << max(0, int(max_words - 1).bit_length())))


class PinnedTables:
    """Descriptor tables on their way to the device: written by numpy into pinned buffers reused in a ring, then
    copied on the launch's stream. torch's ``pin_memory()`` of a fresh table copied with its OpenMP threads, which
    then spun: about 100 ms of CPU per 38k-descriptor plan on the H200 (the first run, docs/results). A slot is
    written again only once the copy that read it is done (its event)."""

    SLOTS = 4

    def __init__(self, alloc: Callable[[int], Any] | None = None, new_event: Callable[[], Any] | None = None) -> None:
        self._alloc = alloc or _pinned_int64
        self._new_event = new_event or _cuda_event
        self._lock = threading.Lock()
        self._slots: list[tuple[Any, Any] | None] = [None] * self.SLOTS  # (pinned int64 tensor, event)
        self._next = 0

    def upload(self, columns: tuple[np.ndarray, ...], device: torch.device) -> torch.Tensor:
        """``columns`` as one ``(len(columns), n)`` int64 device tensor, copied on the current stream."""
        n = len(columns[0])
        size = len(columns) * n
        with self._lock:
            i, self._next = self._next, (self._next + 1) % self.SLOTS
            slot = self._slots[i]
            if slot is not None:
                slot[1].synchronize()  # the copy that last read this slot (long done, in practice)
            if slot is None or slot[0].numel() < size:
                buffer = self._alloc(max(size, 3 << 12))
            else:
                buffer = slot[0]
            host = buffer[:size].numpy().reshape(len(columns), n)
            for row, column in zip(host, columns):
                np.copyto(row, column)  # one thread: no pool left spinning
            table = buffer[:size].view(len(columns), n).to(device, non_blocking=True)
            event = self._new_event()
            event.record()  # on the current stream: the launch's
            self._slots[i] = (buffer, event)
        return table


def _pinned_int64(n: int) -> torch.Tensor:
    import torch

    return torch.empty(n, dtype=torch.int64, pin_memory=True)


def _cuda_event() -> Any:
    import torch

    return torch.cuda.Event()  # type: ignore[no-untyped-call]


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
        self._tables = PinnedTables()

    def launch(self, plan: CopyPlan, stream: Any) -> None:
        import torch

        from kvplane_cuda.copy_kernel import copy_descriptors

        n = len(plan)
        if not n:
            return
        align = alignment(plan)
        word = min(8, align)  # the widest word that divides every address and length
        words = plan.length // word
        block = block_words(word, int(words.max()), self.chunk_bytes)
        chunks = -(-int(words.max()) // block)
        if chunks > MAX_CHUNKS:
            raise BackendError(f"copy kernel: a descriptor of {int(plan.length.max())} B needs {chunks} programs, "
                               f"the grid allows {MAX_CHUNKS}; move descriptors this large by DMA (route='dma')")
        columns = (plan.src, plan.dst, words)
        on_device = self.device.type != "cpu"
        context = self._stream_context(stream) if on_device and self._stream_context else contextlib.nullcontext()
        with context:
            if on_device:
                table = self._tables.upload(columns, self.device)
            else:
                table = torch.from_numpy(np.ascontiguousarray(np.stack(columns)))
            hint = self.hint16 and align == 16
            try:
                copy_descriptors[(n, chunks)](table, n, BLOCK=block, WORD=word, ALIGNED16=hint, num_warps=4)
            except Exception:  # a Triton that cannot compile the hint: the plain kernel, from now on
                if not hint:
                    raise
                self.hint16 = False
                copy_descriptors[(n, chunks)](table, n, BLOCK=block, WORD=word, ALIGNED16=False, num_warps=4)
